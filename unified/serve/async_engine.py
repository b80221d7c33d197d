"""The engine loop on its own thread, feeding asyncio request handlers.

The HTTP side never touches the engine: it posts `add` and `abort` messages to an inbox that the engine
thread drains between steps, and receives per-request updates (new tokens of each of the n sequences,
then the final output) on an asyncio queue. The first message a request receives says whether the engine
accepted it, so a handler can answer 400 before it starts a stream. A request that fails (alone, or with
every other when a step fails) receives an exception instead of its final output. A request whose
consumer goes away (client disconnect) is aborted, which frees its KV blocks at the next step boundary.
A weight update is a message too: it is applied between two steps, while requests stay in flight.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from unified.engine.llm_engine import LLMEngine
from unified.engine.outputs import RequestOutput
from unified.engine.sampler import TokenLogprob
from unified.engine.sampling_params import InvalidRequest, SamplingParams
from unified.engine.traced_steps import TracedDecodeSteps
from unified.errors import UserError
from unified.runtime.comm import CommLedger, recording
from unified.serve.thread_futures import settle_from_thread

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.25
KEEP_ALIVE_S = 60.0  # an idle driver messages its followers this often (their waits time out after 30 min)


@dataclass
class Delta:
    """New tokens of one of a request's sequences since the previous update."""
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool  # the sequence ended with these tokens; its text comes with the final output


@dataclass
class Update:
    deltas: list[Delta]
    final: RequestOutput | None = None  # set on the last update


@dataclass
class _Stream:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    images: object = None  # the ImageInputs (pixels) of the prompt's image placeholders
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: list[int] = field(default_factory=list)  # output tokens already delivered, per sequence
    seqs: list = field(default_factory=list)


ASLEEP = "the server went to sleep (POST /sleep) before this request finished; retry after it wakes up"

