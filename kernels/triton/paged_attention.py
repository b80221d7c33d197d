"""Attention over the paged KV cache, decode and (chunked) prefill in one kernel (Triton; reference:
unified/kernels/paged_attention.py, whose layout and semantics this follows).

One program per (query tile, KV head). A tile holds POS consecutive query positions of one sequence's chunk
times the G query heads sharing the KV head (rows padded to G_PAD), so a decode is one tile per sequence
and each K/V block is read once for the whole group. Blocks are read in place through the block table,
newest last, with an online softmax; blocks past the causal limit or before a sliding window are skipped.
Key channels: DK (a power of two) plus an optional DK_TAIL (MLA: 512 latent + 64 rope = 576); values are
DV channels of their own cache, or the keys' first DV (V_FROM_K: MLA's latent cache).
Quantised caches are dequantised in the kernel: int8 codes times a per-row scale, int4 nibble pairs with
per-group float16 scales (keys with zero-points). Quantised rows are stored Hadamard-rotated: the caller
rotates q into that basis and the output back (`rotation`), which leaves the scores unchanged.
"""
import torch
import triton
import triton.language as tl

from unified.kernels.kv_quant import int4_group
from unified.kernels.staging import to_device

NEG = -1.0e30  # the running maximum's start: finite, so rows with nothing visible yet give exp(.) = 0, not NaN


@triton.jit
def _int4_rows(ptr, scale_ptr, slot, head, heads, valid, HALF: tl.constexpr, GROUP: tl.constexpr,
               ZERO_POINT: tl.constexpr, F: tl.constexpr):
    """The even and the odd channels [BLOCK, HALF] of int4 rows at `slot` for `head`, dequantised."""
    h = tl.arange(0, HALF)
    row = slot * heads + head
    packed = tl.load(ptr + (row * HALF)[:, None] + h[None, :], mask=valid[:, None], other=0)
    low = (packed & 15).to(F)
    high = (packed >> 4).to(F)
    groups: tl.constexpr = 2 * HALF // GROUP
    per_row: tl.constexpr = groups * (2 if ZERO_POINT else 1)
    g = (2 * h) // GROUP
    s = tl.load(scale_ptr + (row * per_row)[:, None] + g[None, :], mask=valid[:, None], other=0.0).to(F)
    if ZERO_POINT:
        z = tl.load(scale_ptr + (row * per_row + groups)[:, None] + g[None, :], mask=valid[:, None], other=0.0).to(F)
        return low * s + z, high * s + z
    return (low - 8.0) * s, (high - 8.0) * s


