"""`POST /v1/chat/completions`, `POST /v1/completions` and `GET /v1/models[/{id}]` in the shapes of the
OpenAI API reference.

A handler turns the body into prompt token ids and sampling options (every limit checked here, before
the engine sees the request), submits each prompt to the engine loop, and either collects the final
outputs or streams chunks as server-sent events. A client that goes away aborts its requests, which frees
their KV blocks at the next step boundary: streams notice when a write fails, other requests through a
watcher on the connection. With a conversation log, a chat completion is on disk before the last of its
answer is sent, so feedback on it can follow at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from unified.chat import chat_prompt
from unified.conversations import conversation_record
from unified.errors import InvalidRequest
from unified.serve.detokenizer import IncrementalDetokenizer
from unified.serve.errors import APIError
from unified.serve.formats import ChatFormat, CompletionFormat, usage
from unified.serve.images import check_images, decode_images, image_refs, logged_messages, preprocess_images
from unified.serve.protocol import ChatCompletionRequest, CompletionRequest
from unified.serve.responses import (ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, Model, ModelList,
                                     documented)
from unified.serve.tools import check_tools_supported, template_message

log = logging.getLogger(__name__)
router = APIRouter()
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer; no one receives it


@router.post("/v1/chat/completions", responses=documented(ChatCompletion, 400, 401, 404, 413, 503, stream=ChatCompletionChunk))
async def chat_completions(body: ChatCompletionRequest, request: Request):
    server = request.app.state.server
    loop = server.require_ready()
    server.check_model(body.model)
    _check_supported(body)
    if len(body.messages) > server.limits.max_messages:
        raise APIError(f"the request has {len(body.messages)} messages; this server accepts at most "
                       f"{server.limits.max_messages} (serve.max_messages)", param="messages")
    tokenizer = loop.engine.tokenizer
    refs = image_refs(body.messages)
    processor = loop.engine.image_processor
    check_images(refs, len(await request.body()), server.limits, processor is not None)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    try:
        if tools:
            check_tools_supported(tokenizer)
        messages = [template_message(_message_dict(m)) for m in body.messages]
    except InvalidRequest as err:
        raise APIError(str(err), param="tools" if "template" in str(err) else "messages") from None
    try:
        prompt = chat_prompt(tokenizer, messages, processor.prompt_marker if processor else None, tools)
    except InvalidRequest as err:
        raise APIError(str(err), param="messages") from None
    images = await decode_images(refs)
    fmt = ChatFormat(body, server.model_name, parses_tool_calls=bool(tools) and body.tool_choice != "none")
    on_finish = None
    if server.conversations is not None:
        on_finish = functools.partial(_log_conversation, server.conversations, fmt, logged_messages(messages, images),
                                      loop.engine.weights_version)
    return await _serve(request, body, [prompt], fmt, on_finish,
                        await preprocess_images(processor, images) if images else None)


def _message_dict(message) -> dict:
    role = "system" if message.role == "developer" else message.role
    content = message.content if isinstance(message.content, str) or message.content is None else [
        part.model_dump(exclude_none=True) for part in message.content]
    extra = message.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)
    return {"role": role, "content": content if content is not None else "", **extra}


async def _log_conversation(conversations, fmt, messages: list[dict], weights_version: int, final) -> None:
    record = conversation_record(fmt.id, fmt.created, fmt.model, weights_version, messages, final.outputs)
    try:
        await conversations.add_conversation(record)
    except OSError:  # the writer logged why; the client still gets its answer
        log.warning("chat completion %s answered but not logged", fmt.id)


@router.post("/v1/completions", responses=documented(Completion, 400, 401, 404, 413, 503, stream=CompletionChunk))
async def completions(body: CompletionRequest, request: Request):
    server = request.app.state.server
    loop = server.require_ready()
    server.check_model(body.model)
    _check_supported(body)
    texts = body.prompts()
    if len(texts) > server.limits.max_prompts:
        raise APIError(f"the request has {len(texts)} prompts; this server accepts at most "
                       f"{server.limits.max_prompts} per request (serve.max_prompts)", param="prompt")
    tokenizer, vocab = loop.engine.tokenizer, loop.engine.config.vocab_size
    prompts = []
    for i, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"] if isinstance(text, str) else text
        _check_token_ids(ids, vocab, "prompt" if len(texts) == 1 else f"prompt[{i}]")  # before echo decodes them
        prompts.append(ids)
    echoes = [t if isinstance(t, str) else tokenizer.decode(ids) for t, ids in zip(texts, prompts)] if body.echo else None
    return await _serve(request, body, prompts, CompletionFormat(body, server.model_name, echoes))


@router.get("/v1/models", responses=documented(ModelList, 401))
async def models(request: Request):
    return {"object": "list", "data": [_model_card(request.app.state.server)]}


@router.get("/v1/models/{model:path}", responses=documented(Model, 401, 404))  # served names may hold a '/'
async def model(model: str, request: Request):
    server = request.app.state.server
    server.check_model(model)
    return _model_card(server)


def _model_card(server) -> dict:
    context = server.startup.loop.engine.max_model_len if server.startup.ready else None
    return {"id": server.model_name, "object": "model", "created": 0, "owned_by": "unified", "max_model_len": context,
            "weight_version": server.weight_version}


def _check_token_ids(ids: list[int], vocab: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(f"{param} holds the token id {bad}, outside this model's vocabulary; token ids must be in "
                       f"[0, {vocab})", param=param.partition("[")[0])


def _check_supported(body) -> None:
    try:
        body.check_supported()
    except InvalidRequest as err:
        raise APIError(str(err)) from None


def _max_tokens(body, prompt: list[int], limits, context: int, param: str) -> int:
    if len(prompt) >= context:
        raise APIError(f"the prompt has {len(prompt)} tokens but this model's context is {context} tokens; "
                       f"shorten the prompt", param=param, code="context_length_exceeded")
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:
        return min(body.default_max_tokens(limits.default_max_tokens), context - len(prompt))
    if max_tokens == 0:  # echo, scoring the prompt: one token is generated and not returned
        return 1
    if max_tokens > limits.max_tokens:
        raise APIError(f"max_tokens={max_tokens} is more than this server allows ({limits.max_tokens}, "
                       f"serve.max_tokens)", param="max_tokens")
    if len(prompt) + max_tokens > context:
        raise APIError(f"this model's context is {context} tokens, but the prompt has {len(prompt)} and "
                       f"max_tokens asks for {max_tokens} more; lower max_tokens or shorten the prompt",
                       param="max_tokens", code="context_length_exceeded")
    return max_tokens


async def _serve(request: Request, body, prompts: list[list[int]], fmt, on_finish=None, images=None):
    """Runs each prompt as an engine request with `body.samples` sequences. `on_finish(final output)`, a
    coroutine function (chat only), runs before the last of the answer is sent. `images` (ImageInputs) go
    with a prompt holding the model's image placeholder once per image."""
    server = request.app.state.server
    loop, limits = server.startup.loop, server.limits
    samples = body.samples
    if samples > limits.max_n:
        name = "n" if samples == body.n else "best_of"
        raise APIError(f"{name}={samples} is more than this server allows ({limits.max_n}, serve.max_n)", param=name)
    param = "messages" if isinstance(fmt, ChatFormat) else "prompt"
    if any(not prompt for prompt in prompts):
        raise APIError("the prompt is empty; send at least one token", param=param)
    _check_token_ids(body.stop_token_ids, loop.engine.config.vocab_size, "stop_token_ids")
    context = loop.engine.max_model_len
    params = []
    try:
        for prompt in prompts:
            max_tokens = _max_tokens(body, prompt, limits, context, param)
            logprobs = body.logprobs_k()
            if logprobs is None and samples > body.n:
                logprobs = 0  # best_of ranks samples by their logprobs
            params.append(body.sampling_params(max_tokens, logprobs, samples))
    except InvalidRequest as err:
        raise APIError(str(err)) from None
    ids = [fmt.id] if len(prompts) == 1 else [f"{fmt.id}-{p}" for p in range(len(prompts))]
    arrival = time.perf_counter()
    group = _Group(loop, ids)
    try:
        for request_id, prompt, p in zip(ids, prompts, params):
            await group.submit(request_id, prompt, p, images)
    except InvalidRequest as err:
        group.abort()
        raise APIError(str(err)) from None
    server.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    tokenizer = loop.engine.tokenizer
    holdback = max((len(s) for s in params[0].stop), default=1) - 1
    timer = _Timer(server.metrics, arrival)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        choices = [_Choice(IncrementalDetokenizer(tokenizer, holdback)) for _ in range(len(prompts) * samples)]
        events = _stream(group, fmt, choices, tokenizer, timer, include_usage, on_finish)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    finals = await _collect(request, group, timer)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if on_finish is not None:
        await on_finish(finals[0])
    return JSONResponse(fmt.response(finals, tokenizer))