class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step=None):
        """`on_step(stats, new_tokens, step_seconds, collective_seconds)` is called on the engine thread after
        each step and while idle; `stats` is None between refreshes, `collective_seconds` (by kind) is empty
        in one process."""
        self.engine = engine
        if isinstance(engine.runner.graphs, TracedDecodeSteps):
            # Recording a trace takes as long as many steps, all of which every stream would wait out (and a
            # shutdown's last events with them): the server decodes small steps eagerly.
            engine.runner.graphs.record_after = None
        self._on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._ledger = CommLedger()
        self._stats_at = float("-inf")

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # Called from the event loop ----------------------------------------------------------------------

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                     images=None) -> asyncio.Queue:
        """Queues a request; returns its update queue once the engine accepted it, or raises InvalidRequest."""
        stream = _Stream(request_id, prompt, params, asyncio.get_running_loop(), images)
        self._post(("add", stream))
        accepted = await stream.queue.get()
        if isinstance(accepted, Exception):
            raise accepted
        return stream.queue

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    async def update_weights(self, path: str, staged: dict) -> int:
        """Swaps in `staged` (see `stage_weights`) at the next step boundary; returns the new weights
        version once every rank serves it, or raises WeightMismatch with the old weights kept."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._post(("update_weights", (path, staged, loop, done)))
        return await done

    async def between_steps(self, work):
        """Runs `work()` on the engine thread at the next step boundary (requests stay in flight); returns
        its result, or raises what it raised."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._post(("call", (work, loop, done)))
        return await done

    def cancel_all(self, reason: str) -> None:
        """Ends every in-flight request with an error that says `reason` (used at the shutdown deadline)."""
        self._post(("cancel_all", reason))

    def _post(self, message) -> None:
        self._inbox.put(message)
        self._wake.set()

    # The engine thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        busy = time.monotonic()
        while not self._stopping:
            self._drain_inbox()
            if not engine.has_unfinished():
                self._publish_stats(0, 0.0)
                self._wake.wait(0.5)
                self._wake.clear()
                if time.monotonic() - busy > KEEP_ALIVE_S:  # followers' waits must not time out while idle
                    engine.runner.keep_alive()
                    busy = time.monotonic()
                continue
            busy = time.monotonic()
            start = time.perf_counter()
            self._ledger.reset()
            try:
                with recording(self._ledger) if engine.runner.distributed else contextlib.nullcontext():
                    finished = engine.step()
            except Exception as err:  # a bug, not bad input: fail what is in flight, keep serving
                log.exception("engine step failed; failing %d in-flight requests", len(self._streams))
                self._fail_all(err)
                continue
            self._publish(finished, time.perf_counter() - start)
        self._fail_all(RuntimeError("the server is shutting down"))
        engine.shutdown()  # releases the ranks that follow this one, from the thread that drove them

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload)
            elif kind == "cancel_all":
                self._fail_all(RuntimeError(payload))
            elif kind == "update_weights":
                self._update_weights(*payload)
            elif kind == "call":
                self._call(*payload)
            elif payload in self._streams:
                del self._streams[payload]
                self.engine.abort(payload)

    def _add(self, stream: _Stream) -> None:
        if not self.engine.runner.cache.allocated:  # the rest of a request that was being queued as sleep came
            for update in (True, RuntimeError(ASLEEP)):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, update)
            return
        try:
            self.engine.add_request(stream.prompt, stream.params, stream.request_id, stream.images)
        except InvalidRequest as err:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)
            return
        stream.images = None  # the engine keeps their pixels
        stream.seqs = self.engine.sequences(stream.request_id)
        stream.sent = [0] * len(stream.seqs)
        self._streams[stream.request_id] = stream
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, True)

    def _update_weights(self, path: str, staged: dict, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        try:
            outcome = self.engine.update_weights(path, staged)
        except UserError as err:  # WeightMismatch, or weights freed by sleep
            outcome = err
        except Exception as err:  # a bug: report it to the caller, keep serving
            log.exception("weight update failed")
            outcome = err
        settle_from_thread(loop, done, outcome)
        self._stats_at = float("-inf")  # the prefix-cache figures changed

    def _call(self, work, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        try:
            outcome = work()
        except Exception as err:  # noqa: BLE001 - the caller decides; the engine goes on serving
            outcome = err
        settle_from_thread(loop, done, outcome)
        self._stats_at = float("-inf")  # the prefix-cache figures may have changed

    def _publish(self, finished: list[RequestOutput], seconds: float) -> None:
        done = {output.request_id: output for output in finished}
        new_tokens = 0
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, stream in list(self._streams.items()):
            deltas = []
            for i, seq in enumerate(stream.seqs):
                outputs = seq.output_token_ids
                if len(outputs) > stream.sent[i]:
                    start = stream.sent[i]
                    logprobs = seq.logprobs[start:] if seq.params.logprobs is not None else None
                    deltas.append(Delta(i, outputs[start:], logprobs, seq.is_finished))
                    new_tokens += len(outputs) - start
                    stream.sent[i] = len(outputs)
            final = done.get(request_id)
            if final is not None:
                del self._streams[request_id]
            if final is not None and final.error is not None:  # it failed alone; the engine logged why
                by_loop.setdefault(stream.loop, []).append((stream.queue, RuntimeError(final.error)))
            elif deltas or final is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, Update(deltas, final)))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)
        self._publish_stats(new_tokens, seconds)

    def _publish_stats(self, new_tokens: int, seconds: float) -> None:
        if not self._on_step:
            return
        # Engine stats walk every running sequence's blocks: refresh them a few times a second, not every step.
        now, stats = time.monotonic(), None
        if now - self._stats_at >= STATS_INTERVAL_S or not seconds:
            stats, self._stats_at = self.engine.stats(), now
        self._on_step(stats, new_tokens, seconds, dict(self._ledger.seconds) if seconds else {})

    def _fail_all(self, err: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)
        self._streams.clear()


def _deliver(items: list[tuple[asyncio.Queue, Update | Exception]]) -> None:
    for q, update in items:
        q.put_nowait(update)
