"""Placeholder expansion in tokenized prompts, and each family's image marker."""
from __future__ import annotations

import pytest
from PIL import Image

from unified.vision import ImageError, expand_image_placeholders, image_prompt_marker
from unified.vision.kimi_k25 import KimiK25Processor
from unified.vision.qwen2_vl import Qwen2VLProcessor

IMAGE = 9


def test_each_placeholder_becomes_its_images_token_count():
    prompt = [1, 2, IMAGE, 3, IMAGE, IMAGE, 4]
    assert expand_image_placeholders(prompt, IMAGE, [2, 3, 1]) == [1, 2, 9, 9, 3, 9, 9, 9, 9, 4]
    assert expand_image_placeholders([5, 6], IMAGE, []) == [5, 6]


def test_counts_from_a_processor_expand_a_qwen_prompt():
    start, pad, end = 151652, 151655, 151653  # <|vision_start|> <|image_pad|> <|vision_end|>
    images = Qwen2VLProcessor()([Image.new("RGB", (112, 56)), Image.new("RGB", (56, 56))])
    assert images.num_tokens == [8, 4]
    expanded = expand_image_placeholders([7, start, pad, end, start, pad, end], pad, images.num_tokens)
    assert expanded == [7, start, *[pad] * 8, end, start, *[pad] * 4, end]
    assert len(images.pixel_values) == 4 * sum(images.num_tokens)  # merge_size^2 patches per token


@pytest.mark.parametrize("prompt, images, counts", [([1, IMAGE, 2], 2, "1 image placeholder.*2 image"),
                                                     ([IMAGE, IMAGE], 1, "2 image placeholder.*1 image"),
                                                     ([1, 2], 1, "0 image placeholder.*1 image")])
def test_placeholder_and_image_counts_must_agree(prompt, images, counts):
    with pytest.raises(ImageError, match=f"{counts}.*once per image"):
        expand_image_placeholders(prompt, IMAGE, [4] * images)


def test_markers_hold_the_family_placeholder_token():
    assert image_prompt_marker("qwen2_vl") == "<|vision_start|><|image_pad|><|vision_end|>"
    assert image_prompt_marker("qwen2_5_vl") == image_prompt_marker("qwen2_vl")
    assert image_prompt_marker("llava") == "<image>"
    assert image_prompt_marker("kimi_k25") == "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    assert KimiK25Processor.image_token in image_prompt_marker("kimi_k25")
