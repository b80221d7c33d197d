"""Small CPU decode steps replayed from TorchScript traces (unified/engine/traced_steps.py): each replayed step
must give the eager step's logits, for every attention kind and KV dtype, and a trace must be dropped when what
it recorded changes (weights, packed copies, the kernel backend, the cache) or refused when it does not replay
the forward."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import _COMMON, build_tiny_hf_model
from tests.engine.conftest import Compare, generate_all, make_engine
from unified.checkpoint import load_model
from unified.engine.sampling_params import SamplingParams
from unified.engine.traced_steps import MAX_TRACED_SEQS, TracedDecodeSteps
from unified.kernels import registry

PROMPTS = [[5, 9, 2, 7, 1, 8, 8, 3, 4, 0, 2, 6, 1, 1, 9, 5, 3, 7], [3, 3, 8], [1, 2, 3, 4, 5, 6, 7], [9, 9]]


def _engine(loaded, **options):
    engine = make_engine(loaded, block_size=16, max_num_seqs=8, **options)
    if engine.runner.graphs is not None:
        engine.runner.graphs.record_after = 1  # short generations: record each size at once
    return engine


def _generate(engine, max_tokens=6, prompts=PROMPTS):
    params = [SamplingParams(max_tokens=max_tokens + i, ignore_eos=True, temperature=0) for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in generate_all(engine, prompts, params)]


@pytest.fixture(scope="module")
def dense_mla(runtime, tmp_path_factory):
    """A DeepSeek-V3-shaped model without MoE layers: MLA attention (latent cache, absorbed projections, YaRN)."""
    path = tmp_path_factory.mktemp("dense-mla")
    build_tiny_hf_model("deepseek_v3", first_k_dense_replace=_COMMON["num_hidden_layers"]).save_pretrained(path)
    return load_model(path)


@pytest.mark.parametrize("family,kv", [("llama", "auto"), ("mistral", "int8"), ("qwen2", "auto"), ("qwen3", "auto"),
                                       ("dense_mla", "auto"), ("llama", "int4")])
def test_replayed_steps_give_the_eager_logits(family, kv, tiny_models, request):
    loaded = request.getfixturevalue(family) if family == "dense_mla" else tiny_models(family)
    engine = _engine(loaded, kv_cache_dtype=kv)
    assert isinstance(engine.runner.graphs, TracedDecodeSteps)
    compare = Compare(engine)
    _generate(engine)
    traced = engine.runner.graphs
    assert set(compare.sizes) >= {1, 3, 4} and set(traced.traces) >= {1, 3, 4} and not traced.eager_sizes
    for got, want in compare.pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"quantization": "int8", "quantize_lm_head": True}])
def test_greedy_output_is_the_eager_engines(options, tiny_models):
    loaded = tiny_models("llama")
    try:
        want = _generate(_engine(loaded, enforce_eager=True, **options), max_tokens=12)
        engine = _engine(loaded, **options)
        got = _generate(engine, max_tokens=12)
    finally:
        loaded.model.unpack_weights()
    assert got == want and engine.runner.graphs.traces


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_moe_models_decode_eagerly(family, tiny_models):
    """Their routing sizes each expert's batch on the host, which a trace would replay unchanged."""
    assert _engine(tiny_models(family)).runner.graphs is None


def test_enforce_eager_and_large_steps_run_eagerly(tiny_models):
    loaded = tiny_models("llama")
    assert _engine(loaded, enforce_eager=True).runner.graphs is None
    engine = make_engine(loaded, block_size=16, max_num_seqs=MAX_TRACED_SEQS + 4)
    engine.runner.graphs.record_after = 1
    prompts = [[i + 1, i + 2, i + 3] for i in range(MAX_TRACED_SEQS + 2)]
    compare = Compare(engine)
    _generate(engine, max_tokens=2, prompts=prompts)
    assert max(compare.sizes) <= MAX_TRACED_SEQS
    assert set(engine.runner.graphs.traces) <= set(range(1, MAX_TRACED_SEQS + 1))


def test_a_size_is_recorded_after_it_has_run_some_steps(tiny_models):
    """A size seen only in passing (a batch draining) never pays for a trace; a steady one does."""
    loaded = tiny_models("llama")
    want = _generate(_engine(loaded, enforce_eager=True), max_tokens=20)
    engine = make_engine(loaded, block_size=16, max_num_seqs=8)
    traced = engine.runner.graphs
    traced.record_after = 8
    assert _generate(engine, max_tokens=20) == want
    # the four prompts decode 20-23 tokens: many steps of four sequences, one or two of each smaller size
    assert set(traced.traces) == {4} and traced.steps_seen[4] > 8
    assert all(0 < traced.steps_seen[size] < 8 for size in (1, 2, 3))


def test_a_weight_updated_in_place_is_read_by_the_trace(tiny_models):
    """Weights the linears do not copy (a norm's) are read where they lie: an update in place keeps the traces."""
    loaded = tiny_models("llama")
    engine = _engine(loaded)
    _generate(engine)
    traced = engine.runner.graphs
    recorded = dict(traced.traces)
    weight = loaded.model.layers["1"].post_attn_norm.weight
    original = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-2.0)
        compare = Compare(engine)
        _generate(engine)
        assert traced.traces == recorded
        for got, want in compare.pairs:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    finally:
        with torch.no_grad():
            weight.copy_(original)


def test_a_stale_packed_copy_drops_the_traces(tiny_models):
    loaded = tiny_models("llama")
    engine = _engine(loaded)
    first = _generate(engine)
    traced = engine.runner.graphs
    recorded = dict(traced.traces)
    weight = loaded.model.layers["0"].mlp.down_proj.weight
    original = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(3.0)  # in place, as a trainer's step: the packed copy the trace reads is stale
        compare = Compare(engine)
        changed = _generate(engine)
        assert traced.traces and all(traced.traces[s] is not recorded.get(s) for s in traced.traces)
        for got, want in compare.pairs:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert changed != first
    finally:
        with torch.no_grad():
            weight.copy_(original)


def test_switching_the_kernel_backend_drops_the_traces(tiny_models):
    engine = _engine(tiny_models("llama"))
    _generate(engine)
    recorded = dict(engine.runner.graphs.traces)
    registry.set_backend("reference")
    try:
        compare = Compare(engine)
        _generate(engine)
    finally:
        registry.set_backend("auto")
    assert all(engine.runner.graphs.traces[s] is not recorded.get(s) for s in engine.runner.graphs.traces)
    for got, want in compare.pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_forward_that_reads_a_value_on_the_host_stays_eager(tiny_models):
    """A trace bakes in what the Python read from a tensor; its check on another input catches it."""
    loaded = tiny_models("llama")
    norm = loaded.model.norm
    forward = norm.forward
    norm.forward = lambda x: forward(x) * float(x.flatten()[0] > 0)  # a host read the tracer cannot record
    try:
        engine = _engine(loaded)
        want = _generate(_engine(loaded, enforce_eager=True))
        got = _generate(engine)
    finally:
        del norm.forward
    traced = engine.runner.graphs
    assert got == want
    assert traced.eager_sizes and not set(traced.traces) & traced.eager_sizes


def test_a_model_with_forward_hooks_decodes_eagerly(tiny_models):
    loaded = tiny_models("llama")
    calls = []
    handle = loaded.model.layers["1"].register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        engine = _engine(loaded)
        _generate(engine, max_tokens=3)
    finally:
        handle.remove()
    traced = engine.runner.graphs
    assert not traced.traces and traced.eager_sizes
    prefills = len(PROMPTS)
    assert len(calls) > prefills  # the hook ran at every decode step too
