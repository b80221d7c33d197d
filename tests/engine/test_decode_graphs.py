"""Decode steps over static buffers (unified/engine/decode_graphs.py), the path a captured CUDA/MUSA graph
replays. Without an accelerator to capture on, the forward runs again on the buffers at each step: its logits
must equal the eager step's, for every attention kind and KV dtype and on each kernel backend, and traced
whole by torch.compile it must compile once per padded size whatever the step's contents (a forward that read
a host-side value of the step would be specialised on it, and a captured graph would replay a stale one)."""
from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import Compare, generate_all, make_engine
from unified.engine.decode_graphs import DecodeGraphs, batch_sizes
from unified.engine.sampling_params import SamplingParams
from unified.kernels import registry
from unified.model.forward_context import forward_context

PROMPTS = [[5, 9, 2, 7, 1, 8, 8, 3, 4, 0, 2, 6, 1, 1, 9, 5, 3, 7], [3, 3, 8], [1, 2, 3, 4, 5, 6, 7], [9, 9]]


@pytest.fixture
def backend():
    yield registry.set_backend
    registry.set_backend("auto")


def _engine_with_graphs(loaded, **options):
    engine = make_engine(loaded, block_size=16, max_num_seqs=8, **options)
    engine.runner.graphs = DecodeGraphs(engine.model, engine.runner.cache, engine.cfg.max_num_seqs,
                                        engine.max_model_len, engine.device, None)
    return engine


def _run(engine, max_tokens=6):
    compare = Compare(engine) if engine.runner.graphs is not None else None
    params = [SamplingParams(max_tokens=max_tokens + i, ignore_eos=True, temperature=0) for i in range(len(PROMPTS))]
    outputs = generate_all(engine, PROMPTS, params)
    return compare, outputs


@pytest.mark.parametrize("family,kv", [("llama", "auto"), ("mistral", "int8"), ("qwen3_moe", "int4"),
                                       ("deepseek_v3", "auto"), ("llama", "int4")])
def test_static_decode_gives_the_eager_logits(family, kv, tiny_models):
    engine = _engine_with_graphs(tiny_models(family), kv_cache_dtype=kv)
    compare, _ = _run(engine)
    assert compare.pairs and set(compare.sizes) >= {1, 4}  # padded: 3 of 4, and one alone at the end
    for got, want in compare.pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_greedy_output_is_the_eager_engines(tiny_models):
    loaded = tiny_models("qwen3_moe")
    _, want = _run(make_engine(loaded, block_size=16, max_num_seqs=8))
    _, got = _run(_engine_with_graphs(loaded))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("name", ["reference", "triton"])
def test_static_decode_on_other_backends(name, tiny_models, backend):
    if name == "triton":
        pytest.importorskip("triton")
    backend(name)
    compare, _ = _run(_engine_with_graphs(tiny_models("llama")), max_tokens=3)
    for got, want in compare.pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_traced_forward_compiles_once_per_padded_size(tiny_models):
    loaded = tiny_models("llama")
    model, engine = loaded.model, _engine_with_graphs(loaded)
    graphs, compiled = engine.runner.graphs, []

    def count(graph, example_inputs):
        compiled.append(graph)
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    torch._dynamo.reset()
    step = torch.compile(lambda ids, positions: model.logits(model(ids, positions)[0]).float(), fullgraph=True,
                         backend=count, dynamic=False)

    def forward(size):  # what a capture records, traced instead
        with forward_context(graphs.context(size)):
            return step(graphs.ids[:, :size], graphs.positions[:, :size])

    graphs._forward = forward
    try:
        compare, _ = _run(engine)
    finally:
        torch._dynamo.reset()
    padded = {next(s for s in graphs.sizes if s >= n) for n in compare.sizes}
    assert len(compare.pairs) > 2 * len(padded)
    assert len(compiled) == len(padded)
    for got, want in compare.pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_padded_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
