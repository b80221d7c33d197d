"""Swapping weights between engine steps: in-flight requests go on, the prefix cache never serves old K/V."""
from __future__ import annotations

import torch

from tests.conftest import build_tiny_hf_model
from tests.engine.conftest import generate_all, make_engine
from unified.checkpoint import load_model
from unified.engine.sampling_params import SamplingParams
from unified.engine.weight_update import stage_weights

PROMPT = list(range(3, 67))  # 64 tokens: a prefill with as many rows as the packed weights are tuned for
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_swapped_weights_answer_as_a_fresh_engine_and_stale_kv_is_never_reused(runtime, tiny_checkpoint, tmp_path):
    old_path, new_path = tiny_checkpoint("llama"), tmp_path / "llama-seed-1"
    build_tiny_hf_model("llama", seed=1).save_pretrained(new_path)
    fresh = generate_all(make_engine(load_model(new_path)), [PROMPT], GREEDY)[0].outputs[0].token_ids

    engine = make_engine(load_model(old_path))
    old = generate_all(engine, [PROMPT], GREEDY)[0].outputs[0].token_ids
    assert old != fresh, "the two checkpoints answer alike; the test could not tell them apart"
    in_flight = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.sequences(in_flight)[0].num_cached_prompt_tokens == 60  # the old weights' prefix was reused

    assert engine.update_weights(str(new_path), stage_weights(new_path, engine.model, torch.float32)) == 1
    assert engine.weights_version == 1 and not engine.blocks.cached
    while engine.has_unfinished():  # the request admitted under the old weights finishes ...
        finished = engine.step()
    assert finished[0].request_id == in_flight and len(finished[0].outputs[0].token_ids) == 24
    assert not engine.blocks.cached  # ... without publishing blocks whose K/V mix both weights

    first, again = (generate_all(engine, [PROMPT], GREEDY)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == fresh
    assert again.num_cached_tokens == 60 and again.outputs[0].token_ids == fresh  # new blocks are cached again
