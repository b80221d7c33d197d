"""Qwen2-VL and Qwen2.5-VL vision towers (NaViT: every image at its own size).

Input is what the Qwen image processor emits: `pixel_values` [patches, C * temporal_patch * patch^2], the
patches of each image in merge-block order (t, h/m, w/m, m, m), and `grid_thw` [images, 3] in patches.
A linear patch embedding (the 3-D conv with stride = kernel), 2-D rotary over each patch's (row, col), then
pre-norm blocks attending within one frame of one image, then the merger: m x m neighbouring patches
(consecutive rows) become one LM token.

Qwen2.5-VL uses RMSNorm, a gated MLP, and attends within windows of `window_size` pixels except in
`fullatt_blocks`. Attention is permutation-equivariant within a segment and every other op acts per patch,
so windows are expressed as segment ids over the patches in their given order; the reference's reordering of
patches into window order changes nothing but the summation order.
"""
from __future__ import annotations

import torch
from torch import nn

from unified.model.config import VisionConfig
from unified.model.vision.blocks import Projector, Segments, VisionBlock, rope_2d


class QwenVisionTower(nn.Module):
    def __init__(self, config: VisionConfig, out_size: int, dtype: torch.dtype):
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = nn.Parameter(torch.empty(c.hidden_size, c.in_channels, c.temporal_patch_size,
                                                    c.patch_size, c.patch_size, dtype=dtype))
        self.blocks = nn.ModuleList(VisionBlock(c, dtype) for _ in range(c.depth))
        merged = c.hidden_size * c.merge_size ** 2
        self.merger = Projector(merged, merged, out_size, "gelu", dtype, norm=c.norm, norm_size=c.hidden_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [patches, C*T*P*P], grid_thw [images, 3] -> [LM tokens, out_size]."""
        c = self.config
        x = pixel_values.to(self.patch_embed.dtype) @ self.patch_embed.flatten(1).t()  # [N, D]
        rows, cols, frames, windows = self._layout(grid_thw, x.device)
        rope = rope_2d(rows, cols, c.hidden_size // c.num_heads, c.rope_theta, interleaved=False)
        full = Segments(frames)
        windowed = Segments(windows) if c.window_size else full
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in c.fullatt_blocks or not c.window_size else windowed, rope)
        return self.merger(x)

    def _layout(self, grid_thw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Per patch: row and column in its image, its frame's global id and its window's global id."""
        m = self.config.merge_size
        window = self.config.window_size // m // self.config.patch_size if self.config.window_size else 1
        rows, cols, frames, windows = [], [], [], []
        frame_base = window_base = 0
        for t, h, w in grid_thw.tolist():
            # Patch order (t, h/m, w/m, m, m): recover each patch's block and offset within the block.
            t_i, bh, bw, ih, iw = (g.flatten() for g in torch.meshgrid(
                *(torch.arange(n, device=device) for n in (t, h // m, w // m, m, m)), indexing="ij"))
            rows.append(bh * m + ih)
            cols.append(bw * m + iw)
            frames.append(frame_base + t_i)
            across = (w // m) // window + 1  # windows per row of windows (one spare never hurts: ids only differ)
            down = (h // m) // window + 1
            windows.append(window_base + (t_i * down + bh // window) * across + bw // window)
            frame_base += t
            window_base += t * down * across
        return tuple(torch.cat(parts) for parts in (rows, cols, frames, windows))
