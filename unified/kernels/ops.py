"""Every kernel as a `torch.library` custom op under `torch.ops.unified`, with a fake (meta) implementation.

Eager code calls the functions in `unified.kernels`, which choose an implementation per call (registry.py)
with no dispatcher overhead, as a CPU decode step of ~100 small ops cannot afford. Traced code (torch.compile,
CUDA graphs captured through it) sees these ops instead: opaque to the tracer, shaped by their fakes, and
running the same functions when the graph runs. Importing `unified.kernels` registers them all, with or
without Triton or the C++ build.
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from unified.kernels.activation import gated_activation
from unified.kernels.argmax import argmax_merge_, argmax_rows, topk_merge_
from unified.kernels.moe import experts, route_topk
from unified.kernels.paged_attention import value_dim, paged_attention, paged_decode, write_kv
from unified.kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_reference
from unified.kernels.rotary import apply_rotary, norm_rope_, norm_rope_applies


@custom_op("unified::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@custom_op("unified::add_rms_norm", mutates_args=())
def add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm(x, residual, weight, eps)


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@custom_op("unified::silu_and_mul", mutates_args=())
def silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return gated_activation(x, torch.nn.functional.silu).contiguous()


@silu_and_mul_op.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@custom_op("unified::norm_rope_", mutates_args=("qk",))
def norm_rope_op(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, q_heads: int, eps: float) -> None:
    """qk [1, T, H, D] in place; the model's per-head RMSNorm and rotation where no kernel takes it."""
    norms = () if q_weight is None else (q_weight, k_weight)
    if norm_rope_applies(qk, cos, False, *norms):
        norm_rope_(qk, cos, sin, q_weight, k_weight, q_heads, eps)
        return
    x = qk
    if q_weight is not None:
        q, k = x.split([q_heads, x.shape[2] - q_heads], dim=2)
        x = torch.cat((rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)), dim=2)
    qk.copy_(apply_rotary(x, cos, sin, interleaved=False))


@norm_rope_op.register_fake
def _(qk, cos, sin, q_weight, k_weight, q_heads, eps):
    return None


@custom_op("unified::write_kv_", mutates_args=("cache", "scale_cache"))
def write_kv_op(cache: torch.Tensor, scale_cache: torch.Tensor | None, x: torch.Tensor, slots: torch.Tensor,
                kv_bits: int | None, centre: torch.Tensor | None) -> None:
    write_kv(cache, scale_cache, x, slots, kv_bits, centre)


@write_kv_op.register_fake
def _(cache, scale_cache, x, slots, kv_bits, centre):
    return None


@custom_op("unified::paged_attention", mutates_args=())
def paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                       block_tables: torch.Tensor, query_start: list[int], context_lens: list[int], scale: float,
                       sliding_window: int | None, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                       kv_bits: int | None, v_head_dim: int | None) -> torch.Tensor:
    return paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, scale,
                           sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, kv_bits=kv_bits,
                           v_head_dim=v_head_dim)


@paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, query_start, context_lens, scale, sliding_window, k_scale, v_scale,
      kv_bits, v_head_dim):
    return q.new_empty(q.shape[0], q.shape[1], value_dim(q, v_cache, kv_bits, v_head_dim))


@custom_op("unified::paged_decode", mutates_args=())
def paged_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, sliding_window: int | None, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None, kv_bits: int | None, v_head_dim: int | None) -> torch.Tensor:
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=sliding_window,
                        k_scale=k_scale, v_scale=v_scale, kv_bits=kv_bits, v_head_dim=v_head_dim)


@paged_decode_op.register_fake
def _(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, k_scale, v_scale, kv_bits, v_head_dim):
    return q.new_empty(q.shape[0], q.shape[1], value_dim(q, v_cache, kv_bits, v_head_dim))


@custom_op("unified::argmax_rows", mutates_args=())
def argmax_rows_op(logits: torch.Tensor) -> torch.Tensor:
    return argmax_rows(logits)


@argmax_rows_op.register_fake
def _(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@custom_op("unified::argmax_merge_", mutates_args=("best", "index"))
def argmax_merge_op(logits: torch.Tensor, offset: int, best: torch.Tensor, index: torch.Tensor) -> None:
    argmax_merge_(logits, offset, best, index)


@argmax_merge_op.register_fake
def _(logits, offset, best, index):
    return None


@custom_op("unified::topk_merge_", mutates_args=("values", "tokens"))
def topk_merge_op(logits: torch.Tensor, offset: int, values: torch.Tensor, tokens: torch.Tensor) -> None:
    topk_merge_(logits, offset, values, tokens)


@topk_merge_op.register_fake
def _(logits, offset, values, tokens):
    return None


@custom_op("unified::route_topk", mutates_args=())
def route_topk_op(logits: torch.Tensor, top_k: int, scoring: str, bias: torch.Tensor | None, num_groups: int,
                  topk_groups: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    return route_topk(logits, top_k, scoring, bias, num_groups, topk_groups, renormalize, scaling)


@route_topk_op.register_fake
def _(logits, top_k, scoring, bias, num_groups, topk_groups, renormalize, scaling):
    rows = logits.shape[0]
    return logits.new_empty(rows, top_k, dtype=torch.float32), logits.new_empty(rows, top_k, dtype=torch.int64)


@custom_op("unified::moe_experts", mutates_args=())
def moe_experts_op(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, first: int) -> torch.Tensor:
    """The routed experts with SiLU, the activation of every MoE family we import."""
    return experts(x, gate_up, down, weights, ids, first, torch.nn.functional.silu)


@moe_experts_op.register_fake
def _(x, gate_up, down, weights, ids, first):
    return torch.empty_like(x)
