"""What every image processor shares: the output record, the base class, and value tables.

Rescale + normalize maps each 8-bit sample to one float, so it is a 256-entry table per channel,
built once by running the reference processor's own arithmetic on the 256 possible values. A lookup
is then bit-identical to that arithmetic over a whole image, and several times faster, the more so as
it reads the 8-bit samples already in the output's order and writes each value once.

An image's content hash covers the 8-bit pixels the model is fed (after resize, crop and pad), the
patch grid and the processor's settings: equal hashes mean equal `pixel_values`, so the engine can key
its encoder cache and prefix cache on it without hashing the (8x larger) float tensor.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from unified.vision.images import ImageError, to_rgb

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# A token count or crop that stretches a side this many times the other is no longer the same picture;
# it is also what bounds the work an upscaling processor does for a 1-pixel-wide image.
MAX_ASPECT_RATIO = 200


@dataclass
class ImageInputs:
    """A batch of images ready for a vision encoder.

    pixel_values: float32 in the family's layout; image_grid_thw: [n, 3] long patch grid (navit
    families) or None; num_tokens[i]: placeholder tokens image i fills in the prompt; hashes[i]: its
    content hash (sha256 hex).
    """
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor | None
    num_tokens: list[int]
    hashes: list[str]


class ImageProcessor:
    """Base of the family processors: `__call__` turns RGB-convertible PIL images into `ImageInputs`.

    A family implements `canvas` (the 8-bit HWC pixels the encoder sees, after resize/crop/pad) and
    `encode` (canvases -> pixel_values, grid, token counts), and carries `image_token` (the text
    placeholder one encoder output position takes) and `prompt_marker` (the text one image is written as).
    `image_token_id` is the placeholder's id when the processor came from a checkpoint's config.json.
    """
    family: str
    image_token: str
    prompt_marker: str
    image_token_id: int | None = None

    def canvas(self, image: Image.Image) -> np.ndarray:
        raise NotImplementedError

    def encode(self, canvases: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        raise NotImplementedError

    def __call__(self, images: list[Image.Image]) -> ImageInputs:
        canvases = [self.canvas(to_rgb(image)) for image in images]
        pixel_values, grid, num_tokens = self.encode(canvases)
        settings = repr(self).encode()
        hashes = [_content_hash(settings, canvas) for canvas in canvases]
        return ImageInputs(pixel_values, grid, num_tokens, hashes)


def check_aspect_ratio(height: int, width: int, family: str) -> None:
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageError(f"the image is {width}x{height}, an aspect ratio of {ratio:.0f}:1; {family} takes at "
                         f"most {MAX_ASPECT_RATIO}:1. Crop it, or pad it towards a square, and send it again.")


def pil_value_table(do_rescale: bool, rescale_factor: float, do_normalize: bool,
                    mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """[3, 256] float32: sample -> value, by the arithmetic of transformers' PIL backend (float64 rescale
    cast to float32, or a plain cast without rescale; then float32 (x - mean) / std)."""
    values = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 256))
    if do_rescale:
        values = (values.astype(np.float64) * rescale_factor).astype(np.float32)
    values = values.astype(np.float32)
    if do_normalize:
        values = (values - np.array(mean, np.float32)[:, None]) / np.array(std, np.float32)[:, None]
    return np.ascontiguousarray(values)


def apply_table(table: np.ndarray, samples: np.ndarray, out: np.ndarray) -> None:
    """out[c] = table[c][samples[c]] for each channel c: samples uint8 [C, ...], out float32 of that shape
    (any strides, so a family writes straight into its output layout)."""
    for channel, values in enumerate(table):
        out[channel] = values[samples[channel]]


def _content_hash(settings: bytes, canvas: np.ndarray) -> str:
    digest = hashlib.sha256(settings)
    digest.update(repr(canvas.shape).encode())
    digest.update(np.ascontiguousarray(canvas).data)
    return digest.hexdigest()
