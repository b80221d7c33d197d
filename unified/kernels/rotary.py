"""qk-norm and RoPE over the q and k heads of a fused projection, in place, in one pass (CPU inference).

The model's own path (apply_rotary below, after RMSNorm per head) is the reference: about ten ops
and four temporary copies of q and k per layer, where `unified_cpu::norm_rope_` (kernels/cpu) rewrites the heads
where they lie; on accelerators the Triton kernel (kernels/triton/rope.py) does the same in any dtype. It
applies on the inference path to the halves rotation over the whole head (not interleaved, not partial);
elsewhere callers take the reference.
"""
from __future__ import annotations

import torch

from unified.kernels import cpu_ops, registry
from unified.kernels.sources import triton_module


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x: [..., heads, D]; cos, sin: [..., D/2] (or fewer: partial rotary, the rest passes through)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotated = x.shape[-1] if cos.shape[-1] * 2 == x.shape[-1] else cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rotated], x[..., rotated:]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    else:
        x1, x2 = x_rot.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out


def norm_rope_applies(qk: torch.Tensor, cos: torch.Tensor, interleaved: bool, *norm_weights: torch.Tensor) -> bool:
    """qk [1, T, H, D] (heads contiguous, tokens any stride), cos [1, T, D/2]."""
    if torch.compiler.is_compiling():  # traced graphs take the reference, plain torch ops
        return False
    if (interleaved or qk.dim() != 4 or qk.shape[0] != 1 or cos.shape[-1] * 2 != qk.shape[-1] or qk.stride(-1) != 1
            or qk.stride(-2) != qk.shape[-1]):
        return False
    if registry.use_triton(qk, cos, *norm_weights):
        return triton_module("rope").applies(qk[0], cos.reshape(-1, cos.shape[-1]))
    return registry.use_cpu(qk, cos, *norm_weights)


def norm_rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
               k_weight: torch.Tensor | None, q_heads: int, eps: float) -> None:
    """Normalises (when given weights: q_weight for the first q_heads heads, k_weight for the others) and
    rotates qk's heads in place; only where norm_rope_applies."""
    half = qk.shape[-1] // 2
    if registry.use_triton(qk):
        triton_module("rope").norm_rope_(qk[0], cos.reshape(-1, half), sin.reshape(-1, half), q_weight, k_weight,
                                         q_heads, eps)
        return
    # qk and cos, sin as they are: a select and two reshapes per layer fewer in a traced decode step
    torch.ops.unified_cpu.norm_rope_(qk, cpu_ops.contiguous(cos), cpu_ops.contiguous(sin), q_weight, k_weight, q_heads,
                                     eps)
