"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2).

Keys and values are compressed into one latent of `kv_lora_rank` per token plus a single shared RoPE
key of `qk_rope_head_dim`; queries optionally go through their own low-rank bottleneck. The latent
and the shared rope key are what an inference cache stores; here they are expanded to per-head K/V.
Down-projections are replicated across tensor-parallel ranks (they are small); up-projections split
by heads.

Under an inference context the up-projection of keys is absorbed into the queries and that of values
is applied after attention, so attention runs over the cached latent directly (one shared "head" of
width kv_lora_rank + rope dim) and the cache never holds per-head K/V.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from torch import nn

from unified.model.attention import attend
from unified.model.config import ModelConfig
from unified.model.forward_context import get_forward_context
from unified.model.norm import RMSNorm
from unified.model.parallel_layers import ColumnLinear, RowLinear, megatron_config
from unified.model.rope import RotaryEmbedding
from unified.runtime import placement


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        mla = config.mla
        assert mla is not None
        mp = megatron_config(dtype)
        self.layer = layer
        self.num_heads = config.num_heads // placement.tensor_group().size()
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        self.scale = mla.softmax_scale if mla.softmax_scale is not None else qk_dim ** -0.5
        if mla.q_lora_rank is None:
            self.q_a_proj = self.q_a_norm = None
            self.q_proj = ColumnLinear(config.hidden_size, config.num_heads * qk_dim, mp)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, mla.q_lora_rank, bias=config.qkv_bias, dtype=dtype)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps, dtype)
            self.q_proj = ColumnLinear(mla.q_lora_rank, config.num_heads * qk_dim, mp)
        self.kv_a_proj = nn.Linear(config.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim,
                                   bias=config.qkv_bias, dtype=dtype)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps, dtype)
        self.kv_b_proj = ColumnLinear(mla.kv_lora_rank, config.num_heads * (self.nope_dim + self.v_dim), mp)
        self.o_proj = RowLinear(config.num_heads * self.v_dim, config.hidden_size, mp, bias=config.o_bias)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q_in = x if self.q_a_proj is None else self.q_a_norm(self.q_a_proj(x))
        q = self.q_proj(q_in).view(b, s, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)

        latent, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent)
        q_rope = rope(q_rope, cos, sin)
        k_rope = rope(k_rope.view(b, s, 1, self.rope_dim), cos, sin)  # one rope key shared by all heads
        if self.kv_b_proj.tp_group.size() > 1 and torch.is_grad_enabled():
            # Each rank's heads give only part of the shared key's gradient: sum it over the ranks in backward.
            k_rope = copy_to_tensor_model_parallel_region(k_rope, group=self.kv_b_proj.tp_group)
        ctx = get_forward_context()
        if hasattr(ctx, "attend_latent"):
            return self.o_proj(self._attend_latent(ctx, q_nope, q_rope, latent, k_rope).reshape(b, s, -1))

        kv = self.kv_b_proj(latent).view(b, s, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(b, s, self.num_heads, self.rope_dim)), dim=-1)
        out = attend(self.layer, q, k, v, self.scale, None)  # [B, S, H, Dv]
        return self.o_proj(out.reshape(b, s, -1))

    def _attend_latent(self, ctx, q_nope, q_rope, latent, k_rope) -> torch.Tensor:
        w = self.kv_b_proj.effective_weight().view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, :self.nope_dim], w[:, self.nope_dim:]  # [H, nope, R], [H, v, R]
        q_latent = torch.einsum("bshn,hnr->bshr", q_nope, w_uk)
        q = torch.cat((q_latent, q_rope), dim=-1)  # [B, S, H, R+P]
        kv = torch.cat((latent.unsqueeze(2), k_rope), dim=-1)  # [B, S, 1, R+P]
        out_latent = ctx.attend_latent(self.layer, q, kv, self.kv_lora_rank, self.scale)  # [B, S, H, R]
        return torch.einsum("bshr,hvr->bshv", out_latent, w_uv)
