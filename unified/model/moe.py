"""Mixture-of-experts block: router, routed experts, optional shared expert.

Routing covers the three families we import:
  - softmax over all experts, top-k, optional renormalisation (Mixtral, Qwen-MoE);
  - sigmoid scores plus an aux-loss-free correction bias used only for choosing experts, group-limited
    top-k (pick `topk_groups` of `num_groups` groups by their top-2 score sum), renormalisation and a
    routed scaling factor (DeepSeek-V3, Kimi-K2).
Experts are stored stacked ([E, 2I, H] and [E, H, I]); expert parallelism gives each rank a contiguous
slice. Tokens are sorted by expert and each expert runs one matmul over its tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from unified import kernels
from unified.model.config import ModelConfig, MoEConfig
from unified.model.mlp import GatedMLP, activation
from unified.runtime.comm import collective


class Router(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, dtype: torch.dtype):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=dtype))
        if moe.score_correction_bias:
            self.register_buffer("score_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
        else:
            self.score_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k], expert ids [T, k])."""
        moe = self.moe
        logits = torch.nn.functional.linear(x.float(), self.weight.float())  # [T, E]
        if moe.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        elif moe.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            raise ValueError(f"unknown MoE scoring function {moe.scoring!r}; expected 'softmax' or 'sigmoid'")
        choice = scores if self.score_bias is None else scores + self.score_bias
        if moe.num_groups > 1:
            grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(moe.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        ids = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids


def _expert_group():
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_group()


class Experts(nn.Module):
    """This rank's contiguous slice of the experts; with expert parallelism, tokens are exchanged.

    The exchange is all-gather then all-reduce over the expert-parallel group: every rank sees every
    rank's tokens (padded to the longest), computes its own experts' share, and the shares are summed.
    megatron-core's all-to-all dispatcher moves fewer bytes but needs CUDA streams (see DESIGN.md)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, hidden_act: str, dtype: torch.dtype):
        super().__init__()
        group = _expert_group()
        self.group = group if group.size() > 1 else None
        self.num_local = moe.num_experts // group.size()
        self.first = group.rank() * self.num_local
        inter = moe.expert_intermediate_size
        self.gate_up = nn.Parameter(torch.empty(self.num_local, 2 * inter, hidden_size, dtype=dtype))
        self.down = nn.Parameter(torch.empty(self.num_local, hidden_size, inter, dtype=dtype))
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H], weights/ids: [T, k] -> [T, H]."""
        if self.group is None:
            return self._local(x, weights, ids)
        return self._exchange(x, weights, ids)

    def _local(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        top_k = ids.shape[-1]
        local = ids.flatten() - self.first  # [T*k]
        picks = ((local >= 0) & (local < self.num_local)).nonzero().squeeze(1)
        local = local[picks]
        order = local.argsort(stable=True)
        picks = picks[order]
        token_of = picks // top_k
        counts = torch.bincount(local, minlength=self.num_local).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start:start + count]
            hidden = kernels.gated_activation(torch.nn.functional.linear(x[rows], self.gate_up[expert]), self.act)
            y = torch.nn.functional.linear(hidden, self.down[expert])
            y = y * weights.flatten()[picks[start:start + count], None].to(y.dtype)
            out.index_add_(0, rows, y)
            start += count
        return out

    def _exchange(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        dist, group = torch.distributed, self.group
        tokens = torch.tensor([x.shape[0]], device=x.device)
        sizes = [torch.empty_like(tokens) for _ in range(group.size())]
        dist.all_gather(sizes, tokens, group=group)
        longest = int(max(sizes).item())
        pad = longest - x.shape[0]
        padded_x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        padded_w = torch.nn.functional.pad(weights, (0, 0, 0, pad))
        padded_ids = torch.nn.functional.pad(ids, (0, 0, 0, pad), value=-1)  # -1: no expert anywhere
        gathered = []
        for tensor in (padded_x, padded_w, padded_ids):
            parts = [torch.empty_like(tensor) for _ in range(group.size())]
            with collective("ep_all_gather", tensor):
                dist.all_gather(parts, tensor.contiguous(), group=group)
            gathered.append(torch.cat(parts))
        out = self._local(*gathered)  # [ranks * longest, H]: this rank's experts' share for every token
        with collective("ep_all_reduce", out):
            dist.all_reduce(out, group=group)
        mine = group.rank() * longest
        return out[mine:mine + x.shape[0]]


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.router = Router(config.hidden_size, moe, dtype)
        self.experts = Experts(config.hidden_size, moe, config.hidden_act, dtype)
        self.shared = (GatedMLP(config.hidden_size, moe.shared_intermediate_size, config.hidden_act, dtype)
                       if moe.shared_intermediate_size else None)
        self.shared_gate = nn.Linear(config.hidden_size, 1, bias=False, dtype=dtype) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, H]
        weights, ids = self.router(flat)
        out = self.experts(flat, weights, ids)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view(shape)
