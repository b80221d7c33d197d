"""LLaVA image preprocessing (the CLIP recipe), value-for-value the transformers PIL processors
(`LlavaImageProcessorPil`, which is `CLIPImageProcessorPil` plus `do_pad`).

Optionally pad to a square with the mean color (LLaVA-1.5's "pad" aspect mode), resize the shortest
edge (or to a fixed height x width), center crop, rescale, normalize: one [3, H, W] tensor per image.
Every image fills the same number of placeholder tokens: one per patch, plus the tokens the vision
tower adds (CLIP's class token), minus one if the "default" feature strategy drops the class token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from unified.vision.pixels import (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageProcessor, apply_table,
                                   check_aspect_ratio, pil_value_table)


@dataclass
class LlavaProcessor(ImageProcessor):
    shortest_edge: int | None = 224  # resize so the shorter side is this long; None: to (height, width)
    height: int | None = None
    width: int | None = None
    crop_size: tuple[int, int] | None = (224, 224)  # (height, width); None: no center crop
    do_pad: bool = False
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = int(Image.Resampling.BICUBIC)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    patch_size: int = 14
    num_additional_image_tokens: int = 1
    vision_feature_select_strategy: str = "default"
    table: np.ndarray = field(init=False, repr=False, compare=False)

    family = "llava"
    image_token = "<image>"
    prompt_marker = "<image>"

    def __post_init__(self):
        assert (self.shortest_edge is None) != (self.height is None or self.width is None), \
            "LlavaProcessor resizes either by shortest_edge or to height x width"
        self.table = pil_value_table(self.do_rescale, self.rescale_factor, self.do_normalize,
                                     self.image_mean, self.image_std)

    @property
    def output_size(self) -> tuple[int, int]:
        return self.crop_size or (self.height, self.width)

    @property
    def tokens_per_image(self) -> int:
        height, width = self.output_size
        tokens = (height // self.patch_size) * (width // self.patch_size) + self.num_additional_image_tokens
        return tokens - (self.vision_feature_select_strategy == "default")

    def canvas(self, image: Image.Image) -> np.ndarray:
        check_aspect_ratio(image.height, image.width, "LLaVA")
        if self.do_pad:
            image = self._pad_to_square(image)
        height, width = self._resized_size(image.height, image.width)
        image = image.resize((width, height), resample=self.resample)
        pixels = np.asarray(image)
        return _center_crop(pixels, *self.crop_size) if self.crop_size else pixels

    def encode(self, canvases: list[np.ndarray]) -> tuple[torch.Tensor, None, list[int]]:
        pixel_values = np.empty((len(canvases), 3, *self.output_size), np.float32)
        for canvas, out in zip(canvases, pixel_values):
            apply_table(self.table, canvas.transpose(2, 0, 1), out)
        return torch.from_numpy(pixel_values), None, [self.tokens_per_image] * len(canvases)

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        if self.shortest_edge is None:
            return self.height, self.width
        short, long = sorted((height, width))
        new_long = int(self.shortest_edge * long / short)
        return (new_long, self.shortest_edge) if width <= height else (self.shortest_edge, new_long)

    def _pad_to_square(self, image: Image.Image) -> Image.Image:
        if image.width == image.height:
            return image
        side = max(image.width, image.height)
        background = tuple(int(x * 255) for x in self.image_mean)
        square = Image.new("RGB", (side, side), background)
        square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        return square


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centered height x width window of [H, W, C] pixels; a side shorter than the window is
    zero-padded, centered, first (as transformers' center_crop does)."""
    old_height, old_width = pixels.shape[:2]
    if old_height < height or old_width < width:
        padded = np.zeros((max(height, old_height), max(width, old_width), pixels.shape[2]), pixels.dtype)
        top, left = math.ceil((padded.shape[0] - old_height) / 2), math.ceil((padded.shape[1] - old_width) / 2)
        padded[top:top + old_height, left:left + old_width] = pixels
        pixels = padded
    top, left = (pixels.shape[0] - height) // 2, (pixels.shape[1] - width) // 2
    return pixels[top:top + height, left:left + width]
