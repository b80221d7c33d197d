"""Greedy choice: each row's first maximum.

The reference is torch's `max(-1).indices` (a row holding a NaN gives that NaN's index). On AVX-512 CPUs,
float32 rows go through one vectorised pass (`unified_cpu::argmax_rows`, kernels/cpu/argmax_avx512.cpp) that
tracks indices only; rows with a NaN fall back to the reference.
"""
from __future__ import annotations

import torch

from unified.kernels import registry


def argmax_rows_reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(-1).indices


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> int64 [R]."""
    if not (logits.dim() == 2 and logits.is_cpu and logits.dtype == torch.float32
            and logits.is_contiguous() and logits.shape[1] > 0 and registry.use_cpu(logits)
            and hasattr(torch.ops.unified_cpu, "argmax_rows")):  # AVX-512 builds only
        return argmax_rows_reference(logits)
    tokens = torch.ops.unified_cpu.argmax_rows(logits)
    unordered = tokens < 0
    if unordered.any():
        tokens[unordered] = argmax_rows_reference(logits[unordered])
    return tokens