class _Group:
    """The engine requests of one HTTP request, their updates merged into one queue as (prompt, update)."""

    def __init__(self, loop, request_ids: list[str]):
        self.loop, self.request_ids = loop, request_ids
        self.updates: asyncio.Queue = asyncio.Queue()
        self._forwarders: list[asyncio.Task] = []
        # A failure ends the response at once, ahead of updates still queued: a stream that fell behind the
        # engine would otherwise send its backlog first, past the shutdown deadline's grace.
        self._failure: Exception | None = None

    async def submit(self, request_id: str, prompt: list[int], params, images) -> None:
        queue = await self.loop.submit(request_id, prompt, params, images)
        index = len(self._forwarders)
        self._forwarders.append(asyncio.create_task(self._forward(index, queue)))

    async def _forward(self, index: int, queue: asyncio.Queue) -> None:
        while True:
            update = await queue.get()
            if isinstance(update, Exception):
                self._failure = update
            self.updates.put_nowait((index, update))
            if isinstance(update, Exception) or update.final is not None:
                return

    async def next(self) -> tuple[int, object]:
        index, update = await self.updates.get()
        update = self._failure or update
        if isinstance(update, Exception):
            raise APIError(f"the request could not finish: {update}", status=503, type="server_error")
        return index, update

    def abort(self) -> None:
        for task in self._forwarders:
            task.cancel()
        for request_id in self.request_ids:
            self.loop.abort(request_id)


