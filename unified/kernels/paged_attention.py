"""Attention over a paged KV cache, for a ragged batch of sequences.

Layout: caches are [num_blocks, block_size, kv_heads, D]; `block_tables[s]` lists sequence s's
blocks; sequence s contributes queries q[query_start[s]:query_start[s+1]], which are the last tokens
of its `context_lens[s]` tokens (their K/V already written to the cache). Attention is causal and
optionally limited to a sliding window. With `v_cache=None` the values are the first `v_head_dim`
channels of the keys (MLA's absorbed latent cache).

This plain-PyTorch version is the reference and the path on every device. It reads only the blocks
of the sequences in the batch, never the whole cache: all one-token (decode) queries go through a
single gather of their blocks, padded to the longest context, and one masked SDPA; each multi-token
(prefill) chunk gathers its own blocks and runs one SDPA. On CPU, float32 attention over unquantised
caches instead goes through C++ kernels that read the rows in place through the block tables, with no
gathered copy: decodes through kernels/cpu/cpu_kernels.cpp's paged_decode, and on AVX-512 builds all of a
step's prefill chunks through one call of kernels/cpu/attention_avx512.cpp (a flash-style kernel that reads each
K/V row once for a tile of query positions times the query heads sharing it, skipping the tiles above
the causal diagonal); decodes that share prefix blocks attend to them together (cascade.py). Decodes read
whole blocks and mask the slots past each sequence's end, so those slots must hold finite values (a masked
NaN still gives 0 * NaN): caches start zeroed. Quantised caches (int8/int4, see kv_quant.py) are
dequantised right after the gather; int4 keys come back shifted by their cache's constant centre, which
leaves the softmax unchanged. On accelerators one Triton kernel (kernels/triton/paged_attention.py) runs the
whole step, decodes and prefill chunks, reading blocks in place and dequantising quantised ones inside.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from unified.kernels import cpu_ops, registry
from unified.kernels.cascade import CascadePlan, cascade_decode, plan_cascade
from unified.kernels.kv_quant import dequantize_kv, int4_group, quantize_kv, rotation
from unified.kernels.sources import triton_module
from unified.kernels.staging import to_device


def _select(cache: torch.Tensor, scale: torch.Tensor | None, index: torch.Tensor, bits: int | None,
            dtype: torch.dtype) -> torch.Tensor:
    """Rows `index` of a cache (blocks or flat slots), dequantised if the cache is quantised."""
    x = cache.index_select(0, index)
    return x if bits is None else dequantize_kv(x, scale.index_select(0, index), bits, dtype)


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, length: int, bits: int | None,
            dtype: torch.dtype) -> torch.Tensor:
    return _select(cache, scale, blocks, bits, dtype).flatten(0, 1)[:length]  # [ctx, H, D]


def _mask(q_len: int, ctx_len: int, sliding_window: int | None, device) -> torch.Tensor | None:
    if q_len == 1 and (sliding_window is None or sliding_window >= ctx_len):
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _prefill_mask(q_len: int, ctx_len: int, sliding_window: int | None, device) -> torch.Tensor | None:
    """A chunk's mask where a window limits it; None where plain causal attention is meant (see _prefill)."""
    if sliding_window is None or sliding_window >= ctx_len:
        return None
    return _mask(q_len, ctx_len, sliding_window, device)


@dataclass(frozen=True)
class AttentionPlan:
    """What every layer of one step shares (per sliding window): which query rows are one-token decodes, the
    blocks those sequences read, which of the gathered positions each may see, and each prefill chunk's
    mask. Built once per step, so the layers only gather and attend."""

    decode_rows: torch.Tensor | None  # rows of q that decode; None when every row does
    decode_seqs: list[int]
    tables: torch.Tensor  # [D, W]: the W first blocks of each decoding sequence
    decode_lens: torch.Tensor  # [D] int64: each decoding sequence's context length
    visible: torch.Tensor  # [D, 1, 1, L]: which of the first L (longest context) positions each decode sees
    sliding_window: int | None
    # (sequence, first query row, end row, window mask or None: causal) of each multi-token chunk
    prefills: list[tuple[int, int, int, torch.Tensor | None]]
    # the same chunks as int64 tensors for the CPU kernel: sequences, first rows, lengths, context lengths
    prefill_chunks: tuple[torch.Tensor, ...] = ()
    cascade: CascadePlan | None = None  # decodes that share prefix blocks, where attending them together pays
    # The whole step's query starts and context lengths, for the Triton kernel (built on its first layer)
    query_start: tuple[int, ...] = ()
    context_lens: tuple[int, ...] = ()
    device_tensors: dict = field(default_factory=dict, compare=False)


