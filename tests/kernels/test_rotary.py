"""kernels.norm_rope_ (qk-norm and RoPE in place) against the model's own path: RMSNorm per head, then
apply_rotary."""
import os

import pytest
import torch

from unified import kernels
from unified.kernels import cpu_ops
from unified.kernels.rotary import apply_rotary


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dim", [64, 128, 40])
def test_matches_norm_then_rotation(qk_norm, dim):
    if os.environ.get("UNIFIED_CPU_KERNELS") == "0" or not cpu_ops.available():
        pytest.skip("no C++ kernels")
    g = torch.Generator().manual_seed(0)
    q_heads, kv_heads, tokens = 6, 2, 9
    qkv = torch.randn(1, tokens, q_heads + 2 * kv_heads, dim, generator=g)  # [q | k | v] of a fused projection
    qk = qkv[:, :, :q_heads + kv_heads]
    angles = torch.rand(1, tokens, dim // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    weights = (torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5) if qk_norm else ()
    expected = qk.clone()
    if qk_norm:
        expected = torch.cat((kernels.rms_norm_reference(expected[:, :, :q_heads], weights[0], 1e-6),
                              kernels.rms_norm_reference(expected[:, :, q_heads:], weights[1], 1e-6)), dim=2)
    expected = apply_rotary(expected, cos, sin, interleaved=False)
    values = qkv[:, :, q_heads + kv_heads:].clone()
    with torch.inference_mode():
        assert kernels.norm_rope_applies(qk, cos, False, *weights)
        kernels.norm_rope_(qk, cos, sin, *(weights or (None, None)), q_heads, 1e-6)
    torch.testing.assert_close(qk, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(qkv[:, :, q_heads + kv_heads:], values)  # the value heads are left alone


def test_the_reference_path_takes_what_the_kernel_does_not():
    if os.environ.get("UNIFIED_CPU_KERNELS") == "0" or not cpu_ops.available():
        pytest.skip("no C++ kernels")
    qk = torch.randn(1, 3, 4, 8)
    cos = torch.randn(1, 3, 4)
    assert not kernels.norm_rope_applies(qk, cos, False)  # autograd on: training's path
    with torch.inference_mode():
        assert kernels.norm_rope_applies(qk, cos, False)
        assert not kernels.norm_rope_applies(qk, cos, True)  # interleaved
        assert not kernels.norm_rope_applies(qk, cos[..., :2], False)  # partial rotary
        assert not kernels.norm_rope_applies(qk.double(), cos.double(), False)
        assert not kernels.norm_rope_applies(qk.transpose(2, 3), cos, False)  # heads not contiguous
