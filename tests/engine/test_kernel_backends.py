"""The engine on each kernel backend (kernels.backend): the references, the default (C++ on this CPU) and
Triton (in its interpreter here) give the same teacher-forced logits; a decode forward traced whole by
torch.compile through the `torch.ops.unified` ops gives the eager ones."""
from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_engine, run_teacher_forced
from unified.kernels import registry

pytest.importorskip("triton")
FAMILIES = ["llama", "mistral", "qwen3_moe", "deepseek_v3"]  # GQA + llama3 RoPE, sliding window, qk-norm MoE, MLA


@pytest.fixture
def backend():
    yield registry.set_backend
    registry.set_backend("auto")


def _logits(loaded, kv_cache_dtype="auto"):
    prompts, continuations = [[5, 9, 2, 7, 1, 8, 8, 3, 4, 0, 2, 6, 1, 1, 9, 5, 3, 7], [3, 3, 8]], [[4, 6, 1], [2, 7, 7]]
    # Blocks of 16: the Triton attention kernel's smallest; the first prompt spans two.
    engine = make_engine(loaded, block_size=16, kv_cache_dtype=kv_cache_dtype)
    return run_teacher_forced(engine, prompts, continuations)


@pytest.mark.parametrize("family", FAMILIES)
def test_backends_give_the_same_logits(family, tiny_models, backend):
    loaded = tiny_models(family)
    default = _logits(loaded)
    backend("reference")
    reference = _logits(loaded)
    backend("triton")
    triton = _logits(loaded)
    for ref, got_default, got_triton in zip(reference, default, triton):
        torch.testing.assert_close(got_default, ref, rtol=0, atol=1e-4)
        torch.testing.assert_close(got_triton, ref, rtol=0, atol=1e-4)


def test_int8_kv_cache_on_the_triton_backend(tiny_models, backend):
    loaded = tiny_models("llama")
    backend("reference")
    reference = _logits(loaded, "int8")
    backend("triton")
    for ref, got in zip(reference, _logits(loaded, "int8")):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_forward_compiles_whole_and_gives_the_eager_logits(family, tiny_models):
    loaded = tiny_models(family)
    eager = _logits(loaded)
    forward = loaded.model.forward
    loaded.model.forward = torch.compile(forward, fullgraph=True, backend="aot_eager", dynamic=False)
    try:
        compiled = _logits(loaded)
    finally:
        loaded.model.forward = forward
        torch._dynamo.reset()
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
