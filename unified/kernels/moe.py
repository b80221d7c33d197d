"""Mixture-of-experts kernels: top-k routing, and the routed experts' gated MLP over expert-sorted tokens.

References (plain PyTorch, the model's path on CPU and in training):
  route_topk   scores (softmax, or sigmoid plus an aux-loss-free correction bias used only for choosing),
               group-limited choice (keep `topk_groups` of `num_groups` groups by their top-2 score sum), top-k,
               optional renormalisation, a routed scaling factor (Mixtral / Qwen-MoE / DeepSeek-V3 / Kimi-K2);
  experts      tokens sorted by expert (stable), one matmul pair per expert over its tokens, weighted sum back.
On accelerators the Triton kernels (kernels/triton/moe.py) route one token per program and run the experts
as grouped matmuls over expert-sorted, tile-padded rows, gathering each token's row on load and adding
each weighted result back into its token's row: no host sync, whatever the routing.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from unified.kernels import cpu_ops, registry
from unified.kernels.activation import gated_activation
from unified.kernels.sources import triton_module


def route_topk_reference(logits: torch.Tensor, top_k: int, scoring: str, bias: torch.Tensor | None, num_groups: int,
                         topk_groups: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (float32) -> (weights [T, k] float32, expert ids [T, k] int64)."""
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"unknown MoE scoring function {scoring!r}; expected 'softmax' or 'sigmoid'")
    choice = scores if bias is None else scores + bias
    if num_groups > 1:
        grouped = choice.view(-1, num_groups, choice.shape[-1] // num_groups)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route_topk(logits: torch.Tensor, top_k: int, scoring: str, bias: torch.Tensor | None, num_groups: int,
               topk_groups: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    args = (top_k, scoring, bias, num_groups, topk_groups, renormalize, scaling)
    if torch.compiler.is_compiling() and cpu_ops.inference_path():  # one opaque op in a traced graph (ops.py)
        return torch.ops.unified.route_topk(logits, *args)
    if registry.use_triton(logits) and triton_module("moe").routing_applies(logits, scoring, num_groups):
        return triton_module("moe").route_topk(logits, *args)
    return route_topk_reference(logits, *args)


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, first: int, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H], down [E, H, I] for experts first..first+E-1 (others' picks are skipped);
    weights/ids [T, k] -> sum over each token's picks of weight * down(act(gate) * up) [T, H]."""
    num_local, top_k = gate_up.shape[0], ids.shape[-1]
    local = ids.flatten() - first  # [T*k]
    picks = ((local >= 0) & (local < num_local)).nonzero().squeeze(1)
    local = local[picks]
    order = local.argsort(stable=True)
    picks = picks[order]
    token_of = picks // top_k
    counts = torch.bincount(local, minlength=num_local).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start:start + count]
        hidden = gated_activation(F.linear(x[rows], gate_up[expert]), act)
        y = F.linear(hidden, down[expert])
        y = y * weights.flatten()[picks[start:start + count], None].to(y.dtype)
        out.index_add_(0, rows, y)
        start += count
    return out


def experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            first: int, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    if act is F.silu and torch.compiler.is_compiling() and cpu_ops.inference_path():
        return torch.ops.unified.moe_experts(x, gate_up, down, weights, ids, first)
    if act is F.silu and registry.use_triton(x, gate_up, down, weights, ids) and \
            triton_module("moe").experts_applies(x, gate_up, down):
        return triton_module("moe").experts(x, gate_up, down, weights, ids, first)
    return experts_reference(x, gate_up, down, weights, ids, first, act)
