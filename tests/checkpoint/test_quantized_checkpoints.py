"""Quantized checkpoints (block FP8 as DeepSeek-V3 ships it, compressed-tensors INT4 / INT8) load as the
weights they encode: our logits equal `transformers` on the same weights dequantized by hand."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from unified.checkpoint import load_model
from unified.checkpoint.quantized import pack_int32
from unified.errors import UserError
from unified.jobs.parity import compare, reference_model

FP8_MAX = 448.0


def _quantizable(name: str, tensor: torch.Tensor) -> bool:
    """The layers' matmul weights (routers, norms, embeddings and the head stay in full precision)."""
    return (".layers." in name and name.endswith(("proj.weight", "gate_up_proj", "down_proj")) and tensor.dim() >= 2
            and "norm" not in name)


def _copy_with(source, target, tensors: dict, quantization_config: dict | None) -> None:
    shutil.copytree(source, target)
    for path in target.glob("*.safetensors"):
        path.unlink()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))


def _block_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale_inv per block, the weight they encode) for a [..., rows, cols] weight."""
    *lead, rows, cols = weight.shape
    grid_r, grid_c = -(-rows // block), -(-cols // block)
    padded = torch.zeros(*lead, grid_r * block, grid_c * block)
    padded[..., :rows, :cols] = weight
    blocks = padded.unflatten(-1, (grid_c, block)).unflatten(-3, (grid_r, block))  # [..., R, b, C, b]
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX  # [..., R, C]
    q = (blocks / scale[..., :, None, :, None]).to(torch.float8_e4m3fn)
    encoded = (q.float() * scale[..., :, None, :, None]).flatten(-2).flatten(-3, -2)[..., :rows, :cols].contiguous()
    q = q.flatten(-2).flatten(-3, -2)[..., :rows, :cols].contiguous()
    return q, scale, encoded


def _int_groups(weight: torch.Tensor, bits: int, group: int, symmetric: bool):
    """(signed values, scale [rows, groups], zero points [rows, groups] or None)."""
    rows, cols = weight.shape
    grouped = weight.view(rows, cols // group, group)
    top = (1 << (bits - 1)) - 1
    if symmetric:
        scale = grouped.abs().amax(-1).clamp(min=1e-12) / top
        q = torch.round(grouped / scale[..., None]).clamp(-top - 1, top)
        return q.view(rows, cols).to(torch.int8), scale, None
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / (2 * top + 1)).clamp(min=1e-12)
    zero = torch.round(-top - 1 - low / scale).clamp(-top - 1, top)
    q = torch.round(grouped / scale[..., None] + zero[..., None]).clamp(-top - 1, top)
    return q.view(rows, cols).to(torch.int8), scale, zero


def _logits_gap(quantized, reference) -> float:
    ours = load_model(quantized)
    ids = torch.randint(0, ours.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))
    report = compare(ours.model, reference_model(reference), ids)
    assert report.logits_cosine >= 0.99999, report.table()
    return report.logits_max_abs_diff


def test_a_block_fp8_deepseek_v3_checkpoint_loads_as_its_dequantized_weights(runtime, tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("deepseek_v3")
    state = load_file(source / "model.safetensors")
    stored, plain = {}, {}
    for name, tensor in state.items():
        if _quantizable(name, tensor):
            q, scale, encoded = _block_fp8(tensor.float(), block=32)  # 96- and 24-wide weights: partial blocks
            stored[name], stored[f"{name}_scale_inv"], plain[name] = q, scale, encoded
        else:
            stored[name] = plain[name] = tensor
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    _copy_with(source, tmp_path / "fp8", stored, fp8)
    _copy_with(source, tmp_path / "reference", plain, None)
    assert _logits_gap(tmp_path / "fp8", tmp_path / "reference") <= 1e-4


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_compressed_tensors_int4_checkpoint_loads_as_its_dequantized_weights(runtime, tiny_checkpoint, tmp_path,
                                                                               symmetric):
    source = tiny_checkpoint("llama")
    state = load_file(source / "model.safetensors")
    stored, plain = {}, {}
    for name, tensor in state.items():
        if _quantizable(name, tensor) and tensor.dim() == 2:
            q, scale, zero = _int_groups(tensor.float(), bits=4, group=16, symmetric=symmetric)
            scale = scale.to(torch.bfloat16)  # as such checkpoints store it
            stored[f"{name}_packed"], stored[f"{name}_scale"] = pack_int32(q, 4), scale
            stored[f"{name}_shape"] = torch.tensor(list(tensor.shape))
            if zero is not None:  # packed along the output rows
                stored[f"{name}_zero_point"] = pack_int32(zero.to(torch.int8).t().contiguous(), 4).t().contiguous()
            spread = lambda t: t.float().repeat_interleave(16, 1)  # noqa: E731
            plain[name] = (q.float() - (spread(zero) if zero is not None else 0)) * spread(scale)
        else:
            stored[name] = plain[name] = tensor
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                            "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric,
                                                        "strategy": "group", "group_size": 16}}}}
    _copy_with(source, tmp_path / "int4", stored, config)
    _copy_with(source, tmp_path / "reference", plain, None)
    assert _logits_gap(tmp_path / "int4", tmp_path / "reference") <= 1e-4


def test_a_channel_int8_checkpoint_loads(runtime, tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("qwen3")
    state = load_file(source / "model.safetensors")
    stored, plain = {}, {}
    for name, tensor in state.items():
        if _quantizable(name, tensor) and tensor.dim() == 2:
            scale = tensor.abs().amax(1, keepdim=True) / 127
            q = torch.round(tensor / scale).clamp(-128, 127).to(torch.int8)
            stored[name], stored[f"{name}_scale"], plain[name] = q, scale, q.float() * scale
        else:
            stored[name] = plain[name] = tensor
    config = {"quant_method": "compressed-tensors", "format": "int-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"],
                                            "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                        "strategy": "channel"}}}}
    _copy_with(source, tmp_path / "int8", stored, config)
    _copy_with(source, tmp_path / "reference", plain, None)
    assert _logits_gap(tmp_path / "int8", tmp_path / "reference") <= 1e-4


def test_unsupported_or_broken_quantized_checkpoints_are_refused_with_the_tensor_named(runtime, tiny_checkpoint,
                                                                                       tmp_path):
    source = tiny_checkpoint("llama")
    state = load_file(source / "model.safetensors")
    name = next(n for n, t in state.items() if _quantizable(n, t))
    q, scale, _ = _block_fp8(state[name].float(), block=32)
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    cases = {
        "awq": ({**state}, {"quant_method": "awq", "bits": 4}, "quant_method='awq' is not supported"),
        "missing": ({**state, name: q}, fp8, f"{name}_scale_inv' is missing"),
        "misshaped": ({**state, name: q, f"{name}_scale_inv": scale[:1]}, fp8, f"{name}_scale_inv' has shape"),
        "w8a8": ({**state}, {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
            "g": {"weights": {"num_bits": 8}, "input_activations": {"num_bits": 8}}}}, "quantizes activations"),
        "nan scale": ({**state, name: q, f"{name}_scale_inv": torch.full_like(scale, float("nan"))}, fp8,
                      f"{name}_scale_inv' holds NaN or infinite scales"),
        # int8 values without their scale, or without the config saying how to read them, must not load as weights
        "no scale": ({**state, name: q.float().to(torch.int8)}, {"quant_method": "compressed-tensors",
                     "format": "int-quantized", "config_groups": {"g": {"weights": {"num_bits": 8}}}},
                     f"{name}' (model.safetensors) is stored as torch.int8, a quantized form"),
        "no config": ({**state, name: q}, None, f"{name}' (model.safetensors) is stored as torch.float8_e4m3fn"),
        "string config": ({**state}, "fp8", "quantization_config is 'fp8'; it must be an object"),
    }
    for label, (tensors, config, words) in cases.items():
        with pytest.raises(UserError, match=re.escape(words)):
            target = tmp_path / label
            _copy_with(source, target, tensors, config)
            load_model(target)
