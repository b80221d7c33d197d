"""CLIP vision tower and LLaVA's projector.

Input: `pixel_values` [images, 3, S, S] at the fixed `image_size`. Conv patches, a class token in front,
learned positions, a pre-LayerNorm, then pre-norm blocks (no rotary) attending within each image. LLaVA
feeds the projector the hidden states after `feature_layers` (counted like `hidden_states` of transformers:
0 is the input to the first block, -1 the last block's output; several are concatenated), dropping the class
token under the "default" select strategy. Blocks past the deepest feature layer are not run; their weights
and the post-LayerNorm are kept only so an export round-trips the checkpoint.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from unified.errors import UserError
from unified.model.config import VisionConfig
from unified.model.vision.blocks import Projector, Segments, VisionBlock, make_norm


class ClipVisionTower(nn.Module):
    def __init__(self, config: VisionConfig, out_size: int, dtype: torch.dtype):
        super().__init__()
        self.config = c = config
        self.side = c.image_size // c.patch_size
        self.patch_embed = nn.Parameter(torch.empty(c.hidden_size, c.in_channels, c.patch_size, c.patch_size,
                                                    dtype=dtype))
        self.class_embedding = nn.Parameter(torch.empty(c.hidden_size, dtype=dtype))
        self.position_embedding = nn.Parameter(torch.empty(self.side ** 2 + 1, c.hidden_size, dtype=dtype))
        self.pre_norm = make_norm(c.norm, c.hidden_size, c.norm_eps, dtype)
        self.blocks = nn.ModuleList(VisionBlock(c, dtype) for _ in range(c.depth))
        self.post_norm = make_norm(c.norm, c.hidden_size, c.norm_eps, dtype)
        features = c.hidden_size * len(c.feature_layers)
        self.projector = Projector(features, out_size, out_size, c.projector_act, dtype, bias=c.projector_bias)
        self.layers = [layer % (c.depth + 1) for layer in c.feature_layers]  # indices into hidden_states

    def grid_of(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n = pixel_values.shape[0]
        return torch.tensor([[1, self.side, self.side]] * n, device=pixel_values.device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """pixel_values [images, 3, S, S] -> [images * tokens per image, out_size]."""
        c = self.config
        if tuple(pixel_values.shape[1:]) != (c.in_channels, c.image_size, c.image_size):
            raise UserError(f"{c.kind}: pixel_values of shape {tuple(pixel_values.shape)} do not match the tower's "
                            f"input [images, {c.in_channels}, {c.image_size}, {c.image_size}]; resize the images")
        images = pixel_values.shape[0]
        patches = F.conv2d(pixel_values.to(self.patch_embed.dtype), self.patch_embed, stride=c.patch_size)
        x = torch.cat((self.class_embedding.expand(images, 1, -1), patches.flatten(2).transpose(1, 2)), dim=1)
        x = self.pre_norm(x + self.position_embedding).flatten(0, 1)  # [images * (side^2 + 1), D]
        segments = Segments.of_lengths([self.side ** 2 + 1] * images, x.device)
        hidden = [x]
        for block in self.blocks[:max(self.layers)]:
            hidden.append(block(hidden[-1], segments, None))
        features = torch.cat([hidden[i] for i in self.layers], dim=-1).view(images, self.side ** 2 + 1, -1)
        if c.select_strategy == "default":
            features = features[:, 1:]
        return self.projector(features.flatten(0, 1))
