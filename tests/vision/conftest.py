"""Deterministic test pictures: smooth gradients, hard edges and some noise, like a photo with text."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image


def make_photo(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    red = 255 * x / max(width - 1, 1)
    green = 255 * y / max(height - 1, 1)
    blue = 127.5 + 127.5 * np.sin(x / 7.0 + seed) * np.cos(y / 11.0)
    pixels = np.stack([red, green, blue], axis=-1)
    pixels[(x // 16 + y // 16) % 5 == 0] = (20, 200, 60)  # hard-edged blocks
    pixels += rng.normal(0, 12, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


@pytest.fixture
def photo():
    return make_photo
