"""Bytes of a rank's weights in a storage format, and of the copies the inference engine adds to them.

Formats (`plan.weights`):
  auto  every tensor in the compute dtype: what the engine holds today, quantized checkpoints included (they
        are dequantized at load, unified/checkpoint/quantized.py)
  fp8   decoder projections in float8 with a float32 `scale_inv` per 128 x 128 block of each matrix (DeepSeek-V3's
        block format, per expert for stacked experts)
  int8  decoder projections in int8 with a float32 scale per output row (compressed-tensors channel-wise int8,
        the engine's kernels.quantize_int8)
  int4  decoder projections packed eight to an int32 with a float32 scale per group of inputs (the largest of
        128, 64, 32 dividing every projection's input width) and an int64 [2] shape (compressed-tensors
        pack-quantized, as recipe=quantize writes it)
The quantized formats leave embeddings, norms, routers, biases, the vision tower and the LM head (unless
`lm_head`) in the compute dtype. They are what a rank holds when the weights stay as stored; our engine
dequantizes them at load today, so only `auto` is what it allocates.

The engine's own copies (unified/engine/llm_engine.py, unified/kernels/linear.py), under `auto` only: with
engine.quantization=int8 an int8 copy (+ a float32 scale per row), with int4 a copy at half a byte per entry
(+ a float32 scale per group of inputs, kernels.int4_group), of every tensor-parallel linear (the LM head
with engine.quantize_lm_head), beside the full-precision weights, which stay; on CPU in float32 with
engine.packed_weights (or quantization) a packed copy of every other tensor-parallel linear and of a tied head
in vocabulary chunks: on AVX2 and AVX-512 hosts in panels of 16 output features (the last panel padded with zeros),
elsewhere in oneDNN's blocked layout, counted at the weight's own size as the engine counts it.
"""
from __future__ import annotations

import math
import os

import torch

from unified.errors import UserError
from unified.checkpoint.quantized import INT4_GROUPS
from unified.kernels.linear import int4_group as int4_copy_group
from unified.plan.inventory import HEAD, PROJECTION, RankTensor

WEIGHT_FORMATS = ("auto", "fp8", "int8", "int4")
FP8_BLOCK = 128
PANEL = 16  # output features per panel of unified_cpu::pack_panels


def packed_rows_multiple() -> int:
    """Output features a CPU packed copy rounds up to: PANEL where the engine packs panels (AVX2 and AVX-512
    builds of the C++ kernels, unified/kernels/linear.py), 1 for oneDNN's layout elsewhere."""
    panels = (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
              and os.environ.get("UNIFIED_CPU_KERNELS", "1") != "0")
    return PANEL if panels else 1


def _matrices(t: RankTensor) -> tuple[int, int, int]:
    """(matrices, rows, columns): a stacked experts tensor [E, rows, cols] is E matrices."""
    *lead, rows, cols = t.shape
    return math.prod(lead), rows, cols


def quantized_tensors(tensors: list[RankTensor], lm_head: bool) -> list[RankTensor]:
    return [t for t in tensors if t.kind == PROJECTION or (lm_head and t.kind == HEAD and t.name == "lm_head.weight")]


def int4_group(tensors: list[RankTensor]) -> int:
    widths = {_matrices(t)[2] for t in tensors}
    group = next((g for g in INT4_GROUPS if all(w % g == 0 for w in widths)), None)
    if group is None:
        raise UserError(f"no int4 group size ({', '.join(map(str, INT4_GROUPS))}) divides every projection's input "
                        f"width on this rank ({sorted(widths)}); plan with plan.weights=int8 or fp8")
    return group


def stored_bytes(t: RankTensor, fmt: str, group: int = INT4_GROUPS[0]) -> tuple[int, int]:
    """(values, scales) bytes of a quantized tensor in `fmt`."""
    count, rows, cols = _matrices(t)
    if fmt == "fp8":
        return t.numel, count * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * 4
    if fmt == "int8":
        return t.numel, count * rows * 4
    assert fmt == "int4"
    return count * rows * math.ceil(cols / 8) * 4, count * (rows * (cols // group) * 4 + 2 * 8)


def weight_bytes(tensors: list[RankTensor], dtype_bytes: int, fmt: str = "auto",
                 lm_head: bool = False) -> dict[str, int]:
    """{"weights": values as held, "weight_scales": the quantized formats' scales} of `tensors`."""
    if fmt not in WEIGHT_FORMATS:
        raise UserError(f"plan.weights={fmt!r} is not a weight format; choose {', '.join(WEIGHT_FORMATS)}")
    quantized = {t.name for t in quantized_tensors(tensors, lm_head)} if fmt != "auto" else set()
    group = int4_group([t for t in tensors if t.name in quantized]) if fmt == "int4" else 0
    values = scales = 0
    for t in tensors:
        if t.name in quantized:
            v, s = stored_bytes(t, fmt, group)
            values, scales = values + v, scales + s
        else:
            values += t.numel * (4 if t.float32 else dtype_bytes)
    return {"weights": values, "weight_scales": scales}


def engine_copy_bytes(tensors: list[RankTensor], cpu_float32: bool, packed_weights: bool, quantization: str | None,
                      quantize_lm_head: bool, tied_head: tuple[int, int] | None = None, head_chunk: int = 0,
                      panel: int = PANEL) -> int:
    """Bytes of the copies the engine packs beside the weights (see the module docstring). `quantization`:
    engine.quantization (None, "int8", "int4"); `tied_head`: this rank's [rows, columns] of a tied embedding used
    as the head (None: none here), packed in chunks of `head_chunk` rows; `panel`: the output features a float32
    copy rounds up to (packed_rows_multiple)."""
    if not (packed_weights or quantization):
        return 0
    head = quantization if quantize_lm_head else None
    total = 0
    for t in tensors:
        if not t.packable:
            continue
        rows, cols = t.shape
        total += _copy_bytes(rows, cols, quantization if t.kind != HEAD else head, cpu_float32, panel)
    if tied_head is not None:
        vocab, cols = tied_head
        chunk = head_chunk or vocab
        for start in range(0, vocab, chunk):
            total += _copy_bytes(min(chunk, vocab - start), cols, head, cpu_float32, panel)
    return total


def _copy_bytes(rows: int, cols: int, quantization: str | None, cpu_float32: bool, panel: int) -> int:
    if quantization == "int8":
        return rows * cols + rows * 4
    if quantization == "int4":
        return rows * cols // 2 + rows * (cols // int4_copy_group(cols)) * 4
    return math.ceil(rows / panel) * panel * cols * 4 if cpu_float32 else 0
