"""Mixture-of-experts block: router, routed experts, optional shared expert.

Routing (kernels.route_topk) covers the three families we import: softmax top-k (Mixtral, Qwen-MoE) and
sigmoid scores with a correction bias and group-limited top-k (DeepSeek-V3, Kimi-K2). Experts are stored
stacked ([E, 2I, H] and [E, H, I]); expert parallelism gives each rank a contiguous slice; kernels.moe_experts
sorts tokens by expert and runs each expert's matmuls over its tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from unified import kernels
from unified.model.config import ModelConfig, MoEConfig
from unified.model.mlp import GatedMLP, activation
from unified.runtime import placement
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
        return kernels.route_topk(logits, moe.top_k, moe.scoring, self.score_bias, moe.num_groups, moe.topk_groups,
                                  moe.norm_topk_prob, moe.routed_scaling_factor)


class Experts(nn.Module):
    """This rank's contiguous slice of the experts; with expert parallelism, tokens are exchanged.

    The exchange is all-gather then all-reduce over the expert-parallel group: every rank sees every
    rank's tokens (padded to the longest), computes its own experts' share, and the shares are summed.
    megatron-core's all-to-all dispatcher moves fewer bytes but needs CUDA streams (see DESIGN.md)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, hidden_act: str, dtype: torch.dtype):
        super().__init__()
        group = placement.expert_group()
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
        return kernels.moe_experts(x, self.gate_up, self.down, weights, ids, self.first, self.act)

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
