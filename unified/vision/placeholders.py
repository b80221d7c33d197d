"""Expanding each image's single placeholder token in a tokenized prompt to the positions its
encoder output fills, as the transformers processors do to the text before tokenizing.

A prompt names each image once, with the family's marker (`image_prompt_marker`), whose placeholder
token (`<|image_pad|>`, `<image>`, `<|media_pad|>`) tokenizes to one id; image i then takes
`num_tokens[i]` copies of that id, in order of appearance.
"""
from __future__ import annotations

from collections.abc import Sequence

from unified.vision.images import ImageError


def expand_image_placeholders(token_ids: Sequence[int], image_token_id: int, num_tokens: Sequence[int]) -> list[int]:
    """`token_ids` with the i-th occurrence of `image_token_id` repeated `num_tokens[i]` times."""
    placeholders = sum(1 for token in token_ids if token == image_token_id)
    if placeholders != len(num_tokens):
        raise ImageError(f"the prompt has {placeholders} image placeholder(s) (token id {image_token_id}) but "
                         f"{len(num_tokens)} image(s) came with it; write the image marker once per image, "
                         "where the image belongs, and leave it out of text that has no image.")
    expanded, images = [], iter(num_tokens)
    for token in token_ids:
        if token == image_token_id:
            expanded.extend([image_token_id] * next(images))
        else:
            expanded.append(token)
    return expanded
