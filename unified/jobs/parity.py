"""Accuracy consistency check: our model against the `transformers` reference on the same weights.

Both models read the same checkpoint folder and run the same tokens (and, for vision-language models,
the same images); we compare every decoder layer's output and the final logits by cosine similarity and
max absolute difference.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from unified.checkpoint.quantized import dequantizing, quantization_config
from unified.checkpoint.safetensors_io import SafetensorsCheckpoint


@dataclass
class ParityReport:
    layer_cosine: dict[int, float]  # by layer index
    logits_cosine: float
    logits_max_abs_diff: float

    def passes(self, min_cosine: float, max_abs_diff: float) -> bool:
        return (self.logits_cosine >= min_cosine and self.logits_max_abs_diff <= max_abs_diff
                and all(c >= min_cosine for c in self.layer_cosine.values()))

    def table(self) -> str:
        lines = [f"{'output':<12}{'cosine':>12}"]
        lines += [f"layer {i:<6}{c:>12.7f}" for i, c in self.layer_cosine.items()]
        lines.append(f"{'logits':<12}{self.logits_cosine:>12.7f}   max |diff| {self.logits_max_abs_diff:.3e}")
        return "\n".join(lines)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def reference_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """`transformers`' model of the checkpoint; of a quantized one, on the weights it encodes (`_dequantized`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from unified.checkpoint.hf_config import VISION_LANGUAGE

    config = AutoConfig.from_pretrained(str(path))
    auto = AutoModelForImageTextToText if config.model_type in VISION_LANGUAGE else AutoModelForCausalLM
    if quantization_config(config) is not None:
        return _dequantized(auto, config, Path(path), dtype)
    return auto.from_pretrained(str(path), dtype=dtype, attn_implementation="eager").eval()


def _dequantized(auto, config, path: Path, dtype: torch.dtype):
    """The reference of a quantized checkpoint: `transformers`' model of its config without the quantization, given
    the float weights our reader dequantizes (transformers still maps the names to its modules), so that no
    quantization library is needed and the comparison is of the two models on the same weights."""
    ckpt = dequantizing(SafetensorsCheckpoint(path), config)
    plain = copy.deepcopy(config)
    del plain.quantization_config
    model_class = auto._model_mapping[type(plain)]  # the Auto classes need a folder to read
    weights = {name: ckpt.get(name) for name in ckpt.names()}
    return model_class.from_pretrained(None, config=plain, state_dict=weights, dtype=dtype,
                                       attn_implementation="eager").eval()


def _decoder_layers(hf_model):
    inner = hf_model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


@torch.inference_mode()
def compare(ours, reference, input_ids: torch.Tensor, images=None) -> ParityReport:
    """input_ids: [B, S] token ids; both models in eval mode on the same device. `images` (a vision-language
    model's unified.vision.ImageInputs) fill the image placeholder tokens of a one-row input_ids."""
    captured: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out))
             for layer in _decoder_layers(reference)]
    ref_inputs, positions, image_embeds = {}, torch.arange(input_ids.shape[1], device=input_ids.device), None
    if images is not None:
        ref_inputs, positions, image_embeds = _image_inputs(ours, input_ids, images)
    try:
        ref_logits = reference(input_ids=input_ids, **ref_inputs).logits
    finally:
        for hook in hooks:
            hook.remove()
    ours_layers: dict[int, torch.Tensor] = {}  # under pipeline parallelism: this stage's layers only
    extra = {} if image_embeds is None else {"image_embeds": image_embeds}
    our_logits = ours.logits(ours(input_ids, positions, layer_outputs=ours_layers, **extra))
    return ParityReport(
        layer_cosine={i: cosine(out, captured[i]) for i, out in ours_layers.items()},
        logits_cosine=cosine(our_logits, ref_logits),
        logits_max_abs_diff=(our_logits.float() - ref_logits.float()).abs().max().item(),
    )


def _image_inputs(ours, input_ids: torch.Tensor, images) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """(the reference's extra inputs, our positions, our image rows: on the stage that embeds tokens)."""
    from unified.model.multimodal import mrope_positions

    device = input_ids.device
    pixels = images.pixel_values.to(device)
    grid = None if images.image_grid_thw is None else images.image_grid_thw.to(device)
    ref_inputs = {"pixel_values": pixels} | ({} if grid is None else {"image_grid_thw": grid})
    positions = torch.arange(input_ids.shape[1], device=device)
    if ours.config.mrope_section:  # Qwen-VL: the reference builds M-RoPE positions from the token types
        ref_inputs["mm_token_type_ids"] = (input_ids == ours.config.image_token_id).int()
        positions = mrope_positions(input_ids[0], grid, ours.config)[0]
    image_embeds = ours.encode_images(pixels, grid) if ours.vision is not None else None
    return ref_inputs, positions, image_embeds