class _Timer:
    def __init__(self, metrics, arrival: float):
        self.metrics, self.arrival, self.last = metrics, arrival, None

    def tokens(self, count: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        elif count:
            self.metrics.tpot.observe((now - self.last) / count)
        self.last = now

    def done(self, finals) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        for final in finals:
            for output in final.outputs:
                self.metrics.finished.labels(output.finish_reason).inc()

    def aborted(self) -> None:
        self.metrics.finished.labels("abort").inc()


class _Choice:
    def __init__(self, detokenizer: IncrementalDetokenizer):
        self.detokenizer = detokenizer
        self.started = False


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone. The body is read already, so the next message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, group: _Group, timer: _Timer) -> list | None:
    """Waits for every final output; None when the client disconnected first (the requests are aborted)."""
    finals: list = [None] * len(group.request_ids)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        while any(final is None for final in finals):
            getter = asyncio.ensure_future(group.next())
            done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:  # nobody is waiting for the answer any more
                getter.cancel()
                group.abort()
                timer.aborted()
                return None
            index, update = getter.result()
            if update.deltas:
                timer.tokens(len(update.deltas[0].token_ids))
            if update.final is not None:
                finals[index] = update.final
        timer.done(finals)
        return finals
    except (asyncio.CancelledError, APIError):
        group.abort()
        timer.aborted()
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _stream(group: _Group, fmt, choices: list[_Choice], tokenizer, timer: _Timer, include_usage: bool,
                  on_finish):
    finals: list = [None] * len(group.request_ids)
    per_prompt = len(choices) // len(finals)
    held = fmt.holds_text()
    try:
        while any(final is None for final in finals):
            prompt, update = await group.next()
            if update.deltas:
                timer.tokens(len(update.deltas[0].token_ids))
            for delta in update.deltas:
                index = prompt * per_prompt + delta.index
                choice = choices[index]
                # A finished sequence's last tokens may end in a stop string: its text comes from the final output.
                text = "" if delta.finished or held else choice.detokenizer.push(delta.token_ids)
                wants = fmt.wants_logprobs and delta.logprobs is not None
                if not text and not wants:
                    continue
                logprobs = fmt.logprobs(delta.logprobs, tokenizer) if wants else None
                yield _sse(fmt.chunk(index, text, logprobs, None, first=not choice.started), include_usage)
                choice.started = True
            if update.final is not None:
                finals[prompt] = update.final
                if on_finish is not None:
                    await on_finish(update.final)
                for output in update.final.outputs:
                    index = prompt * per_prompt + output.index
                    choice = choices[index]
                    rest = choice.detokenizer.finish(output.text)
                    yield _sse(fmt.last_chunk(index, output, rest, first=not choice.started), include_usage)
                    choice.started = True
        timer.done(finals)
        if include_usage:
            yield _sse({**fmt.chunk_base(), "choices": [], "usage": usage(finals)}, False)
        yield "data: [DONE]\n\n"
    except APIError as err:  # the headers are sent: the error travels as an event, then the stream ends
        yield _sse({"error": err.body()["error"]}, False)
        yield "data: [DONE]\n\n"
    except Exception as err:  # noqa: BLE001 - a bug in this request's own text (its detokenisation, say)
        log.exception("stream %s failed", fmt.id)
        failure = APIError(f"internal error ({type(err).__name__}); the server log has details", status=500,
                           type="server_error")
        yield _sse({"error": failure.body()["error"]}, False)
        yield "data: [DONE]\n\n"
    finally:
        if any(final is None for final in finals):
            group.abort()
            timer.aborted()


def _sse(chunk: dict, include_usage: bool) -> str:
    if include_usage and "usage" not in chunk:
        chunk["usage"] = None
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