def plan_paged_attention(block_tables: torch.Tensor, query_start: list[int], context_lens: list[int],
                         block_size: int, sliding_window: int | None = None) -> AttentionPlan:
    device = block_tables.device
    spans = [(s, query_start[s], query_start[s + 1]) for s in range(len(context_lens))]
    decodes = [s for s, start, end in spans if end - start == 1]
    prefills = [(s, start, end, _prefill_mask(end - start, context_lens[s], sliding_window, device))
                for s, start, end in spans if end - start > 1]
    chunks = tuple(to_device(column, torch.int64, device) for column in
                   zip(*[(s, start, end - start, context_lens[s]) for s, start, end, _ in prefills])) if prefills else ()
    steps = (tuple(query_start), tuple(context_lens))
    if not decodes:
        empty = block_tables.new_empty(0)
        return AttentionPlan(None, [], empty, empty, torch.empty(0, dtype=torch.bool), sliding_window, prefills,
                             chunks, None, *steps)
    lens = [context_lens[s] for s in decodes]
    width = -(-max(lens) // block_size)
    tables = block_tables if len(decodes) == len(spans) else block_tables[to_device(decodes, torch.int64, device)]
    k_pos = torch.arange(max(lens), device=device)[None, :]
    lens_t = to_device(lens, torch.int64, device)[:, None]
    visible = k_pos < lens_t  # [D, L]
    if sliding_window is not None:
        visible &= k_pos >= lens_t - sliding_window
    rows = None if not prefills else to_device([query_start[s] for s in decodes], torch.int64, device)
    tables = tables[:, :width].contiguous()
    cascade = (plan_cascade(tables, lens, block_size) if sliding_window is None and device.type == "cpu"
               and registry.cpu_allowed() and cpu_ops.available()
               and hasattr(torch.ops.unified_cpu, "paged_decode_cascade") else None)
    return AttentionPlan(rows, decodes, tables, lens_t[:, 0], visible[:, None, None, :], sliding_window, prefills,
                         chunks, cascade, *steps)


def _cpu_decode_kernel_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                               kv_bits: int | None) -> bool:
    return (q.is_cpu and kv_bits is None and q.dtype == k_cache.dtype == torch.float32
            and (v_cache is None or v_cache.dtype == torch.float32) and registry.cpu_allowed()
            and cpu_ops.available())


def _cpu_prefill_kernel_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                                kv_bits: int | None, dv: int) -> bool:
    return (_cpu_decode_kernel_applies(q, k_cache, v_cache, kv_bits) and dv % 16 == 0
            and q.shape[1] // k_cache.shape[2] <= 64
            and hasattr(torch.ops.unified_cpu, "paged_prefill_"))  # AVX-512 builds only


def _decode_batch(q: torch.Tensor, k_cache, v_cache, k_scale, v_scale, plan: AttentionPlan, scale: float,
                  kv_bits: int | None, dv: int) -> torch.Tensor:
    """One query per sequence, reading whole blocks (one gather each for K and V; positions past a
    sequence's length are masked, those past the longest not attended at all). q: [S, Hq, Dk] -> [S, Hq, Dv]."""
    if plan.cascade is not None and _cpu_prefill_kernel_applies(q, k_cache, v_cache, kv_bits, dv):
        return cascade_decode(q.contiguous(), k_cache, v_cache, plan.tables, plan.decode_lens, plan.cascade, scale, dv)
    if _cpu_decode_kernel_applies(q, k_cache, v_cache, kv_bits):
        return torch.ops.unified_cpu.paged_decode(cpu_ops.contiguous(q), k_cache, v_cache, plan.tables,
                                                  plan.decode_lens, scale, plan.sliding_window or 0, dv)
    seqs, q_heads, _ = q.shape
    length = plan.visible.shape[-1]

    def gather(cache, scale_cache):
        x = _select(cache, scale_cache, plan.tables.flatten(), kv_bits, q.dtype)  # [S * W, block_size, Hkv, D]
        return x.view(seqs, -1, *x.shape[2:])[:, :length].transpose(1, 2)  # [S, Hkv, L, D]

    k = gather(k_cache, k_scale)
    v = k[..., :dv] if v_cache is None else gather(v_cache, v_scale)
    # The query heads that share a KV head become that head's "query positions": each K/V head is then
    # read once for its whole group (40% faster on CPU than SDPA's enable_gqa, which re-reads it).
    grouped = q.view(seqs, k.shape[1], q_heads // k.shape[1], q.shape[-1])  # [S, Hkv, G, Dk]
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=plan.visible, scale=scale)
    return out.reshape(seqs, q_heads, dv)


