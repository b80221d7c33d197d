"""The server's engine thread (unified/serve/async_engine.py) in process, without HTTP."""
from __future__ import annotations

import asyncio
import time

import torch

from unified.checkpoint import load_model
from unified.config.schema import EngineConfig
from unified.engine.llm_engine import LLMEngine
from unified.engine.sampling_params import SamplingParams
from unified.serve.async_engine import ASLEEP, EngineLoop


def test_a_request_queued_as_the_engine_goes_to_sleep_ends_with_the_sleep_error(runtime, tiny_checkpoint):
    """A multi-prompt request still queueing its prompts when POST /sleep frees the KV cache: the prompts queued
    after it end with the sleep's own error, and the engine never steps without its cache."""
    engine = LLMEngine(load_model(tiny_checkpoint("llama")).model, None, EngineConfig(num_blocks=32, block_size=4),
                       torch.device("cpu"), torch.float32, accelerator=None)
    loop = EngineLoop(engine)
    loop.start()

    async def scenario():
        await loop.between_steps(lambda: engine.link.sleep(1))
        updates = await loop.submit("late", [1, 2, 3], SamplingParams(max_tokens=4))
        return await asyncio.wait_for(updates.get(), 30)

    try:
        error = asyncio.run(scenario())
    finally:
        loop.stop(timeout=10)
    assert isinstance(error, RuntimeError) and str(error) == ASLEEP
    assert not engine.requests


def test_the_server_records_no_decode_traces(runtime, tiny_checkpoint):
    """A recording stalls every stream for as long as many steps: the server's small decode steps run eagerly."""
    engine = LLMEngine(load_model(tiny_checkpoint("llama")).model, None, EngineConfig(num_blocks=32, block_size=4),
                       torch.device("cpu"), torch.float32, accelerator=None)
    loop = EngineLoop(engine)
    loop.start()

    async def scenario():
        updates = await loop.submit("long", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
        while (await asyncio.wait_for(updates.get(), 30)).final is None:
            pass

    try:
        asyncio.run(scenario())
    finally:
        loop.stop(timeout=10)
    traced = engine.runner.graphs
    assert traced.record_after is None and not traced.traces and traced.steps_seen[1] == 0


def test_an_idle_driver_keeps_its_followers_waiting_within_their_timeout(runtime, tiny_checkpoint, monkeypatch):
    """Followers block in a broadcast until the driver's next step; with no request for the process group's timeout
    (30 minutes by default) they would fail and take the server down, so an idle driver messages them."""
    monkeypatch.setattr("unified.serve.async_engine.KEEP_ALIVE_S", 0.0)
    engine = LLMEngine(load_model(tiny_checkpoint("llama")).model, None, EngineConfig(num_blocks=32, block_size=4),
                       torch.device("cpu"), torch.float32, accelerator=None)
    sent = []
    monkeypatch.setattr(engine.runner, "keep_alive", lambda: sent.append(True))
    loop = EngineLoop(engine)
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while len(sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        loop.stop(timeout=10)
    assert len(sent) >= 2
