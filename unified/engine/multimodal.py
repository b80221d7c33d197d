"""Images in engine requests: where each image's tokens sit in the prompt, and the encoder cache.

A request's images are preprocessed once, at `add_request`; each image's single placeholder token in
the prompt is expanded to as many copies as the image has embedding rows. The prompt is then text to
the scheduler and the block manager: image tokens occupy KV slots like any token, and a block's
prefix-cache hash also covers the content hashes of the images whose tokens it holds, so the same
text with a different image never hits. The model runner encodes, in one batched call of the vision
tower per step, every image of the step that is not in the encoder cache (keyed by content hash, LRU
by bytes), then hands the model the embedding rows of exactly the placeholder tokens it computes,
which may be part of an image when a prefill is chunked or starts after a prefix-cache hit.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class ImageSpan:
    hash: str  # content hash of the preprocessed pixels and grid
    offset: int  # prompt index of the image's first placeholder token
    num_tokens: int
    pixel_values: torch.Tensor  # this image's pixels in the family's layout
    grid_thw: tuple[int, int, int] | None  # patch grid of navit towers (Qwen-VL, Kimi); None: fixed-size towers

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass
class MultimodalPrompt:
    images: list[ImageSpan]
    mrope_positions: torch.Tensor | None = None  # [3, prompt tokens] for M-RoPE models
    mrope_delta: int = 0  # generated token i (0-based in the sequence) sits at i + delta on every axis

    def overlapping(self, start: int, end: int) -> list[ImageSpan]:
        return [span for span in self.images if span.offset < end and span.end > start]

    def block_extra(self, start: int, end: int) -> bytes:
        """What, besides token ids, the K/V of tokens [start, end) depend on: their images' content."""
        return "".join(span.hash for span in self.overlapping(start, end)).encode()

    def positions(self, start: int, end: int, num_prompt_tokens: int) -> torch.Tensor:
        """M-RoPE positions [3, end - start] of tokens [start, end)."""
        prompt_part = self.mrope_positions[:, start:min(end, num_prompt_tokens)]
        rest = torch.arange(max(start, num_prompt_tokens), max(end, num_prompt_tokens)) + self.mrope_delta
        return torch.cat([prompt_part, rest.expand(3, -1)], dim=1)


def batch_pixels(spans: list[ImageSpan]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tower's batched input for `spans`: navit patches concatenated with their grids, or stacked images."""
    if spans[0].grid_thw is None:
        return torch.stack([s.pixel_values for s in spans]), None
    return torch.cat([s.pixel_values for s in spans]), torch.tensor([s.grid_thw for s in spans], dtype=torch.long)


class EncoderCache:
    """Vision-tower outputs by image content hash; least recently used entries go first past `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def embeddings(self, encode, spans: list[ImageSpan]) -> dict[str, torch.Tensor]:
        """Rows [num_tokens, hidden] of each span's image; the ones not cached are encoded together by
        `encode(pixel_values, grid_thw) -> [total rows, hidden]`."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, ImageSpan] = {}
        for span in spans:
            if span.hash in found or span.hash in missing:
                continue
            if span.hash in self.entries:
                self.entries.move_to_end(span.hash)
                found[span.hash] = self.entries[span.hash]
                self.hits += 1
            else:
                missing[span.hash] = span
                self.misses += 1
        if missing:
            todo = list(missing.values())
            rows = encode(*batch_pixels(todo))
            for span, embeds in zip(todo, rows.split([s.num_tokens for s in todo])):
                found[span.hash] = embeds
                self._put(span.hash, embeds)
        return found

    def _put(self, key: str, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes:
            return
        self.entries[key] = embeds
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= evicted.numel() * evicted.element_size()

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


def multimodal_prompt(token_ids: list[int], images, processor, config) -> tuple[list[int], MultimodalPrompt]:
    """Loads and preprocesses `images` (paths, bytes, data URLs or PIL images; or the `ImageInputs` the
    processor made of them already) for a prompt holding one placeholder token per image; returns the
    prompt with each placeholder expanded to its image's rows. Bad images raise unified.vision.ImageError."""
    from unified.vision.images import load_image
    from unified.vision.pixels import ImageInputs
    from unified.vision.placeholders import expand_image_placeholders

    inputs = images if isinstance(images, ImageInputs) else processor([load_image(image) for image in images])
    expanded = expand_image_placeholders(token_ids, config.image_token_id, inputs.num_tokens)
    offsets, shift, image = [], 0, 0
    for index, token in enumerate(token_ids):
        if token == config.image_token_id:
            offsets.append(index + shift)
            shift += inputs.num_tokens[image] - 1
            image += 1
    grids = inputs.image_grid_thw
    if grids is None:
        pixels, grid_tuples = list(inputs.pixel_values.unbind(0)), [None] * len(inputs.num_tokens)
    else:
        pixels = list(inputs.pixel_values.split(grids.prod(-1).tolist()))
        grid_tuples = [tuple(g) for g in grids.tolist()]
    spans = [ImageSpan(h, offset, n, p, g)
             for h, offset, n, p, g in zip(inputs.hashes, offsets, inputs.num_tokens, pixels, grid_tuples)]
    prompt = MultimodalPrompt(spans)
    if getattr(config, "mrope_section", None) is not None:
        from unified.model.multimodal import mrope_positions

        prompt.mrope_positions, prompt.mrope_delta = mrope_positions(torch.tensor(expanded), grids, config)
    return expanded, prompt
