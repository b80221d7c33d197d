"""Vision-language models: a vision tower in front of the shared decoder.

`VisionLanguageModel` is a `CausalLM` with one more submodule, `vision` (tower + projector), so every user
of the decoder (engine, trainer, LoRA, export) sees the same parameter names plus `vision.*`. Images are
encoded separately (`encode_images`, all images of a call in one pass of the tower) and their rows are handed
to `forward`, which puts them where the prompt holds the image placeholder token. A caller that runs a prompt
in chunks passes the rows of the placeholders present in each chunk.

The tower is replicated on every tensor-parallel rank (sharding it is future work); under pipeline
parallelism only the first stage, which embeds tokens, builds it.

Qwen-VL models place image tokens with M-RoPE: `mrope_positions` gives the three position axes of a prompt
and the offset that decode positions add afterwards.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from unified.errors import UserError
from unified.model.config import ModelConfig
from unified.model.transformer import CausalLM
from unified.model.vision import build_vision_tower


class VisionLanguageModel(CausalLM):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        assert config.vision is not None and config.image_token_id is not None
        self.vision = build_vision_tower(config.vision, config.hidden_size, dtype) if self.stage.first else None
        for param in self.vision.parameters() if self.vision is not None else ():
            set_tensor_model_parallel_attributes(param, is_parallel=False, dim=-1, stride=1)  # replicated

    def image_token_counts(self, image_grid_thw: torch.Tensor) -> list[int]:
        """How many placeholder tokens each image takes in a prompt."""
        return image_token_counts(self.config, image_grid_thw)

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """All images of a call -> [total image tokens, hidden_size], rows in image order. `image_grid_thw`
        [images, 3] (in patches) is required for the NaViT towers; fixed-size towers (CLIP) infer it."""
        assert self.vision is not None, "only the first pipeline stage encodes images"
        if image_grid_thw is None:
            if not hasattr(self.vision, "grid_of"):
                raise UserError(f"{self.config.vision.kind}: encode_images needs image_grid_thw")
            image_grid_thw = self.vision.grid_of(pixel_values)
        return self.vision(pixel_values, image_grid_thw.to(pixel_values.device))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                layer_outputs: dict[int, torch.Tensor] | None = None,
                image_embeds: torch.Tensor | None = None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """As CausalLM.forward; `image_embeds` rows replace, in order, the embeddings of the tokens equal to
        config.image_token_id, or of the tokens `image_mask` [B, S] marks (an engine step passes it, so a
        placeholder id that a text prompt holds or a sequence sampled keeps its token embedding)."""
        if image_embeds is not None and self.stage.first:
            inputs_embeds = self.merge_image_embeds(input_ids, image_embeds, inputs_embeds, image_mask)
        return super().forward(input_ids, positions, inputs_embeds, layer_outputs)

    def merge_image_embeds(self, input_ids: torch.Tensor, image_embeds: torch.Tensor,
                           inputs_embeds: torch.Tensor | None = None,
                           image_mask: torch.Tensor | None = None) -> torch.Tensor:
        placeholders = input_ids == self.config.image_token_id if image_mask is None else image_mask  # [B, S]
        found = int(placeholders.sum())
        if found != image_embeds.shape[0]:
            raise UserError(f"the prompt holds {found} image placeholder tokens (id {self.config.image_token_id}) "
                            f"but {image_embeds.shape[0]} image embedding rows were given; give one row per "
                            f"placeholder (see image_token_counts)")
        if inputs_embeds is None:  # the placeholder id may lie outside the vocabulary: embed id 0 there
            inputs_embeds = self.embed(input_ids.masked_fill(placeholders, 0))
        return inputs_embeds.masked_scatter(placeholders.unsqueeze(-1), image_embeds.to(inputs_embeds.dtype))


def image_token_counts(config: ModelConfig, image_grid_thw: torch.Tensor) -> list[int]:
    """Placeholder tokens per image of `image_grid_thw` [images, 3] (patches per axis)."""
    vision = config.vision
    assert vision is not None
    if vision.kind == "clip":
        side = vision.image_size // vision.patch_size
        return [side * side + (vision.select_strategy == "full")] * image_grid_thw.shape[0]
    return (image_grid_thw.prod(-1) // vision.merge_size ** 2).tolist()


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                    config: ModelConfig) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of one prompt, input_ids [S] -> (positions [3, S], delta).

    Text advances all three axes by one per token. An image of t x h x w LM tokens starting at position p
    takes (p + frame, p + row, p + column); the text after it resumes at p + max(h, w) (as transformers'
    get_rope_index for images). Decode positions continue as token index + delta on every axis."""
    assert config.vision is not None and config.image_token_id is not None
    device = input_ids.device
    is_image = (input_ids == config.image_token_id).tolist()
    grids = image_grid_thw.tolist() if image_grid_thw is not None else []
    counts = image_token_counts(config, image_grid_thw) if grids else []
    m = config.vision.merge_size
    parts, start, index, image = [], 0, 0, 0
    while index < len(is_image):
        if not is_image[index]:
            end = index
            while end < len(is_image) and not is_image[end]:
                end += 1
            parts.append(torch.arange(start, start + end - index, device=device).expand(3, -1))
            start += end - index
            index = end
            continue
        if image >= len(grids):
            raise UserError(f"the prompt holds more image placeholder tokens than the {len(grids)} images given")
        t, h, w = grids[image][0], grids[image][1] // m, grids[image][2] // m
        if index + counts[image] > len(is_image) or not all(is_image[index:index + counts[image]]):
            raise UserError(f"image {image} needs {counts[image]} consecutive placeholder tokens at token {index}")
        axes = torch.meshgrid(torch.arange(t, device=device), torch.arange(h, device=device),
                              torch.arange(w, device=device), indexing="ij")
        parts.append(torch.stack([a.flatten() for a in axes]) + start)
        start += max(h, w)
        index += counts[image]
        image += 1
    if image != len(grids):
        raise UserError(f"{len(grids)} images were given but the prompt has placeholders for {image}")
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long, device=device)
    delta = int(positions.max()) + 1 - positions.shape[1] if positions.numel() else 0
    return positions, delta
