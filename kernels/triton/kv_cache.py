"""Writing K/V rows into the paged cache, quantising on the way (Triton; reference: unified/kernels/kv_quant.py's
quantize_kv and paged_attention.py's write_kv).

Rows are (token, head) pairs, BLOCK_R per program. Quantised caches first rotate each head vector by the
orthonormal Hadamard matrix (identity where the head size is not a power of two), as one matmul per tile:
  int8  one float32 scale per row (absmax / 127), codes rounded half to even as torch.round;
  int4  groups of GROUP rotated channels with a float16 scale (and, for centred keys, a float16 zero-point
        after the `centre` [H, D] is subtracted), codes two per byte, the even channel in the low nibble.
The rotation is computed as two matmuls, into the even and the odd channels, so the nibbles pair up with
no interleaving.
"""
import functools

import torch
import triton
import triton.language as tl

from unified.kernels.kv_quant import rotation


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _copy_rows_kernel(x_ptr, slots_ptr, cache_ptr, rows, heads, x_token_stride,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    ok = r < rows
    token, head = r // heads, r % heads
    slot = tl.load(slots_ptr + token, mask=ok, other=0)
    m = ok[:, None] & (c[None, :] < D)
    x = tl.load(x_ptr + (token * x_token_stride + head * D)[:, None] + c[None, :], mask=m)
    tl.store(cache_ptr + ((slot * heads + head) * D)[:, None] + c[None, :], x.to(cache_ptr.dtype.element_ty), mask=m)


@triton.jit
def _quantize_rows_kernel(x_ptr, slots_ptr, centre_ptr, h_even_ptr, h_odd_ptr, codes_ptr, scales_ptr, rows, heads,
                          x_token_stride, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                          ZERO_POINT: tl.constexpr, BLOCK_R: tl.constexpr, F: tl.constexpr):
    HALF: tl.constexpr = D // 2
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < rows
    token, head = r // heads, r % heads
    slot = tl.load(slots_ptr + token, mask=ok, other=0)
    c = tl.arange(0, D)
    x = tl.load(x_ptr + (token * x_token_stride + head * D)[:, None] + c[None, :], mask=ok[:, None], other=0.0).to(F)
    if ZERO_POINT:
        x = x - tl.load(centre_ptr + (head * D)[:, None] + c[None, :], mask=ok[:, None], other=0.0).to(F)
    h = tl.arange(0, HALF)
    h_even = tl.load(h_even_ptr + c[:, None] * HALF + h[None, :]).to(F)  # [D, D/2]: columns 0, 2, 4, ...
    h_odd = tl.load(h_odd_ptr + c[:, None] * HALF + h[None, :]).to(F)
    even = tl.dot(x, h_even, input_precision="ieee")  # [R, D/2] rotated channels 0, 2, 4, ...
    odd = tl.dot(x, h_odd, input_precision="ieee")
    row = slot * heads + head
    if BITS == 8:
        scale = tl.maximum(tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1)), 1e-8) / 127.0
        qe = tl.minimum(tl.maximum(_round_half_even(even / scale[:, None]), -128.0), 127.0).to(tl.int8)
        qo = tl.minimum(tl.maximum(_round_half_even(odd / scale[:, None]), -128.0), 127.0).to(tl.int8)
        tl.store(codes_ptr + (row * D)[:, None] + 2 * h[None, :], qe, mask=ok[:, None])
        tl.store(codes_ptr + (row * D)[:, None] + 2 * h[None, :] + 1, qo, mask=ok[:, None])
        tl.store(scales_ptr + row, scale.to(scales_ptr.dtype.element_ty), mask=ok)
    else:
        GROUPS: tl.constexpr = D // GROUP
        ge = tl.reshape(even, (BLOCK_R, GROUPS, GROUP // 2))
        go = tl.reshape(odd, (BLOCK_R, GROUPS, GROUP // 2))
        if ZERO_POINT:
            low = tl.minimum(tl.min(ge, axis=2), tl.min(go, axis=2))
            high = tl.maximum(tl.max(ge, axis=2), tl.max(go, axis=2))
            zero = low.to(tl.float16).to(F)
            scale = tl.maximum((high - zero) / 15.0, 1e-6).to(tl.float16).to(F)
            qe = tl.minimum(tl.maximum(_round_half_even((ge - zero[:, :, None]) / scale[:, :, None]), 0.0), 15.0)
            qo = tl.minimum(tl.maximum(_round_half_even((go - zero[:, :, None]) / scale[:, :, None]), 0.0), 15.0)
        else:
            top = tl.maximum(tl.max(tl.abs(ge), axis=2), tl.max(tl.abs(go), axis=2))
            scale = tl.maximum(top / 7.0, 1e-6).to(tl.float16).to(F)
            qe = tl.minimum(tl.maximum(_round_half_even(ge / scale[:, :, None]), -8.0), 7.0) + 8.0
            qo = tl.minimum(tl.maximum(_round_half_even(go / scale[:, :, None]), -8.0), 7.0) + 8.0
        packed = tl.reshape(qe.to(tl.uint8) | (qo.to(tl.uint8) << 4), (BLOCK_R, HALF))
        tl.store(codes_ptr + (row * HALF)[:, None] + h[None, :], packed, mask=ok[:, None])
        g = tl.arange(0, GROUPS)
        per_row = GROUPS * (2 if ZERO_POINT else 1)
        tl.store(scales_ptr + (row * per_row)[:, None] + g[None, :], scale.to(tl.float16), mask=ok[:, None])
        if ZERO_POINT:
            tl.store(scales_ptr + (row * per_row + GROUPS)[:, None] + g[None, :], zero.to(tl.float16), mask=ok[:, None])


def _rows(x: torch.Tensor) -> tuple[int, int, int]:
    tokens, heads, dim = x.shape
    assert x.stride(-1) == 1 and x.stride(-2) == dim, "heads must be contiguous"
    return tokens * heads, heads, dim


def write_rows(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    """cache [blocks, block_size, H, D] <- x [T, H, D] at flat slots [T], cast to the cache's dtype."""
    rows, heads, dim = _rows(x)
    if rows:
        block_r = 16
        _copy_rows_kernel[(triton.cdiv(rows, block_r),)](x, slots, cache, rows, heads, x.stride(0), D=dim,
                                                        BLOCK_D=triton.next_power_of_2(dim), BLOCK_R=block_r)


def quantize_rows(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, bits: int,
                  group: int, centre: torch.Tensor | None) -> None:
    """Quantises x [T, H, D] (D a power of two) into codes/scales at flat slots, rotated by kv_quant's
    Hadamard matrix; `centre` [H, D] makes int4 groups asymmetric."""
    rows, heads, dim = _rows(x)
    if not rows:
        return
    compute = tl.float64 if x.dtype == torch.float64 else tl.float32
    even, odd = _rotation_columns(dim, x.device, torch.float64 if x.dtype == torch.float64 else torch.float32)
    block_r = 16
    _quantize_rows_kernel[(triton.cdiv(rows, block_r),)](
        x, slots, centre if centre is not None else x, even, odd, codes, scales, rows, heads, x.stride(0), D=dim,
        BITS=bits, GROUP=group, ZERO_POINT=centre is not None, BLOCK_R=block_r, F=compute)


@functools.cache  # once per device and dtype, not per layer and step
def _rotation_columns(dim: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation's even and odd columns (the kernel writes int4 nibble pairs from them)."""
    h = rotation(dim, device, identity=True).to(dtype)
    return h[:, 0::2].contiguous(), h[:, 1::2].contiguous()


def applies(x: torch.Tensor, bits: int | None) -> bool:
    dim = x.shape[-1]
    return x.dim() == 3 and x.stride(-1) == 1 and x.stride(-2) == dim and (
        bits is None or (dim & (dim - 1) == 0 and dim >= 32))
