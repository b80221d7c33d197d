"""Grouped-query attention (Llama, Qwen2/3, Mistral, Mixtral, Qwen-MoE) and the shared attend step.

q, k, v come from one fused column-parallel projection laid out [q | k | v] per tensor-parallel
rank, so each rank holds whole heads. Qwen3's qk-norm normalises each head before RoPE.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from unified import kernels
from unified.model.config import ModelConfig
from unified.model.forward_context import get_forward_context
from unified.model.norm import RMSNorm
from unified.model.parallel_layers import ColumnLinear, RowLinear, megatron_config
from unified.model.rope import RotaryEmbedding
from unified.runtime import placement


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sliding_window: int | None) -> torch.Tensor:
    """q: [B, S, Hq, D], k/v: [B, S, Hkv, D*] -> [B, S, Hq, Dv]; causal, optionally windowed."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    seq = q.shape[-2]
    if sliding_window is not None and sliding_window < seq:
        pos = torch.arange(seq, device=q.device)
        distance = pos[:, None] - pos[None, :]
        mask = (distance >= 0) & (distance < sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


class SegmentAttention:
    """A forward context for rows that pack several sequences sharing a prefix (segment 0): a token
    attends, causally, to the prefix and to its own segment. RLHF packs a prompt once with all its
    completions this way, so the prompt's tokens are computed once per group instead of once per
    completion. Positions restart after the prefix for each segment (RoPE and sliding windows read
    them); segment -1 marks padding, which only sees the prefix and other padding."""

    def __init__(self, segments: torch.Tensor, positions: torch.Tensor):
        """segments, positions: [B, S]."""
        order = torch.arange(segments.shape[1], device=segments.device)
        causal = order[None, :] <= order[:, None]
        keys, queries = segments[:, None, :], segments[:, :, None]
        self.allowed = causal & ((keys == 0) | (keys == queries))  # [B, S(query), S(key)]
        self.positions = positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        allowed = self.allowed
        if sliding_window is not None:
            distance = self.positions[:, :, None] - self.positions[:, None, :]
            allowed = allowed & (distance < sliding_window)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2)


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           sliding_window: int | None) -> torch.Tensor:
    ctx = get_forward_context()
    if ctx is None:
        return causal_attention(q, k, v, scale, sliding_window)
    return ctx.attend(layer, q, k, v, scale, sliding_window)


class GQAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        tp = placement.tensor_group().size()
        mp = megatron_config(dtype)
        self.layer = layer
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads // tp
        self.num_kv_heads = max(config.num_kv_heads // tp, 1)
        self.scale = config.head_dim ** -0.5
        self.sliding_window = config.sliding_window_of(layer)
        qkv_out = (config.num_heads + 2 * max(config.num_kv_heads, tp)) * config.head_dim
        self.qkv_proj = ColumnLinear(config.hidden_size, qkv_out, mp, bias=config.qkv_bias)
        self.o_proj = RowLinear(config.num_heads * config.head_dim, config.hidden_size, mp, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            for weight in (self.q_norm.weight, self.k_norm.weight):
                weight.partial_grad_over_tp = True  # shared by the heads, which the ranks split
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [B, S, ...]: the whole sequence, also when x holds a sequence-parallel slice
        b, s, _ = qkv.shape
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = qkv.view(b, s, heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=2)
        norms = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        if kernels.norm_rope_applies(qk, cos, rope.interleaved, *norms):  # CPU inference: in place, one pass
            eps = self.q_norm.eps if norms else 0.0
            kernels.norm_rope_(qk, cos, sin, *(norms or (None, None)), self.num_heads, eps)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=2)
        else:
            if self.q_norm is not None:
                q, k = qk.split([self.num_heads, self.num_kv_heads], dim=2)
                qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=2)
            q, k = rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=2)  # one rotation for q and k
        out = attend(self.layer, q, k, v, self.scale, self.sliding_window)  # [B, S, Hq, D]
        return self.o_proj(out.reshape(b, s, -1))
