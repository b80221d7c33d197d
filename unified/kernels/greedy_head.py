"""Greedy choice over a large vocabulary, screened by a bfloat16 copy of the LM head, with float32's answer.

At decode, the LM head of a small model over a large vocabulary is the largest matmul of a step (a 152k x 768
head is ~60% of a 0.6B model's decode FLOPs), and greedy decoding only needs each row's argmax. On CPUs with
native bfloat16 dot products (AVX512_BF16, AMX) a bfloat16 matmul runs at about twice float32's rate and reads
half the bytes. The screen computes every logit that way, with an error bound, and keeps only the entries that
can still be the maximum; those few (tens per row) are computed again in float32, and the first maximum among
them is the token. The answer is float32's argmax: which entry wins is decided by float32 logits, summed in
another order than a float32 matmul would (ties within float32 rounding may break differently).

The bound: with bfloat16's unit roundoff u = 2^-8, rounding the weights and the hidden state, accumulating in
float32 (as oneDNN's bfloat16 kernels do) and rounding the output to bfloat16 move a logit w.h by at most about
3u sum|w_j||h_j| <= 3u |w| |h| (Cauchy-Schwarz); BOUND = 2^-6 = 4u covers that with room. Per chunk of the
vocabulary the largest row norm |w| is used, so one number per row and chunk bounds every entry's error.

Anything the screen cannot decide (non-finite hidden states, more candidates than MAX_CANDIDATES per row) goes
back to the caller (None), which takes the float32 path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from unified.kernels.linear import head_chunk_size, takes_inference_path

BOUND = 2.0 ** -6
MAX_CANDIDATES = 1024  # per row; beyond this the float32 head is cheaper than the rescoring


def available() -> bool:
    """Whether this CPU multiplies bfloat16 natively (and oneDNN is there to do it)."""
    return (torch.backends.mkldnn.is_available()
            and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))


@dataclass(frozen=True)
class HeadScreen:
    """A float32 LM head weight [V, H] in bfloat16, in oneDNN's layout, by vocabulary chunk, each with the
    largest float32 row norm in it."""

    chunks: tuple[tuple[int, int, torch.Tensor, float], ...]  # (first, end, packed bfloat16 rows, max |w|)
    shape: tuple[int, ...]
    version: int

    @property
    def nbytes(self) -> int:
        return sum(packed.numel() * packed.element_size() for _, _, packed, _ in self.chunks)

    def serves(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `linear` would take the inference path for x (float32 rows on the CPU, kernels.backend not
        `reference`) and `weight` is still what was screened (same shape, no change in
        place; a ZeRO-3 partition, whose storage is swapped out, is not)."""
        if x.dim() != 2 or torch.compiler.is_compiling() or not takes_inference_path(x, weight):
            return False
        try:
            version = weight._version
        except RuntimeError:  # an inference tensor keeps no version counter
            return False
        return tuple(weight.shape) == self.shape and version == self.version


def bytes_for(vocab: int, hidden: int) -> int:
    """What `pack_screen` holds for a [vocab, hidden] head."""
    return vocab * hidden * 2


def pack_screen(weight: torch.Tensor, chunk: int | None = None) -> HeadScreen | None:
    """The screen of a float32 CPU head `weight` [V, H] in chunks of `chunk` entries (default: the packed head's,
    `head_chunk_size()`); None where it cannot be made (another dtype or device, no native bfloat16, an
    inference tensor)."""
    chunk = chunk or head_chunk_size()
    if not (available() and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2):
        return None
    if weight.is_inference():
        return None
    parts = []
    with torch.no_grad():
        for start in range(0, weight.shape[0], chunk):
            rows = weight[start:start + chunk]
            packed = torch.ops.mkldnn._reorder_linear_weight(rows.to(torch.bfloat16), 64)
            parts.append((start, start + rows.shape[0], packed, float(rows.norm(dim=-1).max())))
    return HeadScreen(tuple(parts), tuple(weight.shape), weight._version)


def screened_argmax(x: torch.Tensor, weight: torch.Tensor, screen: HeadScreen) -> torch.Tensor | None:
    """x [R, H] -> each row's first maximum of x @ weight.T (int64 [R]), or None where the screen cannot tell
    (the caller checked `screen.serves`)."""
    rows = x.shape[0]
    norms = x.norm(dim=-1)
    if rows == 0 or not bool(torch.isfinite(norms).all()):
        return None
    low = torch.bfloat16
    xb = x.to(low)
    best_lower = torch.full((rows,), -float("inf"))  # the largest lower bound of any logit so far, per row
    found, kept = [], 0
    for start, _, packed, max_norm in screen.chunks:
        approx = torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], "").float()
        error = norms * (BOUND * max_norm)
        best_lower = torch.maximum(best_lower, approx.amax(-1) - error)
        row, column = (approx >= (best_lower - error)[:, None]).nonzero(as_tuple=True)
        kept += row.numel()
        if kept > MAX_CANDIDATES * rows:
            return None
        found.append((row, column + start, approx[row, column] + error[row]))
    row, index, upper = (torch.cat(parts) for parts in zip(*found))
    keep = upper >= best_lower[row]  # the bound only rose after an entry was kept
    row, index = row[keep], index[keep]
    exact = (weight[index] * x[row]).sum(-1)
    best = torch.full((rows,), -float("inf")).scatter_reduce(0, row, exact, "amax")
    winner = exact == best[row]
    tokens = torch.full((rows,), weight.shape[0], dtype=torch.long).scatter_reduce(0, row[winner], index[winner],
                                                                                   "amin")
    return None if bool((tokens == weight.shape[0]).any()) else tokens