def value_dim(q: torch.Tensor, v_cache: torch.Tensor | None, kv_bits: int | None, v_head_dim: int | None) -> int:
    return v_head_dim or (v_cache.shape[-1] * (2 if kv_bits == 4 else 1) if v_cache is not None else q.shape[-1])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, block_tables: torch.Tensor,
                    query_start: list[int], context_lens: list[int], scale: float, *,
                    sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, kv_bits: int | None = None,
                    v_head_dim: int | None = None, plan: AttentionPlan | None = None) -> torch.Tensor:
    """q: [T, Hq, Dk] -> [T, Hq, Dv]. `plan`: from plan_paged_attention with the same tables and window
    (callers running many layers build it once); None builds it here."""
    block_size = k_cache.shape[1]
    dv = value_dim(q, v_cache, kv_bits, v_head_dim)
    if torch.compiler.is_compiling():  # one opaque op in a traced graph (ops.py)
        return torch.ops.unified.paged_attention(q, k_cache, v_cache, block_tables, list(query_start),
                                                 list(context_lens), scale, sliding_window, k_scale, v_scale, kv_bits,
                                                 v_head_dim)
    if q.shape[0] == 0:
        return q.new_empty(0, q.shape[1], dv)
    if plan is None:
        plan = plan_paged_attention(block_tables, query_start, context_lens, block_size, sliding_window)
    if registry.use_triton(q, k_cache) and triton_module("paged_attention").applies(q, k_cache, dv, kv_bits):
        return _triton_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, plan, scale, kv_bits, dv)
    if not plan.prefills:  # a pure decode step
        return _decode_batch(q, k_cache, v_cache, k_scale, v_scale, plan, scale, kv_bits, dv)
    out = q.new_empty(q.shape[0], q.shape[1], dv)
    if plan.decode_seqs:  # decodes mixed with prefill chunks
        out[plan.decode_rows] = _decode_batch(q[plan.decode_rows], k_cache, v_cache, k_scale, v_scale, plan, scale,
                                              kv_bits, dv)
    if _cpu_prefill_kernel_applies(q, k_cache, v_cache, kv_bits, dv):
        torch.ops.unified_cpu.paged_prefill_(out, q.contiguous(), k_cache, v_cache, block_tables.contiguous(),
                                             *plan.prefill_chunks, scale, plan.sliding_window or 0)
        return out
    for s, start, end, mask in plan.prefills:
        ctx_len = context_lens[s]
        blocks = block_tables[s, : -(-ctx_len // block_size)]
        k = _gather(k_cache, k_scale, blocks, ctx_len, kv_bits, q.dtype)  # [ctx, Hkv, Dk]
        v = k[..., :dv] if v_cache is None else _gather(v_cache, v_scale, blocks, ctx_len, kv_bits, q.dtype)
        qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, Dk]
        attn = _prefill(qs, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), mask, scale)
        out[start:end] = attn[0].transpose(0, 1)
    return out


def _triton_attention(q: torch.Tensor, k_cache, v_cache, k_scale, v_scale, block_tables: torch.Tensor,
                      plan: AttentionPlan, scale: float, kv_bits: int | None, dv: int) -> torch.Tensor:
    """The Triton kernel over every row of the step."""
    module = triton_module("paged_attention")
    meta = plan.device_tensors
    if "tiles" not in meta:  # once per step, not per layer
        meta["tiles"] = module.tiles(list(plan.query_start), q.shape[1], k_cache.shape[2], q.device)
        meta["query_start"] = to_device(plan.query_start, torch.int32, q.device)
        meta["context_lens"] = to_device(plan.context_lens, torch.int32, q.device)
    return _triton_call(q, k_cache, v_cache, k_scale, v_scale, block_tables, meta["query_start"], meta["context_lens"],
                        meta["tiles"], scale, plan.sliding_window, kv_bits, dv)


