"""Quantized checkpoints read as the float weights they stand for.

A checkpoint whose config.json has a `quantization_config` stores some weights in a low-precision form with
scales beside them. `dequantizing(ckpt, hf_config)` wraps the checkpoint so that each such weight reads, under
its plain name (`...q_proj.weight`), as the float32 tensor it encodes; the loader then copies it into the
model's dtype like any other weight. Supported:

- `quant_method: fp8` as DeepSeek-V3 and Kimi-K2 ship it: float8 e4m3 weights with float32
  `weight_scale_inv` per `weight_block_size` block (128 x 128; one per tensor without a block size);
  w = q * scale_inv, block by block, partial edge blocks included.
- `quant_method: compressed-tensors`, weight-only schemes:
  `pack-quantized` (int4 / int2 / int8 values packed eight / sixteen / four to an int32 along the input
  dimension, offset by 2^(bits-1), in `weight_packed`, with `weight_scale` per group or output channel,
  `weight_shape`, and `weight_zero_point` when asymmetric: w = (q - zero) * scale), as Kimi-K2's INT4
  release ships it; `int-quantized` / `naive-quantized` (int8 `weight` and `weight_scale`) and
  `float-quantized` (float8 `weight` and `weight_scale`) per channel or tensor.

Anything else (another method, activation quantization, a missing or mis-shaped scale) is refused with
the tensor or setting named, before a weight is copied.
"""
from __future__ import annotations

import math

import torch

from unified.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint
from unified.kernels.linear import quantize_int4, quantize_int8

FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}
PACKED = "pack-quantized"
# What a quantized weight `X.weight` stores beside its values (`X.weight`, or `X.weight_packed`)
_EXTRAS = (".weight_scale", ".weight_scale_inv", ".weight_shape", ".weight_zero_point")
UNPACKED = ("int-quantized", "naive-quantized", "float-quantized")


def quantization_config(hf) -> dict | None:
    config = getattr(hf, "quantization_config", None)
    if config is None:
        return None
    return config if isinstance(config, dict) else config.to_dict()


def dequantizing(ckpt: SafetensorsCheckpoint, hf) -> SafetensorsCheckpoint:
    """`ckpt` itself for a full-precision checkpoint, else a view of it that reads quantized weights as floats."""
    config = quantization_config(hf)
    if config is None:
        return ckpt
    method = config.get("quant_method")
    if method == "fp8":
        return BlockFP8Checkpoint(ckpt, config)
    if method == "compressed-tensors":
        return CompressedTensorsCheckpoint(ckpt, config)
    raise CheckpointError(f"{ckpt.directory / 'config.json'}: quantization_config.quant_method={method!r} is not "
                          f"supported; we load fp8 (block-scaled, DeepSeek-V3's format) and compressed-tensors "
                          f"weight-only checkpoints, or full-precision ones")


