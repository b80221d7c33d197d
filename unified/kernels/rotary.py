"""qk-norm and RoPE over the q and k heads of a fused projection, in place, in one pass (CPU inference).

The model's own path (model/rope.py's apply_rotary after RMSNorm per head) is the reference: about ten ops
and four temporary copies of q and k per layer, where `unified_cpu::norm_rope_` (csrc) rewrites the heads
where they lie. It applies to float32 CPU tensors on the inference path, the halves rotation over the whole
head (not interleaved, not partial); elsewhere callers take the reference.
"""
from __future__ import annotations

import torch

from unified.kernels import cpu_ops


def norm_rope_applies(qk: torch.Tensor, cos: torch.Tensor, interleaved: bool, *norm_weights: torch.Tensor) -> bool:
    """qk [1, T, H, D] (heads contiguous, tokens any stride), cos [1, T, D/2]."""
    return (not interleaved and qk.dim() == 4 and qk.shape[0] == 1 and cos.shape[-1] * 2 == qk.shape[-1]
            and qk.stride(-1) == 1 and qk.stride(-2) == qk.shape[-1] and cpu_ops.applies(qk, cos, *norm_weights))


def norm_rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
               k_weight: torch.Tensor | None, q_heads: int, eps: float) -> None:
    """Normalises (when given weights: q_weight for the first q_heads heads, k_weight for the others) and
    rotates qk's heads in place; only where norm_rope_applies."""
    half = qk.shape[-1] // 2
    torch.ops.unified_cpu.norm_rope_(qk[0], cos.reshape(-1, half).contiguous(), sin.reshape(-1, half).contiguous(),
                                     q_weight, k_weight, q_heads, eps)
