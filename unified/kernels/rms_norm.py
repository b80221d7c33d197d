"""RMSNorm: y = weight * (x / sqrt(mean(x^2) + eps)).

The reference follows HF's order of operations exactly (normalise in fp32, cast back, then scale), so
bf16 checkpoints round the same way as `transformers`. For fp32 inputs the order makes no difference:
CPU inference takes one C++ pass per row (`unified_cpu::rms_norm`, csrc; ~3x F.rms_norm on a 64-row
decode batch), training and other devices PyTorch's fused `F.rms_norm`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from unified.kernels import cpu_ops


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if cpu_ops.applies(x, weight):
            return torch.ops.unified_cpu.rms_norm(x.contiguous(), weight.contiguous(), eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm_reference(x, weight, eps)
