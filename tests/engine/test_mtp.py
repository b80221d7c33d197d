"""Speculative decoding with a checkpoint's multi-token prediction layer (engine.speculative.method=mtp)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import build_mtp_checkpoint
from tests.engine.conftest import assert_no_block_leaks, generate_all
from unified.checkpoint import load_model
from unified.checkpoint.mtp import load_mtp_layer
from unified.checkpoint.safetensors_io import CheckpointError
from unified.config.schema import EngineConfig, SpeculativeConfig
from unified.engine.llm_engine import LLMEngine
from unified.engine.sampling_params import SamplingParams

MTP = SpeculativeConfig(method="mtp", num_tokens=3)


@pytest.fixture(scope="module")
def mtp_model(runtime, tmp_path_factory):
    path = build_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))
    return path, load_model(path), load_mtp_layer(path)


def _engine(loaded, layer, spec=MTP, **options) -> LLMEngine:
    cfg = EngineConfig(**{"num_blocks": 40, "block_size": 4, "speculative": spec, **options})
    return LLMEngine(loaded.model, None, cfg, torch.device("cpu"), torch.float32, None,
                     draft_model=layer if spec is not None else None)


@torch.inference_mode()
def _reference_drafts(model, layer, tokens: list[int], n: int, count: int) -> list[int]:
    """The drafts for a sequence of `n` tokens (`tokens[:n]`), from the layer run over the whole sequence at
    once: position i takes token i + 1 and the model's (final-normed) hidden state at i; each draft is then
    chained on, the layer's normed output standing in for the hidden state."""
    hidden = model(torch.tensor([tokens[:n - 1]]), torch.arange(n - 1))[0]  # [n - 1, H]
    ids, previous, drafts = list(tokens[1:n]), list(hidden), []
    for _ in range(count):
        out = layer(model.embed(torch.tensor([ids])), torch.stack(previous).unsqueeze(0),
                    torch.arange(len(ids)).unsqueeze(0), model.rope)[0]
        normed = layer.head_norm(out[-1])
        drafts.append(int(model.logits(normed).argmax()))
        ids.append(drafts[-1])
        previous.append(normed)
    return drafts


def test_the_drafts_are_the_mtp_layer_over_the_whole_sequence(mtp_model):
    """Prefilled in chunks, the layer catching up step by step over the paged cache, then chained: each step's
    drafts equal those of the layer run over the whole sequence at once."""
    _, loaded, layer = mtp_model
    engine = _engine(loaded, layer, max_num_batched_tokens=8)
    seen = []
    chain = engine.speculator.drafter.before_forward

    def record(batch):
        chain(batch)
        seen.extend((item.seq.num_tokens, list(item.draft)) for item in batch if item.draft)

    engine.speculator.drafter.before_forward = record
    prompt = torch.randint(0, loaded.config.vocab_size, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    out = generate_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    tokens = prompt + out.outputs[0].token_ids
    assert len(seen) >= 3
    for n, drafts in seen:
        assert drafts == _reference_drafts(loaded.model, layer, tokens, n, len(drafts)), n
    assert_no_block_leaks(engine)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_greedy_output_is_the_non_speculative_output_with_preemption_and_n(mtp_model, kv):
    _, loaded, layer = mtp_model
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, loaded.config.vocab_size, (5 + 3 * i,), generator=g).tolist() for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * (i % 3), ignore_eos=True, n=1 + i % 2)
              for i in range(len(prompts))]
    plain = generate_all(_engine(loaded, layer, spec=None, kv_cache_dtype=kv), prompts, params)
    engine = _engine(loaded, layer, kv_cache_dtype=kv)
    got = generate_all(engine, prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in plain]
    assert engine.scheduler.num_preemptions > 0
    assert engine.speculator.stats.num_drafts > 0
    assert_no_block_leaks(engine)


def test_a_checkpoint_without_an_mtp_layer_is_refused_clearly(runtime, tiny_checkpoint):
    with pytest.raises(CheckpointError, match="no multi-token prediction layer"):
        load_mtp_layer(tiny_checkpoint("llama"))
    # transformers declares DeepSeek-V3's MTP layer in the config it saves, but drops its weights
    with pytest.raises(CheckpointError, match=r"tensors are missing \(model\.layers\.3\.enorm\.weight.*transformers"):
        load_mtp_layer(tiny_checkpoint("deepseek_v3"))