def stored_int4_group(hf) -> int | None:
    """Inputs per scale of a symmetric group-wise int4 compressed-tensors checkpoint (None for any other), which
    the engine's int4 copies keep so that they hold the checkpoint's own values (kernels.quantize_int4)."""
    config = quantization_config(hf)
    if config is None or config.get("quant_method") != "compressed-tensors":
        return None
    for group in (config.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if (weights.get("num_bits") == 4 and weights.get("symmetric", True) and weights.get("strategy") == "group"
                and weights.get("group_size")):
            return int(weights["group_size"])
    return None


class _Dequantized:
    """A lazy slice handle over a dequantized tensor (what `SafetensorsCheckpoint.get_slice` returns)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __getitem__(self, index):
        return self.tensor[index]

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)


class _QuantizedView:
    """Forwards to the checkpoint; subclasses say which names are stored quantized and how to read them."""

    def __init__(self, ckpt: SafetensorsCheckpoint, config: dict):
        self.ckpt, self.config, self.directory = ckpt, config, ckpt.directory

    def _quantized(self, name: str) -> bool:
        raise NotImplementedError

    def _dequantize(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def release_mappings(self) -> None:
        self.ckpt.release_mappings()

    def has(self, name: str) -> bool:
        return self.ckpt.has(name) or self._quantized(name)

    def names(self) -> list[str]:
        """The tensors by the names they read under: a quantized weight's stored parts (values, scales, shape, zero
        points) as the one weight they encode."""
        return sorted({name.removesuffix("_packed") for name in self.ckpt.location
                       if not name.endswith(_EXTRAS)})

    def file_of(self, name: str):
        return self.ckpt.file_of(self._stored_name(name))

    def _stored_name(self, name: str) -> str:
        return name

    def get(self, name: str) -> torch.Tensor:
        return self._dequantize(name) if self._quantized(name) else self.ckpt.get(name)

    def get_slice(self, name: str):
        return _Dequantized(self._dequantize(name)) if self._quantized(name) else self.ckpt.get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._logical_shape(name) if self._quantized(name) else self.ckpt.shape(name)

    def _logical_shape(self, name: str) -> tuple[int, ...]:
        return self.ckpt.shape(name)

    def _scale(self, name: str, expected: tuple[int, ...], what: str) -> torch.Tensor:
        if not self.ckpt.has(name):
            raise CheckpointError(f"{self.directory}: the quantized weight's scale {name!r} is missing ({what}); "
                                  f"the checkpoint is incomplete: re-download or re-export it")
        scale = self.ckpt.get(name)
        if tuple(scale.shape) != expected and not (scale.numel() == 1 and math.prod(expected) == 1):
            raise CheckpointError(f"{self.directory}: {name!r} has shape {tuple(scale.shape)}, but {what} needs "
                                  f"{expected}; the checkpoint and its quantization_config disagree")
        if not torch.isfinite(scale).all():
            raise CheckpointError(f"{self.directory}: {name!r} holds NaN or infinite scales; the checkpoint is "
                                  f"corrupt: re-download or re-export it")
        return scale.float().reshape(expected)


class BlockFP8Checkpoint(_QuantizedView):
    def __init__(self, ckpt: SafetensorsCheckpoint, config: dict):
        super().__init__(ckpt, config)
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"{ckpt.directory}: quantization_config.fmt={fmt!r}; only e4m3 FP8 weights load")
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise CheckpointError(f"{ckpt.directory}: quantization_config.weight_block_size={block} is not "
                                  f"[rows, columns]")
        self.block = tuple(block) if block is not None else None

    def _quantized(self, name: str) -> bool:  # `X.weight`, or a fused experts tensor, stored in float8
        return self.ckpt.has(name) and self.ckpt.get_slice(name).get_dtype() in FP8_DTYPES

    def _dequantize(self, name: str) -> torch.Tensor:
        weight = self.ckpt.get(name).float()
        *lead, rows, cols = weight.shape
        if self.block is None:
            return weight * self._scale(f"{name}_scale_inv", (1,), "one scale per tensor")
        br, bc = self.block
        grid = (*lead, -(-rows // br), -(-cols // bc))
        scale = self._scale(f"{name}_scale_inv", grid, f"one scale per {br}x{bc} block of {tuple(weight.shape)}")
        scale = scale.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]
        return weight * scale


class CompressedTensorsCheckpoint(_QuantizedView):
    def __init__(self, ckpt: SafetensorsCheckpoint, config: dict):
        super().__init__(ckpt, config)
        groups = config.get("config_groups") or {}
        if not groups:
            raise CheckpointError(f"{ckpt.directory}: a compressed-tensors quantization_config without config_groups")
        self.schemes = []
        for label, group in groups.items():
            weights, fmt = group.get("weights"), group.get("format") or config.get("format")
            where = f"{ckpt.directory}: quantization_config.config_groups.{label}"
            if group.get("input_activations") or group.get("output_activations"):
                raise CheckpointError(f"{where} quantizes activations; only weight-only schemes (W4A16, W8A16) load")
            if not weights:
                raise CheckpointError(f"{where} has no weights scheme")
            if fmt not in (PACKED, *UNPACKED):
                raise CheckpointError(f"{where}: format {fmt!r} is not supported; pack-quantized, int-quantized, "
                                      f"naive-quantized and float-quantized are")
            strategy, bits = weights.get("strategy", "tensor"), weights.get("num_bits", 8)
            if strategy not in ("group", "channel", "tensor"):
                raise CheckpointError(f"{where}: weight strategy {strategy!r} is not supported (group, channel, tensor)")
            if fmt == PACKED and (weights.get("type", "int") != "int" or bits not in (2, 4, 8)):
                raise CheckpointError(f"{where}: pack-quantized {weights.get('type')} weights of {bits} bits are "
                                      f"not supported; int weights of 2, 4 or 8 bits are")
            self.schemes.append((fmt, weights))
        formats = {fmt == PACKED for fmt, _ in self.schemes}
        if len(formats) > 1:
            raise CheckpointError(f"{ckpt.directory}: packed and unpacked config_groups in one checkpoint")
        self.format, self.weights = self.schemes[0]

    def _stored_name(self, name: str) -> str:
        return f"{name}_packed" if self.format == PACKED and self._quantized(name) else name

    def _logical_shape(self, name: str) -> tuple[int, ...]:
        if self.format == PACKED:
            return tuple(int(n) for n in self._stored(f"{name}_shape").tolist())
        return self.ckpt.shape(name)

    def _quantized(self, name: str) -> bool:
        if not name.endswith(".weight"):
            return False
        if self.format == PACKED:
            return self.ckpt.has(f"{name}_packed")
        return self.ckpt.has(name) and self.ckpt.has(f"{name}_scale")

    def _dequantize(self, name: str) -> torch.Tensor:
        weights = self.weights
        if self.format == PACKED:
            shape = self._logical_shape(name)
            values = _unpack_int32(self.ckpt.get(f"{name}_packed"), weights["num_bits"], shape, name)
        else:
            values = self.ckpt.get(name)
            shape = tuple(values.shape)
        if len(shape) != 2:
            raise CheckpointError(f"{self.directory}: {name!r} has shape {shape}; quantized weights load as 2-D "
                                  f"[out, in] matrices")
        rows, cols = shape
        strategy = weights.get("strategy", "tensor")
        if strategy == "group":
            size = weights.get("group_size")
            if not size:
                raise CheckpointError(f"{self.directory}: a group strategy without group_size")
            grid, what = (rows, -(-cols // size)), f"one scale per {size} inputs of each output row"
        elif strategy == "channel":
            grid, what = (rows, 1), "one scale per output row"
        else:
            grid, what = (1, 1), "one scale per tensor"
        span = weights["group_size"] if strategy == "group" else cols  # the inputs one scale covers

        def spread(per_group: torch.Tensor) -> torch.Tensor:  # [rows, groups] -> [rows, cols]
            return per_group.float().repeat_interleave(span, dim=1)[:, :cols]

        values = values.float()
        if not weights.get("symmetric", True):
            values = values - spread(self._zero_point(name, grid, what))
        return values * spread(self._scale(f"{name}_scale", grid, what))

    def _stored(self, name: str) -> torch.Tensor:
        if not self.ckpt.has(name):
            raise CheckpointError(f"{self.directory}: {name!r} is missing; the checkpoint is incomplete: "
                                  f"re-download or re-export it")
        return self.ckpt.get(name)

    def _zero_point(self, name: str, grid: tuple[int, int], what: str) -> torch.Tensor:
        zero = self._stored(f"{name}_zero_point")
        if self.format == PACKED:  # packed along the output dimension
            zero = _unpack_int32(zero.t().contiguous(), self.weights["num_bits"], (grid[1], grid[0]),
                                 f"{name}_zero_point").t()
        if tuple(zero.shape) != grid:
            raise CheckpointError(f"{self.directory}: {name}_zero_point has shape {tuple(zero.shape)}, but {what} "
                                  f"needs {grid}")
        return zero


def _unpack_int32(packed: torch.Tensor, bits: int, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """compressed-tensors' packing: 32 / bits values per int32 along the last dimension, lowest bits first, each
    offset by 2^(bits - 1) -> the signed values [rows, cols] as int8."""
    per = 32 // bits
    rows, cols = shape
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != rows or packed.shape[1] * per < cols:
        raise CheckpointError(f"{name!r} is {packed.dtype} {tuple(packed.shape)}, which cannot hold {bits}-bit values "
                              f"of shape {shape} packed {per} to an int32")
    shifts = torch.arange(per, dtype=torch.int32) * bits
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return (values.reshape(rows, -1)[:, :cols] - (1 << (bits - 1))).to(torch.int8)


# Writing them (`unified recipe=quantize`) -------------------------------------------------------------------

FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size
MIXTRAL_EXPERTS = (".w1.weight", ".w2.weight", ".w3.weight")  # Mixtral's experts' projections
INT4_GROUPS = (128, 64, 32)  # inputs per scale an int4 checkpoint is written with: the largest dividing every width


def quantizes(name: str, shape: tuple[int, ...], method: str, lm_head: bool) -> bool:
    """Whether `recipe=quantize` stores this HF tensor quantized: the text layers' projection weights (Mixtral's
    experts' w1 / w2 / w3 among them; fused 3-D experts only in FP8, whose blocks cover them; compressed-tensors
    stores one matrix per module), and
    the LM head when asked. Embeddings, norms, routers and vision towers stay as they are."""
    if name == "lm_head.weight":
        return lm_head
    if ".layers." not in name or "visual" in name or "vision" in name:
        return False
    if len(shape) == 2 and (name.endswith("_proj.weight") or (".experts." in name and name.endswith(MIXTRAL_EXPERTS))):
        return True
    return method == "fp8" and len(shape) == 3 and name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def int4_group(in_sizes: list[int]) -> int:
    group = next((g for g in INT4_GROUPS if all(n % g == 0 for n in in_sizes)), None)
    if group is None:
        raise CheckpointError(f"no int4 group size ({', '.join(map(str, INT4_GROUPS))}) divides every input size "
                              f"({sorted(set(in_sizes))}); quantize to int8 or fp8 instead")
    return group


def quantize_tensor(name: str, tensor: torch.Tensor, method: str, group: int = INT4_GROUPS[0]
                    ) -> dict[str, torch.Tensor]:
    """The tensors a quantized checkpoint stores for weight `name` (see the module docstring for the formats);
    `group`: int4's inputs per scale."""
    w = tensor.float()
    if method == "int8":  # compressed-tensors int-quantized: the engine's own int8, one scale per output channel
        packed = quantize_int8(w)
        return {name: packed.tensor, f"{name}_scale": packed.scale}
    if method == "int4":  # compressed-tensors pack-quantized, symmetric, group scales: the engine's own int4,
        packed = quantize_int4(w, group=group)  # whose bytes are that format's int32 words (group >= 16)
        return {f"{name}_packed": packed.tensor.view(torch.int32), f"{name}_scale": packed.scale,
                f"{name}_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if method == "fp8":  # DeepSeek-V3's block format
        *lead, rows, cols = w.shape
        grid_r, grid_c = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
        padded = torch.zeros(*lead, grid_r * FP8_BLOCK, grid_c * FP8_BLOCK)
        padded[..., :rows, :cols] = w
        blocks = padded.unflatten(-1, (grid_c, FP8_BLOCK)).unflatten(-3, (grid_r, FP8_BLOCK))  # [.., R, b, C, b]
        scale = (blocks.abs().amax(dim=(-3, -1)) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
        q = (blocks / scale[..., :, None, :, None]).to(torch.float8_e4m3fn)
        q = q.flatten(-2).flatten(-3, -2)[..., :rows, :cols].contiguous()
        return {name: q, f"{name}_scale_inv": scale.contiguous()}
    raise CheckpointError(f"cannot write {method!r} weights; use int8, int4 or fp8")


def quantization_config_for(method: str, lm_head: bool, group: int = INT4_GROUPS[0]) -> dict:
    """config.json's `quantization_config` for checkpoints `quantize_tensor` wrote."""
    if method == "fp8":
        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        return config if lm_head else {**config, "modules_to_not_convert": ["lm_head"]}
    weights = ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"} if method == "int8" else
               {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group})
    fmt = "int-quantized" if method == "int8" else PACKED
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": [] if lm_head else ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": fmt}}}


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed values [rows, cols] -> compressed-tensors' packing (the inverse of `_unpack_int32`)."""
    per = 32 // bits
    rows, cols = values.shape
    unsigned = values.to(torch.int64) + (1 << (bits - 1))
    unsigned = torch.nn.functional.pad(unsigned, (0, -cols % per)).view(rows, -1, per)
    words = (unsigned << (torch.arange(per) * bits)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
