"""A failure that belongs to one request (its sampling, stop check or detokenisation) ends that request
alone, with an error, while the same steps go on for the others; through EngineLoop its stream gets the error."""
import asyncio
import logging
from dataclasses import replace

import pytest

from tests.engine.conftest import assert_no_block_leaks, generate_all, make_engine
from unified.engine import sampler
from unified.engine.sampling_params import SamplingParams
from unified.engine.sequence import Sequence
from unified.serve.async_engine import EngineLoop

PROMPTS = {"a": list(range(3, 19)), "bad": list(range(30, 45)), "b": list(range(50, 58))}
PARAMS = SamplingParams(temperature=1.0, top_k=40, max_tokens=6, seed=3, ignore_eos=True)


@pytest.fixture
def engine(tiny_models):
    return make_engine(tiny_models("llama"), max_num_batched_tokens=64)


def _fail_bad(fn):
    """`fn`, raising for the second sequence of request "bad" once it has two output tokens."""
    def wrapper(*args):
        seq = next(a for a in args if isinstance(a, Sequence))
        if seq.request_id == "bad" and seq.index == 1 and seq.num_output_tokens >= 2:
            raise RuntimeError("injected failure")
        return fn(*args)
    return wrapper


def _inject(where: str, engine, monkeypatch) -> None:
    if where == "sampling":
        monkeypatch.setattr(sampler, "_choose", _fail_bad(sampler._choose))
    else:
        monkeypatch.setattr(engine, where, _fail_bad(getattr(engine, where)))


def _add_all(engine) -> None:
    for request_id, prompt in PROMPTS.items():
        params = replace(PARAMS, n=2) if request_id == "bad" else PARAMS
        engine.add_request(prompt, params, request_id)


@pytest.mark.parametrize("where", ["sampling", "_check_stop", "_completion"])
def test_a_failing_sequence_fails_its_request_alone(engine, monkeypatch, caplog, where):
    alone = {rid: generate_all(engine, [PROMPTS[rid]], PARAMS)[0].outputs[0].token_ids for rid in ("a", "b")}
    _inject(where, engine, monkeypatch)
    _add_all(engine)
    outputs = {}
    with caplog.at_level(logging.WARNING):
        while engine.has_unfinished():
            outputs.update((o.request_id, o) for o in engine.step())
    failed = outputs.pop("bad")
    assert failed.finished and "injected failure" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    assert {rid: o.outputs[0].token_ids for rid, o in outputs.items()} == alone
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outputs.values())
    assert len([r for r in caplog.records if "bad" in r.getMessage()]) == 1
    assert_no_block_leaks(engine)


def test_engine_loop_delivers_the_error_to_that_request_alone(engine, monkeypatch):
    alone = {rid: generate_all(engine, [PROMPTS[rid]], PARAMS)[0].outputs[0].token_ids for rid in ("a", "b")}
    _inject("_check_stop", engine, monkeypatch)
    loop = EngineLoop(engine)
    loop.start()

    async def run(request_id: str):
        params = replace(PARAMS, n=2) if request_id == "bad" else PARAMS
        updates = await loop.submit(request_id, PROMPTS[request_id], params)
        while True:
            update = await asyncio.wait_for(updates.get(), timeout=30)
            if isinstance(update, Exception) or update.final is not None:
                return update

    async def run_all():
        return dict(zip(PROMPTS, await asyncio.gather(*(run(rid) for rid in PROMPTS))))

    try:
        results = asyncio.run(run_all())
    finally:
        loop.stop(timeout=10)
    assert isinstance(results.pop("bad"), Exception)
    assert {rid: update.final.outputs[0].token_ids for rid, update in results.items()} == alone
    assert loop.num_in_flight == 0
    assert_no_block_leaks(engine)
