"""RMSNorm: y = weight * (x / sqrt(mean(x^2) + eps)).

The reference follows HF's order of operations exactly (normalise in fp32, cast back, then scale), so
bf16 checkpoints round the same way as `transformers`. For fp32 inputs the order makes no difference:
CPU inference takes one C++ pass per row (`unified_cpu::rms_norm`, kernels/cpu; ~3x F.rms_norm on a 64-row
decode batch), accelerators the Triton kernel (kernels/triton/norm.py, any dtype), training PyTorch's fused
`F.rms_norm`. `add_rms_norm` fuses the residual add before the norm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from unified.kernels import cpu_ops, registry
from unified.kernels.sources import triton_module


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.compiler.is_compiling() and cpu_ops.inference_path():  # one opaque op in a traced graph (ops.py)
        return torch.ops.unified.rms_norm(x, weight, eps)
    if registry.use_triton(x, weight):
        return triton_module("norm").rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and registry.backend() != "reference":
        if registry.use_cpu(x, weight):
            return torch.ops.unified_cpu.rms_norm(cpu_ops.contiguous(x), cpu_ops.contiguous(weight), eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm block's residual add and the next norm."""
    if torch.compiler.is_compiling() and cpu_ops.inference_path():
        return torch.ops.unified.add_rms_norm(x, residual, weight, eps)
    if registry.use_triton(x, residual, weight) and residual.is_contiguous() and residual.shape == x.shape:
        summed = residual.clone()
        return triton_module("norm").rms_norm(x, weight, eps, residual=summed), summed
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
