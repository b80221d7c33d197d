"""The kernels as `torch.ops.unified` custom ops: registered on import and consistent with their fakes
(torch.library.opcheck). tests/engine/test_kernel_backends.py traces a decode forward through them."""
from __future__ import annotations

import pytest
import torch

from unified import kernels  # noqa: F401 (registers the ops)

OPS = ["rms_norm", "add_rms_norm", "silu_and_mul", "norm_rope_", "write_kv_", "paged_attention", "paged_decode",
       "argmax_rows", "argmax_merge_", "topk_merge_", "route_topk", "moe_experts"]


def _cache(g, blocks=6, block=16, heads=2, dim=32):
    k = torch.randn(blocks, block, heads, dim, generator=g)
    v = torch.randn(blocks, block, heads, dim, generator=g)
    return k, v, torch.tensor([[3, 1], [0, 5]])


def _lens(*lengths):
    return torch.tensor(lengths, dtype=torch.int32)


def _samples():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g), torch.randn(32, generator=g)
    k, v, tables = _cache(g)
    qk = torch.randn(1, 3, 6, 32, generator=g)
    angles = torch.rand(1, 3, 16, generator=g)
    int8_cache, int8_scales = torch.zeros(6, 16, 2, 32, dtype=torch.int8), torch.zeros(6, 16, 2)
    slots = torch.tensor([5, 17, 40])
    return {
        "rms_norm": [(x, w, 1e-6)],
        "add_rms_norm": [(x, torch.randn(5, 32, generator=g), w, 1e-6)],
        "silu_and_mul": [(torch.randn(4, 64, generator=g),)],
        "norm_rope_": [(qk, angles.cos(), angles.sin(), w, w, 4, 1e-6),
                       (qk, angles.cos(), angles.sin(), None, None, 4, 0.0)],
        "write_kv_": [(k.clone(), None, torch.randn(3, 2, 32, generator=g), slots, None, None),
                      (int8_cache, int8_scales, torch.randn(3, 2, 32, generator=g), slots, 8, None)],
        "paged_attention": [
            (torch.randn(2, 4, 32, generator=g), k, v, tables, [0, 1, 2], [20, 9], 0.2, None, None, None, None, None),
            (torch.randn(9, 4, 32, generator=g), k, v, tables, [0, 1, 9], [20, 9], 0.2, 4, None, None, None, None),
            (torch.randn(2, 4, 32, generator=g), k, None, tables, [0, 1, 2], [20, 9], 0.2, None, None, None, None, 16)],
        "paged_decode": [
            (torch.randn(2, 4, 32, generator=g), k, v, tables, _lens(20, 9), 0.2, None, None, None, None, None),
            (torch.randn(2, 4, 32, generator=g), k, v, tables, _lens(20, 1), 0.2, 4, None, None, None, None),
            (torch.randn(2, 4, 32, generator=g), k, None, tables, _lens(3, 9), 0.2, None, None, None, None, 16)],
        "argmax_rows": [(torch.randn(3, 50, generator=g),)],
        "argmax_merge_": [(torch.randn(3, 50, generator=g), 100, torch.randn(3, generator=g),
                           torch.zeros(3, dtype=torch.long))],
        "topk_merge_": [(torch.randn(3, 50, generator=g), 100, torch.randn(3, 4, generator=g).sort(-1, descending=True)[0],
                         torch.zeros(3, 4, dtype=torch.long))],
        "route_topk": [(torch.randn(5, 8, generator=g), 2, "softmax", None, 1, 1, True, 1.0),
                       (torch.randn(5, 16, generator=g), 4, "sigmoid", torch.rand(16, generator=g), 4, 2, True, 2.5)],
        "moe_experts": [(x, torch.randn(4, 48, 32, generator=g) * 0.1, torch.randn(4, 32, 24, generator=g) * 0.1,
                         torch.rand(5, 2, generator=g), torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [5, 1]]), 0)],
    }


def test_every_op_is_registered():
    assert all(hasattr(torch.ops.unified, name) for name in OPS)


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    for args in _samples()[name]:
        with torch.no_grad():
            torch.library.opcheck(getattr(torch.ops.unified, name).default, args)

