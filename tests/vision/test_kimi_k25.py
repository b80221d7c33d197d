"""Kimi-K2.5 preprocessing against transformers' Kimi_K25ImageProcessor, which needs torchvision.

torchvision is not installable here, so the class cannot run. What is checked instead:
- sizes: transformers' own `navit_resize` and the class's `patchify`, taken from its source file and
  run without the module's torchvision import;
- values and layout: transformers' Qwen2-VL PIL processor with resize off, merge_size 1 and one
  temporal slice is the same rescale/normalize/raster patchify, fed our resized and padded canvas
  (its arithmetic, (x / 255 - 0.5) / 0.5, differs from the fused (x - 127.5) / 127.5 in the last bit);
- resize: torchvision's CPU uint8 bicubic path is torch's own antialiased interpolate, which we call;
  here it is checked for what it must be, a bicubic resize close to Pillow's.
Not checked: the whole class end to end (the torchvision glue in between).
"""
from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from unified.vision.kimi_k25 import KimiK25Processor, navit_resize

_SOURCE = Path(transformers.__file__).parent / "models" / "kimi_k25" / "image_processing_kimi_k25.py"


def _transformers_function(name: str, owner: str | None = None):
    """A function (or a class's method) from transformers' Kimi image processor source, compiled alone."""
    tree = ast.parse(_SOURCE.read_text())
    scope = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == owner) if owner else tree
    function = next(node for node in scope.body if isinstance(node, ast.FunctionDef) and node.name == name)
    namespace = {"math": math, "torch": torch}
    exec(compile(ast.Module([function], type_ignores=[]), str(_SOURCE), "exec"), namespace)
    return namespace[name]


SIZES = [(1, 1), (13, 13), (14, 14), (28, 29), (911, 37), (1024, 768), (768, 1024), (5000, 3), (3, 20000),
         (2000, 1500), (4000, 3000), (7168, 7168), (10000, 200)]


def test_sizes_match_transformers_navit_resize():
    theirs = _transformers_function("navit_resize")
    for width, height in SIZES:
        for max_patches, side in ((16384, 512), (4096, 64), (65536, 512)):
            ours = navit_resize(height, width, 14, 2, max_patches, side)
            assert ours == theirs(height, width, 14, 2, max_patches, side), (width, height, max_patches, side)


@pytest.mark.parametrize("width, height", [(1, 1), (911, 37), (1024, 768), (2000, 1500)])
def test_values_and_patch_layout_match_transformers(photo, width, height):
    processor = KimiK25Processor()
    image = photo(width, height, seed=width)
    ours = processor([image])
    canvas = processor.canvas(image)
    (_, _), (padded_height, padded_width) = navit_resize(height, width, 14, 2, 16384, 512)
    assert canvas.shape == (padded_height, padded_width, 3)
    assert ours.image_grid_thw.tolist() == [[1, padded_height // 14, padded_width // 14]]

    reference = Qwen2VLImageProcessorPil(do_resize=False, merge_size=1, temporal_patch_size=1,
                                         image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
    theirs = reference(images=[Image.fromarray(canvas)], return_tensors="pt")
    assert theirs["image_grid_thw"].tolist() == ours.image_grid_thw.tolist()
    assert ours.pixel_values.shape == (theirs["pixel_values"].shape[0], 3, 14, 14)
    assert (ours.pixel_values.flatten(1) - theirs["pixel_values"]).abs().max() <= 1e-6

    patchify = _transformers_function("patchify", owner="Kimi_K25ImageProcessor")
    normalized = torch.from_numpy(canvas).permute(2, 0, 1)[None].float().sub(127.5).div(127.5)
    patches, grid_h, grid_w = patchify(None, normalized, patch_size=14)
    assert [grid_h, grid_w] == ours.image_grid_thw[0, 1:].tolist()
    assert torch.equal(patches[0], ours.pixel_values)


def test_padding_is_black_and_tokens_count_merged_patches(photo):
    ours = KimiK25Processor()([Image.new("RGB", (30, 20), (255, 102, 51)), photo(100, 57)])
    assert ours.image_grid_thw.tolist() == [[1, 2, 4], [1, 6, 8]]
    assert ours.num_tokens == [2, 12]
    first = ours.pixel_values[:8].view(2, 4, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 56)  # [C, H, W]
    assert torch.all(first[:, 20:, :] == -1.0) and torch.all(first[:, :, 30:] == -1.0)
    expected = torch.tensor([255, 102, 51]).sub(127.5).div(127.5).view(3, 1, 1).expand(3, 20, 30)
    assert torch.equal(first[:, :20, :30], expected)


def test_resize_is_bicubic_close_to_pillow(photo):
    image = photo(3000, 2000, seed=5)  # a downscale: 214 x 142 patches > 16384
    processor = KimiK25Processor()
    (height, width), _ = navit_resize(2000, 3000, 14, 2, 16384, 512)
    assert (height, width) != (2000, 3000)
    ours = processor.canvas(image)[:height, :width].astype(int)
    pillow = np.asarray(image.resize((width, height), Image.Resampling.BICUBIC)).astype(int)
    difference = np.abs(ours - pillow)
    assert difference.mean() < 0.1 and difference.max() <= 3


def test_images_within_budget_are_not_resampled(photo):
    image = photo(301, 199)
    canvas = KimiK25Processor().canvas(image)
    assert np.array_equal(canvas[:199, :301], np.asarray(image))
