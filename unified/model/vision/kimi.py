"""Kimi-K2.5's vision tower (MoonViT) and projector.

Input: `pixel_values` [patches, 3, P, P] with each image's patches in raster order, `grid_thw` [images, 3]
(t = 1: still images). A conv patch embedding plus a learned position table resampled (bicubic) to each
image's grid, pre-norm blocks with 2-D rotary attending within one image, a final LayerNorm, then every
kernel of kh x kw neighbouring patches is normalised patch by patch, concatenated and projected to the LM.

The fused q|k|v weights stay in the original checkpoints' layout, whose rotary pairs are interleaved
(x0, x1), (x2, x3), ... within each head; transformers permutes rows to rotate halves instead, equivalently.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from unified.errors import UserError
from unified.model.config import VisionConfig
from unified.model.vision.blocks import Projector, Segments, VisionBlock, make_norm, rope_2d


class KimiVisionTower(nn.Module):
    def __init__(self, config: VisionConfig, out_size: int, dtype: torch.dtype, projector_norm_size: int):
        super().__init__()
        self.config = c = config
        self.patch_embed = nn.Conv2d(c.in_channels, c.hidden_size, c.patch_size, stride=c.patch_size, dtype=dtype)
        self.pos_embed = nn.Parameter(torch.empty(*c.pos_embed_shape, c.hidden_size, dtype=dtype))
        self.blocks = nn.ModuleList(VisionBlock(c, dtype) for _ in range(c.depth))
        self.final_norm = make_norm(c.norm, c.hidden_size, c.norm_eps, dtype)
        merged = c.hidden_size * c.merge_size ** 2
        self.projector = Projector(merged, merged, out_size, c.projector_act, dtype, norm="layernorm",
                                   norm_size=projector_norm_size, norm_eps=c.projector_norm_eps)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [patches, 3, P, P], grid_thw [images, 3] -> [LM tokens, out_size]."""
        c = self.config
        if bool((grid_thw[:, 0] != 1).any()):
            raise UserError(f"{c.kind}: only still images (t = 1 in image_grid_thw) are supported, got "
                            f"{grid_thw.tolist()}")
        x = F.linear(pixel_values.to(self.patch_embed.weight.dtype).flatten(1), self.patch_embed.weight.flatten(1),
                     self.patch_embed.bias)  # [N, D]
        sizes = [(h, w) for _, h, w in grid_thw.tolist()]
        x = x + torch.cat([self._positions(h, w) for h, w in sizes]).to(x.dtype)
        rows = torch.cat([torch.arange(h, device=x.device).repeat_interleave(w) for h, w in sizes])
        cols = torch.cat([torch.arange(w, device=x.device).repeat(h) for h, w in sizes])
        rope = rope_2d(rows, cols, c.hidden_size // c.num_heads, c.rope_theta, interleaved=True)
        segments = Segments.of_lengths([h * w for h, w in sizes], x.device)
        for block in self.blocks:
            x = block(x, segments, rope)
        x = self.final_norm(x)
        return self.projector(torch.cat([self._kernels(part, h, w) for part, (h, w) in
                                         zip(x.split([h * w for h, w in sizes]), sizes)]))

    def _positions(self, h: int, w: int) -> torch.Tensor:
        """The learned [H, W, D] table resampled to an h x w grid -> [h*w, D]."""
        table = self.pos_embed.permute(2, 0, 1).unsqueeze(0).float()  # [1, D, H, W]
        if (h, w) != tuple(self.pos_embed.shape[:2]):
            table = F.interpolate(table, size=(h, w), mode="bicubic", align_corners=False)
        return table[0].flatten(1).t()

    def _kernels(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h*w, D] in raster order -> [(h/m)*(w/m)*m*m, D]: the patches of each m x m kernel together."""
        m = self.config.merge_size
        return x.view(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)
