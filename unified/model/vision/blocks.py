"""The pieces every vision tower is built from: packed per-image attention, pre-norm blocks, 2-D rotary.

A call encodes all of its images at once as one packed sequence of patches [N, D]. `Segments` says which
patches may attend to each other (one image, one frame or one window); the tower's layers run once over
the whole pack. Segments of one length are batched without a mask, otherwise one block-diagonal mask
serves them all (a variable-length flash kernel is the future fast path on accelerators).

The tower's weights are plain `nn.Linear`s replicated on every tensor-parallel rank: image features feed
the embedding, whose gradient every rank receives whole, so the replicas get identical gradients.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from unified import kernels
from unified.kernels.rotary import apply_rotary
from unified.model.mlp import activation
from unified.model.norm import RMSNorm

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [N, head_dim/2] in fp32


class Segments:
    """Which patches of a packed sequence attend together: `ids[p]` names patch p's segment."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids  # [N]
        counts = torch.unique_consecutive(ids, return_counts=True)[1]
        contiguous = counts.numel() == torch.unique(ids).numel()
        # Equal, contiguous segments: attend as a batch of sequences with no mask at all.
        self.uniform = int(counts[0]) if contiguous and bool((counts == counts[0]).all()) else None
        self.mask = None if self.uniform or counts.numel() == 1 else ids[:, None] == ids[None, :]

    @classmethod
    def of_lengths(cls, lengths: list[int], device: torch.device) -> "Segments":
        return cls(torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                           torch.tensor(lengths, device=device)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q, k, v: [N, heads, d] -> [N, heads, d], attention within each segment."""
        n, heads, d = q.shape
        if self.uniform:
            q, k, v = (t.view(n // self.uniform, self.uniform, heads, d).transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).reshape(n, heads, d)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, N, d]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale).transpose(0, 1)


def make_norm(kind: str, size: int, eps: float, dtype: torch.dtype) -> nn.Module:
    if kind == "rmsnorm":
        return RMSNorm(size, eps, dtype)
    return nn.LayerNorm(size, eps=eps, dtype=dtype)


class VisionAttention(nn.Module):
    """Fused q|k|v projection, optional 2-D rotary on q and k, attention within segments."""

    def __init__(self, dim: int, heads: int, dtype: torch.dtype, rope_interleaved: bool):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)
        self.proj = nn.Linear(dim, dim, dtype=dtype)
        self.rope_interleaved = rope_interleaved

    def forward(self, x: torch.Tensor, segments: Segments, rope: Rope | None) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)  # [N, heads, d] each
        if rope is not None:  # rotate in fp32, as the reference towers do
            cos, sin = rope
            q = apply_rotary(q.float(), cos, sin, self.rope_interleaved).to(v.dtype)
            k = apply_rotary(k.float(), cos, sin, self.rope_interleaved).to(v.dtype)
        return self.proj(segments.attend(q, k, v, self.head_dim ** -0.5).reshape(n, -1))


class VisionMLP(nn.Module):
    """fc2(act(fc1(x))), or with `gated` fc2(act(gate(x)) * up(x)) where fc1 holds [gate | up]."""

    def __init__(self, dim: int, hidden: int, act: str, gated: bool, dtype: torch.dtype):
        super().__init__()
        self.gated = gated
        self.fc1 = nn.Linear(dim, 2 * hidden if gated else hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, dim, dtype=dtype)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.fc2(kernels.gated_activation(self.fc1(x), self.act))
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.norm1 = make_norm(config.norm, config.hidden_size, config.norm_eps, dtype)
        self.attn = VisionAttention(config.hidden_size, config.num_heads, dtype, config.rope_interleaved)
        self.norm2 = make_norm(config.norm, config.hidden_size, config.norm_eps, dtype)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.gated_mlp, dtype)

    def forward(self, x: torch.Tensor, segments: Segments, rope: Rope | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, rope)
        return x + self.mlp(self.norm2(x))


def rope_2d(rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float,
            interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Axial 2-D rotary angles for patches at (rows, cols) [N]: a quarter of the head's frequencies turn
    with the row, a quarter with the column. Laid out [row freqs | col freqs] for half-split rotation
    (Qwen), or [col, row] pairs per frequency for interleaved rotation (Kimi's original weights).
    Returns cos, sin [N, head_dim/2] in fp32."""
    quarter = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=rows.device) / quarter))
    by_row, by_col = rows.float()[:, None] * inv_freq, cols.float()[:, None] * inv_freq  # [N, D/4]
    angles = (torch.stack((by_col, by_row), dim=-1).flatten(1) if interleaved
              else torch.cat((by_row, by_col), dim=-1))
    return angles.cos(), angles.sin()


class Projector(nn.Module):
    """fc2(act(fc1(norm(x)))): Qwen's patch merger, Kimi's projector, LLaVA's projector (no norm).
    `norm_size` < the input size normalises each of the merged patches before they are concatenated."""

    def __init__(self, in_size: int, hidden: int, out_size: int, act: str, dtype: torch.dtype, bias: bool = True,
                 norm: str | None = None, norm_size: int = 0, norm_eps: float = 1e-6):
        super().__init__()
        self.norm = make_norm(norm, norm_size, norm_eps, dtype) if norm else None
        self.fc1 = nn.Linear(in_size, hidden, bias=bias, dtype=dtype)
        self.fc2 = nn.Linear(hidden, out_size, bias=bias, dtype=dtype)
        self.act = activation(act)
        self.in_size = in_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        return self.fc2(self.act(self.fc1(x.reshape(-1, self.in_size))))
