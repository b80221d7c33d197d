"""Qwen2-VL / Qwen2.5-VL image preprocessing, value-for-value the transformers PIL processor
(`Qwen2VLImageProcessorPil`).

An image is resized (bicubic, Pillow) so both sides are multiples of patch_size * merge_size and its
area lies in [min_pixels, max_pixels], then cut into patch_size^2 patches. Patches are listed merge
window by merge window (the merge_size x merge_size patches the model fuses into one token are
adjacent), each flattened as [C, temporal_patch_size, patch, patch] with the still image repeated
along time. One image fills grid_h * grid_w / merge_size^2 placeholder tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from unified.vision.pixels import (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageProcessor, apply_table,
                                   check_aspect_ratio, pil_value_table)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) Qwen2-VL resizes to: multiples of `factor`, area within [min_pixels, max_pixels],
    aspect ratio kept as well as rounding allows."""
    new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
    if new_height * new_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


@dataclass
class Qwen2VLProcessor(ImageProcessor):
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = int(Image.Resampling.BICUBIC)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    table: np.ndarray = field(init=False, repr=False, compare=False)

    family = "qwen2_vl"
    image_token = "<|image_pad|>"
    prompt_marker = "<|vision_start|><|image_pad|><|vision_end|>"

    def __post_init__(self):
        self.table = pil_value_table(self.do_rescale, self.rescale_factor, self.do_normalize,
                                     self.image_mean, self.image_std)

    def canvas(self, image: Image.Image) -> np.ndarray:
        check_aspect_ratio(image.height, image.width, "Qwen2-VL")
        height, width = smart_resize(image.height, image.width, self.patch_size * self.merge_size,
                                     self.min_pixels, self.max_pixels)
        return np.asarray(image.resize((width, height), resample=self.resample))

    def encode(self, canvases: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        p, t = self.patch_size, self.temporal_patch_size
        grids = [(1, canvas.shape[0] // p, canvas.shape[1] // p) for canvas in canvases]
        counts = [grid_h * grid_w for _, grid_h, grid_w in grids]
        rows = np.empty((sum(counts), 3, t, p * p), np.float32)  # each row: [C, T, ph * pw]
        start = 0
        for canvas, count in zip(canvases, counts):
            image_rows = rows[start:start + count]
            apply_table(self.table, self._patch_samples(canvas), image_rows[:, :, 0].transpose(1, 0, 2))
            image_rows[:, :, 1:] = image_rows[:, :, :1]  # a still image: every temporal slice is the same
            start += count
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        num_tokens = [count // self.merge_size ** 2 for count in counts]
        return torch.from_numpy(rows.reshape(len(rows), 3 * t * p * p)), grid, num_tokens

    def _patch_samples(self, canvas: np.ndarray) -> np.ndarray:
        """[H, W, C] -> [C, patches, ph * pw], patches ordered merge window by merge window."""
        height, width, channels = canvas.shape
        p, m = self.patch_size, self.merge_size
        windows = canvas.reshape(height // p // m, m, p, width // p // m, m, p, channels)  # [Wh,mh,ph,Ww,mw,pw,C]
        windows = windows.transpose(6, 0, 3, 1, 4, 2, 5)  # [C, Wh, Ww, mh, mw, ph, pw]
        return np.ascontiguousarray(windows).reshape(channels, -1, p * p)
