"""Qwen2-VL preprocessing equals transformers' Qwen2VLImageProcessorPil bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from unified.vision.images import ImageError
from unified.vision.qwen2_vl import Qwen2VLProcessor

# (width, height): tiny (upscaled to min_pixels), odd sizes, both orientations, thin strips, and
# images over max_pixels (the downscale branch).
SIZES = [(1, 1), (3, 5), (28, 28), (911, 37), (1024, 768), (768, 1024), (1, 150), (6000, 33), (1500, 2000)]


def _assert_same(ours, theirs):
    assert ours.pixel_values.dtype == torch.float32 and ours.image_grid_thw.dtype == torch.long
    assert torch.equal(ours.image_grid_thw, theirs["image_grid_thw"])
    assert ours.pixel_values.shape == theirs["pixel_values"].shape
    assert torch.equal(ours.pixel_values, theirs["pixel_values"]), \
        (ours.pixel_values - theirs["pixel_values"]).abs().max()


@pytest.mark.parametrize("width, height", SIZES)
def test_default_processor_matches_transformers(photo, width, height):
    image = photo(width, height, seed=width)
    _assert_same(Qwen2VLProcessor()([image]), Qwen2VLImageProcessorPil()(images=[image], return_tensors="pt"))


def test_other_settings_and_batches_match_transformers(photo):
    """Qwen2.5-VL's released pixel range, and a Qwen3-VL-like geometry (16-pixel patches, 0.5 mean/std)."""
    images = [photo(640, 480, 1), photo(33, 700, 2), Image.new("RGB", (50, 50), (7, 7, 7))]
    settings = [dict(min_pixels=3136, max_pixels=12845056),
                dict(min_pixels=4096, max_pixels=200_000, patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)]
    for setting in settings:
        theirs = Qwen2VLImageProcessorPil(**setting)(images=images, return_tensors="pt")
        ours = Qwen2VLProcessor(**setting)(images)
        _assert_same(ours, theirs)
        merged = [int(t * h * w) // 4 for t, h, w in theirs["image_grid_thw"]]
        assert ours.num_tokens == merged


def test_transparency_is_handled_like_transformers(photo):
    rgba = photo(100, 80).convert("RGBA")
    alpha = np.asarray(photo(100, 80, seed=3))[..., 0]
    rgba.putalpha(Image.fromarray(alpha))
    _assert_same(Qwen2VLProcessor()([rgba]), Qwen2VLImageProcessorPil()(images=[rgba], return_tensors="pt"))


def test_token_counts_match_transformers_patch_count():
    hf = Qwen2VLImageProcessorPil()
    for width, height in SIZES:
        ours = Qwen2VLProcessor()([Image.new("RGB", (width, height))])
        assert ours.num_tokens == [hf.get_number_of_image_patches(height, width) // 4]


def test_patch_rows_are_merge_windows_of_the_image():
    """Row 0..3 are the top-left 2x2 patches (raster order inside the window), each [C, T, 14, 14]."""
    pixels = np.arange(56 * 56 * 3, dtype=np.uint8).reshape(56, 56, 3)
    processor = Qwen2VLProcessor(do_rescale=False, do_normalize=False, min_pixels=56 * 56)
    rows = processor([Image.fromarray(pixels)]).pixel_values.view(16, 3, 2, 14, 14)
    planes = torch.from_numpy(pixels.astype(np.float32)).permute(2, 0, 1)
    assert torch.equal(rows[1, :, 0], planes[:, 0:14, 14:28])  # right of the first patch
    assert torch.equal(rows[2, :, 1], planes[:, 14:28, 0:14])  # below it, second temporal copy
    assert torch.equal(rows[4, :, 0], planes[:, 0:14, 28:42])  # the next window starts at column 28


def test_extreme_aspect_ratio_is_an_image_error(photo):
    with pytest.raises(ImageError, match="aspect ratio of 250:1.*at most 200:1.*Crop it"):
        Qwen2VLProcessor()([photo(500, 2)])