def _triton_call(q, k_cache, v_cache, k_scale, v_scale, block_tables, query_start, context_lens, tiles, scale,
                 sliding_window, kv_bits, dv) -> torch.Tensor:
    """Quantised rows are stored rotated: q goes into that basis and the output comes back from it."""
    turn = rotation(q.shape[-1], q.device) if kv_bits else None
    if turn is not None:
        q = q @ turn.to(q.dtype)
    out = triton_module("paged_attention").paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables,
                                                           query_start, context_lens, tiles, scale, sliding_window,
                                                           kv_bits, dv)
    return out if turn is None else out @ rotation(dv, q.device).to(out.dtype).T


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, *, sliding_window: int | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, kv_bits: int | None = None,
                 v_head_dim: int | None = None) -> torch.Tensor:
    """One query per sequence with its metadata on the device alone: q [S, Hq, Dk], block_tables [S, W],
    context_lens [S] int32 or int64 -> [S, Hq, Dv]. Shapes depend on S and W only and nothing is read back to the
    host, so a captured decode graph replays it with new tables and lengths. Every row must see at least one
    position (padding rows point at a scratch slot)."""
    dv = value_dim(q, v_cache, kv_bits, v_head_dim)
    if torch.compiler.is_compiling():
        return torch.ops.unified.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                                              k_scale, v_scale, kv_bits, v_head_dim)
    if q.shape[0] == 0:
        return q.new_empty(0, q.shape[1], dv)
    if registry.use_triton(q, k_cache) and triton_module("paged_attention").applies(q, k_cache, dv, kv_bits):
        seqs = q.shape[0]
        query_start = torch.arange(seqs + 1, dtype=torch.int32, device=q.device)
        tiles = triton_module("paged_attention").decode_tiles(seqs, q.shape[1], k_cache.shape[2], q.device)
        return _triton_call(q, k_cache, v_cache, k_scale, v_scale, block_tables, query_start,
                            _as(context_lens, torch.int32), tiles, scale, sliding_window, kv_bits, dv)
    lens = _as(context_lens, torch.int64)
    k_pos = torch.arange(block_tables.shape[1] * k_cache.shape[1], device=q.device)[None, :]
    visible = k_pos < lens[:, None]
    if sliding_window is not None:
        visible &= k_pos >= lens[:, None] - sliding_window
    plan = AttentionPlan(None, list(range(q.shape[0])), block_tables, lens, visible[:, None, None, :], sliding_window,
                         [], ())
    return _decode_batch(q, k_cache, v_cache, k_scale, v_scale, plan, scale, kv_bits, dv)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, converted only where it is not (a traced step records no op for a tensor already so)."""
    return t if t.dtype == dtype else t.to(dtype)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             scale: float) -> torch.Tensor:
    """One chunk's attention: q [1, Hq, L, Dk] over k, v [1, Hkv, C, D] (C >= L: the chunk's tokens last),
    causal, or under `mask` (a sliding window). Causal attention never materialises a mask: a chunk with no
    cached tokens before it is SDPA's own causal case, which skips the blocks above the diagonal (half the
    work of a masked call); on CPU a chunk over a cached prefix is two flash calls, the prefix unmasked and the
    chunk causal, merged by their log-sum-exps."""
    q_len, ctx_len = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if q_len == ctx_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16) or q.shape[-1] != v.shape[-1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(q_len, ctx_len, None, q.device), scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    split = ctx_len - q_len
    before, before_lse = flash(q, k[:, :, :split], v[:, :, :split], 0.0, False, scale=scale)
    own, own_lse = flash(q, k[:, :, split:], v[:, :, split:], 0.0, True, scale=scale)
    lse = torch.logaddexp(before_lse, own_lse).unsqueeze(-1)  # [1, Hq, L, 1]
    return before * (before_lse.unsqueeze(-1) - lse).exp() + own * (own_lse.unsqueeze(-1) - lse).exp()


def write_kv(cache: torch.Tensor, scale_cache: torch.Tensor | None, x: torch.Tensor, slots: torch.Tensor,
             kv_bits: int | None, centre: torch.Tensor | None = None) -> None:
    """Stores x [T, H, D] (or [1, T, H, D]) at flat slot indices (block * block_size + offset), quantising if
    asked. int4 keys pass their cache's `centre` [H, D], subtracted before quantising, and are stored with
    zero-points."""
    compiling = torch.compiler.is_compiling()
    if (kv_bits is None and not compiling and (x.dim() == 3 or (x.dim() == 4 and x.shape[0] == 1))
            and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] and cache.is_contiguous()
            and registry.use_cpu(cache, x) and slots.dtype == torch.int64):
        torch.ops.unified_cpu.write_kv_rows_(cache, x, slots)  # no set-up per call, x read where it lies
        return
    if x.dim() == 4:
        x = x[0]
    if compiling:
        torch.ops.unified.write_kv_(cache, scale_cache, x, slots, kv_bits, centre)
        return
    if registry.use_triton(cache, x) and slots.device == x.device and triton_module("kv_cache").applies(x, kv_bits):
        kernels = triton_module("kv_cache")
        if kv_bits is None:
            kernels.write_rows(cache, x, slots)
        else:
            kernels.quantize_rows(cache, scale_cache, x, slots, kv_bits, int4_group(x.shape[-1]), centre)
        return
    if kv_bits is None:
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))
        return
    values, scale = quantize_kv(x, kv_bits, centre, zero_point=centre is not None)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, values)
    scale_cache.view(-1, *scale_cache.shape[2:]).index_copy_(0, slots, scale)
