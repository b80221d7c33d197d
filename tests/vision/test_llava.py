"""LLaVA preprocessing equals transformers' LlavaImageProcessorPil / CLIPImageProcessorPil bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import LlavaConfig
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

from unified.vision.images import ImageError
from unified.vision.llava import LlavaProcessor

SIZES = [(1, 1), (3, 5), (336, 336), (911, 37), (1024, 768), (768, 1024), (2, 300), (1500, 2000)]
LLAVA_15 = dict(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})


def _assert_same(ours, theirs):
    assert ours.image_grid_thw is None
    assert ours.pixel_values.shape == theirs["pixel_values"].shape
    assert torch.equal(ours.pixel_values, theirs["pixel_values"]), \
        (ours.pixel_values - theirs["pixel_values"]).abs().max()


@pytest.mark.parametrize("do_pad", [False, True])
@pytest.mark.parametrize("width, height", SIZES)
def test_llava_15_matches_transformers(photo, width, height, do_pad):
    image = photo(width, height, seed=height)
    ours = LlavaProcessor(shortest_edge=336, crop_size=(336, 336), do_pad=do_pad)([image])
    _assert_same(ours, LlavaImageProcessorPil(**LLAVA_15, do_pad=do_pad)(images=[image], return_tensors="pt"))
    assert ours.num_tokens == [LlavaConfig().image_seq_length]  # 576 for a 336-pixel CLIP-L/14


def test_clip_defaults_and_a_batch_match_transformers(photo):
    images = [photo(640, 480, 1), photo(40, 700, 2), Image.new("RGB", (50, 50), (7, 7, 7))]
    _assert_same(LlavaProcessor()(images), CLIPImageProcessorPil()(images=images, return_tensors="pt"))


def test_crop_larger_than_the_resized_image_pads_like_transformers(photo):
    image = photo(300, 200)
    theirs = CLIPImageProcessorPil(size={"shortest_edge": 200}, crop_size={"height": 224, "width": 260})
    ours = LlavaProcessor(shortest_edge=200, crop_size=(224, 260))
    _assert_same(ours([image]), theirs(images=[image], return_tensors="pt"))


def test_fixed_size_resize_matches_transformers(photo):
    image = photo(500, 260)
    theirs = CLIPImageProcessorPil(size={"height": 300, "width": 200}, do_center_crop=False)
    ours = LlavaProcessor(shortest_edge=None, height=300, width=200, crop_size=None)
    _assert_same(ours([image]), theirs(images=[image], return_tensors="pt"))
    assert ours([image]).num_tokens == [(300 // 14) * (200 // 14)]


def test_transparency_and_gray_match_transformers(photo):
    rgba = photo(120, 90).convert("RGBA")
    rgba.putalpha(Image.fromarray(np.asarray(photo(120, 90, seed=4))[..., 1]))
    gray = photo(90, 120).convert("L")
    for image in (rgba, gray):
        theirs = LlavaImageProcessorPil(**LLAVA_15, do_pad=True)(images=[image], return_tensors="pt")
        _assert_same(LlavaProcessor(shortest_edge=336, crop_size=(336, 336), do_pad=True)([image]), theirs)


def test_token_count_follows_the_feature_strategy():
    full = LlavaProcessor(shortest_edge=336, crop_size=(336, 336), vision_feature_select_strategy="full")
    assert full([Image.new("RGB", (10, 10))]).num_tokens == [577]  # the class token is kept
    no_class_token = LlavaProcessor(shortest_edge=384, crop_size=(384, 384), patch_size=14,
                                    num_additional_image_tokens=0, vision_feature_select_strategy="full")
    assert no_class_token.tokens_per_image == 27 * 27


def test_extreme_aspect_ratio_is_an_image_error(photo):
    with pytest.raises(ImageError, match="aspect ratio of 300:1.*LLaVA takes at most 200:1"):
        LlavaProcessor()([photo(1, 300)])