@triton.jit
def _rows(ptr, scale_ptr, slot, head, heads, width, offset, valid, N: tl.constexpr, BITS: tl.constexpr,
          F: tl.constexpr):
    """Channels [offset, offset + N) of unquantised or int8 rows at `slot` for `head` ([BLOCK, N])."""
    c = tl.arange(0, N)
    row = slot * heads + head
    x = tl.load(ptr + (row * width + offset)[:, None] + c[None, :], mask=valid[:, None], other=0.0)
    if BITS == 8:
        return x.to(F) * tl.load(scale_ptr + row, mask=valid, other=0.0).to(F)[:, None]
    return x


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, tables_ptr, tile_seq_ptr, tile_pos_ptr,
        query_start_ptr, context_lens_ptr, scale, window, kv_heads, table_width, q_stride_t, q_stride_h,
        o_stride_t, o_stride_h, k_width, v_width,
        G: tl.constexpr, G_PAD: tl.constexpr, POS: tl.constexpr, BLOCK_SIZE: tl.constexpr, DK: tl.constexpr,
        DK_TAIL: tl.constexpr, DV: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        KEY_ZERO_POINT: tl.constexpr, V_FROM_K: tl.constexpr, WINDOWED: tl.constexpr, F: tl.constexpr):
    M: tl.constexpr = POS * G_PAD
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_pos_ptr + tile)  # the tile's first position within its chunk
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)

    r = tl.arange(0, M)
    pos, g = first + r // G_PAD, r % G_PAD
    row_ok = (pos < q_len) & (g < G)
    token, head = q_start + pos, kv_head * G + g
    abs_pos = ctx - q_len + pos  # where each query row sits in its sequence
    q_base = token * q_stride_t + head * q_stride_h

    if BITS == 4:
        HALF: tl.constexpr = DK // 2
        hk = tl.arange(0, HALF)
        q_even = tl.load(q_ptr + q_base[:, None] + 2 * hk[None, :], mask=row_ok[:, None], other=0.0).to(F)
        q_odd = tl.load(q_ptr + q_base[:, None] + 2 * hk[None, :] + 1, mask=row_ok[:, None], other=0.0).to(F)
        acc_even = tl.zeros((M, DV // 2), dtype=F)
        acc_odd = tl.zeros((M, DV // 2), dtype=F)
    else:
        q_main = tl.load(q_ptr + q_base[:, None] + tl.arange(0, DK)[None, :], mask=row_ok[:, None], other=0.0)
        if DK_TAIL > 0:
            q_tail = tl.load(q_ptr + q_base[:, None] + DK + tl.arange(0, DK_TAIL)[None, :], mask=row_ok[:, None],
                             other=0.0)
        acc = tl.zeros((M, DV), dtype=F)
    m_i = tl.full((M,), NEG, dtype=F)
    l_i = tl.zeros((M,), dtype=F)

    last = ctx - q_len + tl.minimum(first + POS, q_len)  # one past the newest key any row of the tile sees
    lo = 0
    if WINDOWED:
        lo = tl.maximum(ctx - q_len + first - window + 1, 0)
    offs = tl.arange(0, BLOCK_SIZE)
    for b in range(lo // BLOCK_SIZE, tl.cdiv(last, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * table_width + b)
        k_pos = b * BLOCK_SIZE + offs
        key_ok = k_pos < last
        slot = block * BLOCK_SIZE + offs
        if BITS == 4:
            k_even, k_odd = _int4_rows(k_ptr, k_scale_ptr, slot, kv_head, kv_heads, key_ok, DK // 2, GROUP,
                                       KEY_ZERO_POINT, F)
            s = tl.dot(q_even, tl.trans(k_even), input_precision="ieee")
            s += tl.dot(q_odd, tl.trans(k_odd), input_precision="ieee")
        else:
            k = _rows(k_ptr, k_scale_ptr, slot, kv_head, kv_heads, k_width, 0, key_ok, DK, BITS, F)
            s = tl.dot(q_main.to(k.dtype), tl.trans(k), input_precision="ieee").to(F)
            if DK_TAIL > 0:
                k_tail = _rows(k_ptr, k_scale_ptr, slot, kv_head, kv_heads, k_width, DK, key_ok, DK_TAIL, BITS, F)
                s += tl.dot(q_tail.to(k_tail.dtype), tl.trans(k_tail), input_precision="ieee").to(F)
        visible = row_ok[:, None] & key_ok[None, :] & (k_pos[None, :] <= abs_pos[:, None])
        if WINDOWED:
            visible &= k_pos[None, :] > abs_pos[:, None] - window
        s = tl.where(visible, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        if BITS == 4:
            v_even, v_odd = _int4_rows(v_ptr, v_scale_ptr, slot, kv_head, kv_heads, key_ok, DV // 2, GROUP, False, F)
            acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even, input_precision="ieee")
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision="ieee")
        else:
            if V_FROM_K:
                v = _rows(k_ptr, k_scale_ptr, slot, kv_head, kv_heads, k_width, 0, key_ok, DV, BITS, F)
            else:
                v = _rows(v_ptr, v_scale_ptr, slot, kv_head, kv_heads, v_width, 0, key_ok, DV, BITS, F)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(F)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o_base = token * o_stride_t + head * o_stride_h
    if BITS == 4:
        hv = tl.arange(0, DV // 2)
        tl.store(out_ptr + o_base[:, None] + 2 * hv[None, :], acc_even / l_i[:, None], mask=row_ok[:, None])
        tl.store(out_ptr + o_base[:, None] + 2 * hv[None, :] + 1, acc_odd / l_i[:, None], mask=row_ok[:, None])
    else:
        tl.store(out_ptr + o_base[:, None] + tl.arange(0, DV)[None, :], acc / l_i[:, None], mask=row_ok[:, None])


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def split_key_dim(dk: int) -> tuple[int, int] | None:
    """(main, tail) powers of two summing to dk (tail 0 when dk is one), or None."""
    if _power_of_two(dk):
        return dk, 0
    main = 1 << (dk.bit_length() - 1)
    return (main, dk - main) if _power_of_two(dk - main) and dk - main >= 16 else None


def applies(q: torch.Tensor, k_cache: torch.Tensor, dv: int, kv_bits: int | None) -> bool:
    dk = q.shape[-1]
    if kv_bits == 4:
        return _power_of_two(dk) and _power_of_two(dv) and dk >= 32 and dv >= 32
    return split_key_dim(dk) is not None and _power_of_two(dv) and dv >= 16 and k_cache.shape[1] >= 16


def _positions_per_tile(longest: int, group: int) -> int:
    return max(1, (16 if longest == 1 else 64) // triton.next_power_of_2(group))  # decodes: one tile per sequence


def decode_tiles(seqs: int, q_heads: int, kv_heads: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`tiles` of a step of `seqs` one-token decodes, made on the device (no host data: capturable)."""
    return (torch.arange(seqs, dtype=torch.int32, device=device), torch.zeros(seqs, dtype=torch.int32, device=device),
            _positions_per_tile(1, q_heads // kv_heads))


def tiles(query_start: list[int], q_heads: int, kv_heads: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sequence, first position) of every query tile, and positions per tile."""
    longest = max([b - a for a, b in zip(query_start, query_start[1:])], default=1)
    pos = _positions_per_tile(longest, q_heads // kv_heads)
    seqs, firsts = [], []
    for s, (a, b) in enumerate(zip(query_start, query_start[1:])):
        for first in range(0, b - a, pos):
            seqs.append(s)
            firsts.append(first)
    return to_device(seqs, torch.int32, device), to_device(firsts, torch.int32, device), pos


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, k_scale, v_scale,
                    block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                    tile_plan: tuple[torch.Tensor, torch.Tensor, int], scale: float, sliding_window: int | None,
                    kv_bits: int | None, dv: int) -> torch.Tensor:
    """q [T, Hq, Dk] -> [T, Hq, Dv]; query_start [S + 1] and context_lens [S] int32 on q's device."""
    tokens, q_heads, dk = q.shape
    blocks, block_size, kv_heads = k_cache.shape[:3]
    out = q.new_empty(tokens, q_heads, dv)
    tile_seq, tile_pos, pos = tile_plan
    if tokens == 0 or tile_seq.numel() == 0:
        return out
    group = q_heads // kv_heads
    main, tail = (dk, 0) if kv_bits == 4 else split_key_dim(dk)
    v_source = k_cache if v_cache is None else v_cache
    f = tl.float64 if q.dtype == torch.float64 else tl.float32
    key_zero_point = kv_bits == 4 and k_scale.shape[-1] == 2 * (dk // int4_group(dk))
    _paged_attention_kernel[(tile_seq.numel(), kv_heads)](
        q, k_cache, v_source, k_scale if k_scale is not None else q, v_scale if v_scale is not None else q, out,
        block_tables, tile_seq, tile_pos, query_start, context_lens, scale, sliding_window or 0, kv_heads,
        block_tables.shape[1], q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.shape[-1],
        v_source.shape[-1],
        G=group, G_PAD=triton.next_power_of_2(group), POS=pos, BLOCK_SIZE=block_size, DK=main, DK_TAIL=tail, DV=dv,
        BITS=kv_bits or 0, GROUP=int4_group(dk), KEY_ZERO_POINT=key_zero_point, V_FROM_K=v_cache is None,
        WINDOWED=sliding_window is not None, F=f)
    return out

