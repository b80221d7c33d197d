"""Kimi-K2.5 (MoonViT) image preprocessing, the algorithm of transformers' `Kimi_K25ImageProcessor`.

That processor runs on torchvision, which this project cannot install; these are its steps in plain
torch, following what torchvision does on the CPU:
- `navit_resize`: shrink (never enlarge) to at most `max_patches` patches and `max_size_per_side`
  patches per side, then zero-pad bottom/right to multiples of patch_size * merge_size.
- resize: `tvF.resize(uint8, BICUBIC, antialias=True)` on a CPU uint8 tensor calls
  `torch.nn.functional.interpolate(..., mode="bicubic", align_corners=False, antialias=True)` directly
  (torchvision's native uint8 path; Pillow-like integer arithmetic), and returns the image unchanged
  when the size does not change.
- rescale + normalize fused as torchvision does: float32 (x - mean * 255) / (std * 255).
- patches in raster order over the grid (not by merge window, unlike Qwen2-VL): [N, 3, patch, patch].
The model merges merge_size x merge_size patches into one token: grid_h * grid_w / merge_size^2 tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from unified.vision.pixels import ImageProcessor, apply_table


def navit_resize(height: int, width: int, patch_size: int, merge_size: int, max_patches: int,
                 max_size_per_side: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized height, width), (padded height, width)) for one image."""
    patches = max(1.0, height // patch_size) * max(1.0, width // patch_size)
    side_limit = max_size_per_side * patch_size
    scale = min(1.0, math.sqrt(max_patches / patches), side_limit / height, side_limit / width)
    new_height = min(max(1, int(height * scale)), side_limit)
    new_width = min(max(1, int(width * scale)), side_limit)
    factor = merge_size * patch_size
    return (new_height, new_width), (-(-new_height // factor) * factor, -(-new_width // factor) * factor)


@dataclass
class KimiK25Processor(ImageProcessor):
    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    max_size_per_side: int = 512  # in patches
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    table: np.ndarray = field(init=False, repr=False, compare=False)

    family = "kimi_k25"
    image_token = "<|media_pad|>"
    prompt_marker = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"

    def __post_init__(self):
        # The exact expressions of torchvision's fused rescale + normalize, on the 256 sample values.
        mean = (torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)).view(-1, 1)
        std = (torch.tensor(self.image_std) * (1.0 / self.rescale_factor)).view(-1, 1)
        samples = torch.arange(256, dtype=torch.uint8).expand(3, 256).to(torch.float32)
        self.table = samples.sub(mean).div_(std).numpy()

    def canvas(self, image: Image.Image) -> np.ndarray:
        (height, width), (padded_height, padded_width) = navit_resize(
            image.height, image.width, self.patch_size, self.merge_size, self.max_patches, self.max_size_per_side)
        pixels = np.asarray(image)
        if (height, width) != (image.height, image.width):
            planes = torch.from_numpy(pixels.transpose(2, 0, 1).copy())[None]  # [1, 3, H, W] uint8
            planes = F.interpolate(planes, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
            pixels = planes[0].permute(1, 2, 0).numpy()
        canvas = np.zeros((padded_height, padded_width, 3), np.uint8)
        canvas[:height, :width] = pixels
        return canvas

    def encode(self, canvases: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        p = self.patch_size
        grids = [(1, canvas.shape[0] // p, canvas.shape[1] // p) for canvas in canvases]
        counts = [grid_h * grid_w for _, grid_h, grid_w in grids]
        pixel_values = np.empty((sum(counts), 3, p, p), np.float32)
        start = 0
        for canvas, (_, grid_h, grid_w), count in zip(canvases, grids, counts):
            samples = canvas.reshape(grid_h, p, grid_w, p, 3).transpose(4, 0, 2, 1, 3)  # [C, gh, gw, ph, pw]
            out = pixel_values[start:start + count].transpose(1, 0, 2, 3)  # [C, patches, ph, pw]
            apply_table(self.table, np.ascontiguousarray(samples).reshape(3, count, p, p), out)
            start += count
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        num_tokens = [count // self.merge_size ** 2 for count in counts]
        return torch.from_numpy(pixel_values), grid, num_tokens
