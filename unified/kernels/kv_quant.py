"""KV-cache quantisation: int8 or int4 codes, quantised on write and dequantised inside attention.

Each head vector is first rotated by an orthonormal Hadamard matrix, which spreads the few outlier
channels of keys evenly over the channels, and rotated back on dequantisation.
  int8: symmetric absmax, one fp32 scale per token per head.
  int4: one fp16 scale per group of 32 rotated channels (the whole head vector if its dim is not a
        multiple of 32), codes stored two per byte (low nibble first). Keys are asymmetric (an fp16 zero
        per group too) and centred: a constant `centre` [H, D] is subtracted before quantising and *not*
        added back, which attention ignores (q.(k - c) shifts all of a query's scores equally). On
        SmolLM2 the mean key holds most of a key's energy; centred zero-point keys lift int4 decode-logit
        cosine from 0.95 to 0.996. Values stay symmetric: zero-points there measured worse (0.97).
"""
from __future__ import annotations

import functools

import torch

QMAX = {8: 127, 4: 7}
INT4_GROUP = 32


@functools.cache
def _hadamard(dim: int) -> torch.Tensor | None:
    """Orthonormal Hadamard matrix [dim, dim] (Sylvester), or None if dim is not a power of two."""
    if dim & (dim - 1):
        return None
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / dim ** 0.5


def _rotate(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    h = _hadamard(x.shape[-1])
    if h is None:
        return x
    h = h.to(x.device)
    return x @ (h.T if inverse else h)


@functools.cache  # once per device, not a host-to-device copy per layer and step
def rotation(dim: int, device: torch.device, identity: bool = False) -> torch.Tensor | None:
    """The [dim, dim] rotation quantised rows are stored in (x @ it): the Hadamard matrix, or where dim is not
    a power of two None (the identity, with `identity`). Shared: callers must not write to it."""
    h = _hadamard(dim)
    if h is None:
        return torch.eye(dim, device=device) if identity else None
    return h.to(device)


def int4_group(head_dim: int) -> int:
    return INT4_GROUP if head_dim % INT4_GROUP == 0 else head_dim


def packed_dim(head_dim: int, bits: int | None) -> int:
    return head_dim // 2 if bits == 4 else head_dim


def scale_layout(head_dim: int, bits: int, zero_point: bool = False) -> tuple[tuple[int, ...], torch.dtype]:
    """Trailing shape and dtype of the scales kept per token per head; int4 with zero-points: scales, then zeros."""
    if bits == 8:
        return (), torch.float32
    return ((1 + zero_point) * head_dim // int4_group(head_dim),), torch.float16


def quantize_kv(x: torch.Tensor, bits: int, centre: torch.Tensor | None = None,
                zero_point: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (values int8 [..., D] or packed uint8 [..., D/2], scales as `scale_layout` says).

    int4 only: `centre` (broadcastable to x) is subtracted first and not restored by `dequantize_kv`;
    `zero_point` makes the groups asymmetric."""
    x32 = x.float() if centre is None else x.float() - centre
    if bits == 8:
        assert centre is None and not zero_point
        y = _rotate(x32)
        scale = y.abs().amax(dim=-1).clamp(min=1e-8) / QMAX[8]
        return torch.round(y / scale.unsqueeze(-1)).clamp_(-QMAX[8] - 1, QMAX[8]).to(torch.int8), scale
    g = _rotate(x32).unflatten(-1, (-1, int4_group(x.shape[-1])))  # [..., groups, group]
    if zero_point:
        low, high = torch.aminmax(g, dim=-1, keepdim=True)
        zero = low.half()
        scale = ((high - zero) / 15).clamp_(min=1e-6).half()
        q = ((g - zero) / scale).round_().clamp_(0, 15)
        params = torch.cat((scale, zero), -2)
    else:
        scale = (g.abs().amax(dim=-1, keepdim=True) / QMAX[4]).clamp_(min=1e-6).half()
        q = (g / scale).round_().clamp_(-QMAX[4] - 1, QMAX[4]).add_(8)
        params = scale
    q = q.to(torch.uint8).flatten(-2)
    return q[..., 0::2] | (q[..., 1::2] << 4), params.squeeze(-1)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    if bits == 8:
        return _rotate(q.to(torch.float32) * scale.unsqueeze(-1), inverse=True).to(dtype)
    groups = (2 * q.shape[-1]) // int4_group(2 * q.shape[-1])
    y = torch.stack((q & 0xF, q >> 4), dim=-1).float().view(*q.shape[:-1], groups, -1)  # [..., groups, group]
    params = scale.float().unsqueeze(-1)  # [..., groups (then as many zeros), 1]
    y = y.mul_(params[..., :groups, :]).add_(params[..., groups:, :]) if params.shape[-2] > groups \
        else y.sub_(8).mul_(params)
    return _rotate(y.flatten(-2), inverse=True).to(dtype)
