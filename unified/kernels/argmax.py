"""Greedy choice: each row's first maximum.

The reference is torch's `max(-1).indices` (a row holding a NaN gives that NaN's index). On AVX-512 CPUs,
float32 rows go through one vectorised pass (`unified_cpu::argmax_rows`, kernels/cpu/argmax_avx512.cpp) that
tracks indices only; rows with a NaN fall back to the reference. `argmax_merge_` takes the same choice one
vocabulary chunk at a time (a tied LM head's chunks, `linear.head_argmax`), keeping each row's best value;
`topk_merge_` keeps each row's k best (a quantized head's candidates for rescoring, `linear.rescore_top`).
"""
from __future__ import annotations

import torch

from unified.kernels import registry


def argmax_rows_reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(-1).indices


def _in_cpu_kernel(logits: torch.Tensor, op: str) -> bool:
    return (logits.dim() == 2 and logits.is_cpu and logits.dtype == torch.float32 and logits.is_contiguous()
            and logits.shape[1] > 0 and registry.use_cpu(logits) and hasattr(torch.ops.unified_cpu, op))  # AVX-512


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> int64 [R]."""
    if not _in_cpu_kernel(logits, "argmax_rows"):
        return argmax_rows_reference(logits)
    tokens = torch.ops.unified_cpu.argmax_rows(logits)
    unordered = tokens < 0
    if unordered.any():
        tokens[unordered] = argmax_rows_reference(logits[unordered])
    return tokens


def argmax_merge_reference(logits: torch.Tensor, offset: int, best: torch.Tensor, index: torch.Tensor) -> None:
    value, position = logits.max(-1)
    better = (value > best) | (value.isnan() & ~best.isnan())  # ties keep the earlier chunk's; a NaN wins
    best.copy_(torch.where(better, value, best))
    index.copy_(torch.where(better, position + offset, index))


def argmax_merge_(logits: torch.Tensor, offset: int, best: torch.Tensor, index: torch.Tensor) -> None:
    """One vocabulary chunk of a greedy choice, in place: logits [R, C] of tokens offset .. offset + C - 1;
    best [R] (logits' dtype) and index int64 [R] hold the maxima of the chunks before it (-inf and 0 before
    the first) and their tokens. Taken in vocabulary order, the chunks leave each row's first maximum in index,
    as `argmax_rows` over the whole row gives it."""
    if _in_cpu_kernel(logits, "argmax_merge_") and best.dtype == torch.float32 and best.is_contiguous():
        torch.ops.unified_cpu.argmax_merge_(logits, offset, best, index)
    else:
        argmax_merge_reference(logits, offset, best, index)


def topk_merge_reference(logits: torch.Tensor, offset: int, values: torch.Tensor, tokens: torch.Tensor) -> None:
    chunk_tokens = torch.arange(offset, offset + logits.shape[-1], device=logits.device).expand_as(logits)
    logits = torch.where(logits.isnan(), float("-inf"), logits)  # never kept, as in the C++ kernel
    merged_values, merged_tokens = torch.cat((values, logits), -1), torch.cat((tokens, chunk_tokens), -1)
    order = merged_values.sort(dim=-1, descending=True, stable=True).indices[:, :values.shape[1]]  # equal: earlier first
    values.copy_(merged_values.gather(-1, order))
    tokens.copy_(merged_tokens.gather(-1, order))


def topk_merge_(logits: torch.Tensor, offset: int, values: torch.Tensor, tokens: torch.Tensor) -> None:
    """One vocabulary chunk of each row's k largest logits, in place: logits [R, C] of tokens offset .. offset + C - 1;
    values [R, k] (logits' dtype, largest first; -inf before the first chunk) and tokens int64 [R, k] hold the k
    largest of the chunks before it. Among equal logits the earlier tokens stay, so that chunks taken in vocabulary
    order leave what a stable descending sort of the whole row would put first, given k finite logits in it (NaNs
    and -inf never enter: slots they would fill keep their -inf and token)."""
    if _in_cpu_kernel(logits, "topk_merge_") and values.dtype == torch.float32 and values.is_contiguous():
        torch.ops.unified_cpu.topk_merge_(logits, offset, values, tokens)
    else:
        topk_merge_reference(logits, offset, values, tokens)


def topk_tokens(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits [R, V] -> the tokens of each row's k largest, int64 [R, k] (k <= V), in no particular order."""
    if not _in_cpu_kernel(logits, "topk_merge_"):
        return logits.topk(k, dim=-1, sorted=False).indices
    values = logits.new_full((logits.shape[0], k), float("-inf"))
    tokens = torch.zeros(values.shape, dtype=torch.long)
    torch.ops.unified_cpu.topk_merge_(logits, 0, values, tokens)
    return tokens
