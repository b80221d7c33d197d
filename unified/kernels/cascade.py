"""Cascade decoding: decodes that share cached prefix blocks attend to the shared part together.

Sequences behind one system prompt, or the n samples of one prompt, hold the same physical blocks at the
start of their block tables (prefix caching). Decoding them one by one reads those blocks once per sequence
and layer. Here each group of such sequences attends to its shared prefix in one pass, all its query rows at
once (the prefill kernel with every row seeing every key), each sequence attends to the rest of its own
context apart, and the two halves merge by their log-sum-exps. vLLM does the same on GPUs ("cascade
attention") for a prefix common to the whole batch; groups make it work in mixed traffic too.

CPU (AVX-512 builds) float32 only; the plan is None wherever no group is worth it, and decoding goes the
usual way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# A group is attended apart only where it saves reading enough keys and values to pay for a second kernel
# call and the merge: at least MIN_SHARED_BLOCKS shared blocks, and as many token reads saved per layer as
# MIN_SAVED_TOKENS (the shared length times the members beyond the first).
MIN_SHARED_BLOCKS = 4
MIN_SAVED_TOKENS = 1024


@dataclass(frozen=True)
class CascadePlan:
    order: torch.Tensor  # [G] the decode indices of the grouped sequences, each group's members together
    chunks: tuple[torch.Tensor, ...]  # per group: a member's decode index, first row in `order`, members, shared len
    skips: torch.Tensor  # [D] positions each decode leaves to its group's shared pass (0: none)


def plan_cascade(tables: torch.Tensor, lens: list[int], block_size: int) -> CascadePlan | None:
    """tables [D, W]: the decoding sequences' block tables; lens: their context lengths."""
    if len(lens) < 2:
        return None
    groups: dict[int, list[int]] = {}
    for i, block in enumerate(tables[:, 0].tolist()):
        groups.setdefault(block, []).append(i)
    order, chunks, skips = [], [], [0] * len(lens)
    for members in groups.values():
        if len(members) < 2:
            continue
        most = (min(lens[i] for i in members) - 1) // block_size  # full blocks before every member's last token
        if most < MIN_SHARED_BLOCKS:
            continue
        rows = tables[members, :most]
        shared_blocks = int((rows == rows[0]).all(0).int().cumprod(0).sum())
        shared = shared_blocks * block_size
        if shared_blocks < MIN_SHARED_BLOCKS or shared * (len(members) - 1) < MIN_SAVED_TOKENS:
            continue
        chunks.append((members[0], len(order), len(members), shared))
        order.extend(members)
        for i in members:
            skips[i] = shared
    if not chunks:
        return None
    device = tables.device
    return CascadePlan(torch.tensor(order, device=device),
                       tuple(torch.tensor(column, dtype=torch.int64, device=device) for column in zip(*chunks)),
                       torch.tensor(skips, dtype=torch.int64, device=device))


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, tables: torch.Tensor,
                   lens: torch.Tensor, plan: CascadePlan, scale: float, dv: int) -> torch.Tensor:
    """q [D, Hq, dk] (one query per decoding sequence) -> [D, Hq, dv]."""
    return torch.ops.unified_cpu.paged_decode_cascade(q, k_cache, v_cache, tables, lens, plan.order, *plan.chunks,
                                                      plan.skips, scale, dv)
