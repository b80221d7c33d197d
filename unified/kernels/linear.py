"""Linear layers for CPU inference: packed weight copies, a C++ matmul over them, oneDNN otherwise.

On CPU, in float32 and with no gradient wanted, `linear` avoids F.linear's MKL sgemm:

- An inference engine hands `linear` a `PackedWeight` (`pack_weight`; vLLM's CPU backend prepacks its
  weights too). Where the C++ kernels are built (AVX2 and AVX-512 machines) that is our panel layout (16
  output features per panel, each a contiguous stream), multiplied by `unified_cpu::panel_linear`
  (kernels/cpu), which reads the weight at about the memory bandwidth for the few rows of a decode step,
  where oneDNN reads it at half to two thirds of that, and keeps up with oneDNN for many rows (figures:
  bench/RESULTS.md, `bench/matmul.py`). Elsewhere the copy is oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`). Either costs a second copy of the weights. A packed copy
  remembers the weight's version counter and is ignored once the weight changes in place (`copy_`, `add_`),
  so it is never stale; the owner packs again to get the speed back.
- Without a packed copy, 1-8 rows go to `unified_cpu::skinny_linear`, a stream over the plain weight
  eight rows at a time, and more rows to oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, the op
  PyTorch's compiler emits for CPU linears), ~10% faster than MKL here on whole engine steps.

Results differ from F.linear by rounding only. Training (autograd), `kernels.backend=reference` and other
dtypes and devices use F.linear.

More copies an engine may ask for: weight-only int8 (`quantize_int8`, engine.quantization=int8) and int4
(`quantize_int4`, engine.quantization=int4, or a compressed-tensors int4 checkpoint's own values), which
`linear` uses on any device, streamed by `unified_cpu::int8_linear` / `int4_linear` for decode-sized steps on
CPU; and a tied LM head packed in vocabulary chunks (`pack_head`), whose greedy argmax never writes the whole
logits out.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from unified.kernels import cpu_ops, registry
from unified.kernels.argmax import argmax_merge_, topk_merge_, topk_tokens

_ONEDNN = torch.backends.mkldnn.is_available()
ONEDNN_PACK_ROWS = 64  # the row count oneDNN tunes its blocked layout for; any row count works with it
SKINNY_MAX_ROWS = 8  # measured here: 1.2-1.37x over oneDNN for 1-8 rows over SmolLM2's weights
# Up to this many rows skinny_linear over the plain weight also beats oneDNN's packed copy (bench/matmul.py: at one
# row on every shape, at two on most; from four rows on the packed copy wins)
SKINNY_OVER_PACKED_MAX_ROWS = 2


@dataclass(frozen=True)
class PackedWeight:
    tensor: torch.Tensor  # the packed copy, in `layout`
    version: int  # the weight's `_version` when packed
    # "panels" (unified_cpu::pack_panels), "onednn" (oneDNN's blocked layout), "int8" or "int4" (below)
    layout: str
    # The version counters of the adapter folded into the copy (weight + its LoRA delta), None: the weight alone
    adapter: tuple[int, ...] | None = None
    scale: torch.Tensor | None = None  # "int8", "int4": float32 [out, groups]; see quantize_int8, quantize_int4
    # "int8", "int4" made with `smoothing` s (activation-aware): the copy holds weight * s, column by column, and
    # x is multiplied by this, 1 / s, before it (float32 [in]); None: the weight as it is
    input_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.layout in QUANTIZATIONS

    @functools.cached_property
    def cpu_kernel(self):
        """`unified_cpu::int8_linear` / `int4_linear` for this copy, None where not built (looked up once: the
        lookup costs as much as a small decode matmul)."""
        if not (self.quantized and cpu_ops.available()):
            return None
        return getattr(torch.ops.unified_cpu, f"{self.layout}_linear", None)

    @functools.cached_property
    def input_block(self) -> int:
        """`int16_input_block` of this copy's shape."""
        return int16_input_block(self.tensor.shape[1] * (2 if self.layout == "int4" else 1), self.scale.shape[1])

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.tensor, self.scale, self.input_scale) if t is not None]

    @property
    def nbytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.scale, self.input_scale) if t is not None)
        return self.tensor.numel() * self.tensor.element_size() + extra


def _panels_available() -> bool:
    return cpu_ops.available() and hasattr(torch.ops.unified_cpu, "panel_linear")  # AVX2 and AVX-512 builds


def pack_weight(weight: torch.Tensor, delta: torch.Tensor | None = None, adapter: tuple[int, ...] | None = None,
                quantization: str | None = None, int4_group: int | None = None,
                smoothing: torch.Tensor | None = None) -> PackedWeight | None:
    """A packed copy of a CPU float32 weight [out, in] (plus `delta`, an adapter's update of it, whose
    parameters' version counters are `adapter`); None where `linear` would not use one. `quantization` "int8"
    or "int4": a weight-only quantized copy instead (`quantize`), on any device, activation-aware with
    `smoothing`."""
    if weight.is_inference():
        return None  # inference-mode tensors keep no version counter to tell a stale copy by
    if quantization is not None:
        with torch.no_grad():
            source = weight if delta is None else weight + delta.to(weight.dtype)
            return quantize(source, quantization, int4_group, smoothing, weight._version, adapter)
    if not (weight.device.type == "cpu" and weight.dtype == torch.float32):
        return None
    with torch.no_grad():
        source = weight if delta is None else weight + delta.to(weight.dtype)
        if _panels_available():
            return PackedWeight(torch.ops.unified_cpu.pack_panels(source), weight._version, "panels", adapter)
        if _ONEDNN:
            return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(source, ONEDNN_PACK_ROWS), weight._version,
                                "onednn", adapter)
    return None


def takes_inference_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes the inference path above (packed copies, C++ kernels, oneDNN) for x."""
    return (_ONEDNN and x.is_cpu and x.dtype == weight.dtype == torch.float32
            and cpu_ops.inference_path() and registry.backend() != "reference")


def serves_quantized(packed: PackedWeight | None, weight: torch.Tensor) -> bool:
    """Whether `linear` multiplies by `packed`'s quantized copy (on any device) rather than by `weight`."""
    return (packed is not None and packed.quantized and packed.version == weight._version
            and not torch.compiler.is_compiling() and cpu_ops.inference_path() and registry.backend() != "reference")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """F.linear: x [..., in] @ weight [out, in].T + bias, through `packed` when it is still the weight's."""
    if serves_quantized(packed, weight):
        return quantized_linear(x, packed, bias)  # any device: the weights the engine was asked to serve quantized
    if torch.compiler.is_compiling() or not takes_inference_path(x, weight):
        return F.linear(x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)

    def on_rows(out: torch.Tensor) -> torch.Tensor:  # a C++ kernel's [rows, out] result in x's leading shape
        return out.view(*x.shape[:-1], weight.shape[0])

    if packed is not None and packed.version == weight._version:
        return _packed_linear(x, packed, weight.shape[0], bias, weight)
    if 0 < rows <= SKINNY_MAX_ROWS and weight.is_contiguous() and cpu_ops.available():
        return on_rows(torch.ops.unified_cpu.skinny_linear(_rows(x, rows), weight, bias))
    return _onednn_linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear over a plain or packed weight; through the C++ kernels' wrapper where they are built (the
    call a TorchScript trace can record: engine/traced_steps.py)."""
    if cpu_ops.available():
        return torch.ops.unified_cpu.onednn_linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [..., in] as the contiguous [rows, in] matrix the C++ kernels take."""
    return x.reshape(rows, x.shape[-1]).contiguous()


def _packed_linear(x: torch.Tensor, packed: PackedWeight, out_features: int, bias: torch.Tensor | None = None,
                   weight: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ the packed weight [out_features, in].T (+ bias) -> [..., out_features]. `weight`: the plain
    weight the copy was made from (and nothing more: no adapter folded in), which a row or two of x read
    faster than oneDNN's packed copy."""
    if packed.quantized:
        return quantized_linear(x, packed, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if packed.layout == "onednn":
        if (0 < rows <= SKINNY_OVER_PACKED_MAX_ROWS and weight is not None and packed.adapter is None
                and weight.is_contiguous() and cpu_ops.available()):
            return torch.ops.unified_cpu.skinny_linear(_rows(x, rows), weight, bias).view(*x.shape[:-1], out_features)
        return _onednn_linear(x, packed.tensor, bias)
    out = torch.ops.unified_cpu.panel_linear(_rows(x, rows), packed.tensor, out_features, bias)
    return out.view(*x.shape[:-1], out_features)


@dataclass(frozen=True)
class PackedHead:
    """An LM head's weight [V, H] packed in vocabulary chunks. Greedy decoding then takes each chunk's maximum
    while its logits are still in cache (`head_argmax`) instead of writing the whole [rows, V] logits to
    memory and reading them back (for a 150k vocabulary and 64 rows, 39 MB each way per step)."""

    chunks: tuple[tuple[int, int, PackedWeight], ...]  # (first, end) vocabulary entries and their packed rows
    shape: tuple[int, ...]  # the weight's when packed
    version: int

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for _, _, p in self.chunks for t in p.tensors]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for _, _, p in self.chunks)

    @property
    def quantized(self) -> bool:
        return self.chunks[0][2].quantized

    def rescores(self, weight: torch.Tensor | None, k: int) -> bool:
        """Whether `head_logits` / `head_argmax` rescore k logits per row: a quantized head whose full-precision
        `weight` is at hand (a ZeRO-3 partition's is not)."""
        return k > 0 and self.quantized and weight is not None and tuple(weight.shape) == self.shape

    def serves(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `linear` would take the inference path for x and the chunks are still `weight`: the same
        shape and no change in place since packing. A ZeRO-3 partition (the storage swapped for an empty one
        between a module's forwards) keeps its whole shape in `ds_shape` and its version counter: the copy
        stands for it, and whoever steps the partitions packs again (as for any `PackedWeight`)."""
        if torch.compiler.is_compiling() or not takes_inference_path(x, weight):
            return False
        try:
            version = weight._version
        except RuntimeError:  # a plain inference tensor keeps no version counter
            return False
        return tuple(getattr(weight, "ds_shape", weight.shape)) == self.shape and version == self.version


def _rows_of(weight: torch.Tensor | None, head: PackedHead, start: int, end: int) -> torch.Tensor | None:
    """Rows [start, end) of a head's plain weight, where it holds them (a ZeRO-3 partition does not)."""
    return weight[start:end] if weight is not None and tuple(weight.shape) == head.shape else None


def head_chunk_size(rows: int = 64) -> int:
    """Vocabulary entries per chunk: `rows` rows of a chunk's float32 logits take an eighth of the last-level
    cache (read from the machine; 32 MiB where it does not say)."""
    last_level = 32 * 2 ** 20
    try:
        sizes = [p.read_text().strip() for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
        last_level = max(int(size[:-1]) * 1024 if size.endswith("K") else int(size) for size in sizes)
    except (OSError, ValueError):
        pass
    return max(1024, last_level // 8 // (4 * rows) // 256 * 256)


def pack_head(weight: torch.Tensor, chunk: int | None = None, quantization: str | None = None,
              int4_group: int | None = None, smoothing: torch.Tensor | None = None) -> PackedHead | None:
    """`weight` [V, H] packed in chunks of `chunk` (default `head_chunk_size()`) vocabulary entries (weight-only
    int8 or int4 with `quantization`, and `smoothing`, as `pack_weight`); None where `pack_weight` packs
    nothing."""
    chunk, parts = chunk or head_chunk_size(), []
    for start in range(0, weight.shape[0], chunk):
        packed = pack_weight(weight[start:start + chunk], quantization=quantization, int4_group=int4_group,
                             smoothing=smoothing)
        if packed is None:
            return None
        parts.append((start, min(start + chunk, weight.shape[0]), packed))
    return PackedHead(tuple(parts), tuple(weight.shape), weight._version) if parts else None


def head_logits(x: torch.Tensor, head: PackedHead, weight: torch.Tensor | None = None,
                rescore: int = 0) -> torch.Tensor:
    """x [..., H] -> the logits [..., V] (the caller checked `head.serves`; `weight`: the head's plain weight,
    as `_packed_linear` takes it). `rescore` k > 0 with a quantized head and its plain `weight`: `rescore_top`."""
    logits = torch.cat([_packed_linear(x, packed, end - start, None, _rows_of(weight, head, start, end))
                        for start, end, packed in head.chunks], dim=-1)
    if head.rescores(weight, rescore):
        logits = rescore_top(logits, x, weight, rescore)
    return logits


def head_argmax(x: torch.Tensor, head: PackedHead, weight: torch.Tensor | None = None,
                rescore: int = 0) -> torch.Tensor:
    """x [R, H] -> each row's first maximum over the vocabulary, int64 [R], one chunk of logits at a time (the
    caller checked `head.serves`; `weight` and `rescore` as for `head_logits`, whose first maximum this is)."""
    if head.rescores(weight, rescore):
        return _rescored_argmax(x, head, weight, rescore)
    best = x.new_full(x.shape[:1], float("-inf"))
    index = torch.zeros(x.shape[:1], dtype=torch.long, device=x.device)
    for start, end, packed in head.chunks:
        argmax_merge_(_packed_linear(x, packed, end - start, None, _rows_of(weight, head, start, end)), start, best,
                      index)
    return index


def rescore_top(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, k: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """A quantized head's logits [..., V] for x [..., H], each row's k largest computed again from the head's
    full-precision `weight` [V, H] (and `bias`). A weight-only quantized head moves every logit a little, which is
    enough to swap near-tied tokens; the full-precision weight stays loaded beside the quantized copy, and its k
    rows per row of x are a few KiB. The top choice is then full precision's wherever its token is among the k,
    and those k logits (the ones sampling mostly draws from) are full precision's."""
    rows = logits.reshape(-1, logits.shape[-1])
    top = topk_tokens(rows, min(k, rows.shape[-1]))
    rows.scatter_(-1, top, _exact_logits(x.reshape(-1, x.shape[-1]), top, weight, bias).to(rows.dtype))
    return rows.view(logits.shape)


def _exact_logits(x: torch.Tensor, tokens: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, H], tokens int64 [R, k] -> x[r] . weight[tokens[r, j]] (+ bias), [R, k] in weight's dtype."""
    rows = weight.index_select(0, tokens.reshape(-1)).view(*tokens.shape, weight.shape[-1])
    exact = torch.bmm(rows, x.to(weight.dtype).unsqueeze(-1)).squeeze(-1)
    return exact if bias is None else exact + bias[tokens]


def _head_top(x: torch.Tensor, head: PackedHead, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest logits of `head` and their tokens, [R, k] each, largest first (among equal logits the
    first tokens), one chunk of logits at a time."""
    values = x.new_full((x.shape[0], k), float("-inf"))
    tokens = torch.zeros(values.shape, dtype=torch.long, device=x.device)
    for start, end, packed in head.chunks:
        topk_merge_(_packed_linear(x, packed, end - start, None, None), start, values, tokens)
    return values, tokens


def _rescored_argmax(x: torch.Tensor, head: PackedHead, weight: torch.Tensor, k: int) -> torch.Tensor:
    """The first maximum of each row of `head_logits(x, head, weight, k)`, one chunk at a time: the best of the k
    candidates scored again, unless the best quantized logit left out (the (k+1)-th) is above them all."""
    k = min(k, head.shape[0])
    values, tokens = _head_top(x, head, min(k + 1, head.shape[0]))
    candidates = tokens[:, :k].sort(-1).values  # ties go to the lowest token, as argmax_rows gives them
    best, pick = _exact_logits(x, candidates, weight).max(-1)
    chosen = candidates.gather(-1, pick.unsqueeze(-1)).squeeze(-1)
    if tokens.shape[1] == k:
        return chosen
    left_value, left_token = values[:, k].to(best.dtype), tokens[:, k]
    return torch.where((left_value > best) | ((left_value == best) & (left_token < chosen)), left_token, chosen)


QUANTIZATIONS = ("int8", "int4")  # the weight-only copies `pack_weight` makes
QUANTIZED_KERNEL_MAX_ROWS = 16  # rows unified_cpu::int8_linear / int4_linear take; more dequantize a chunk at a time
DEQUANTIZED_CHUNK_ELEMENTS = 1 << 22  # weight entries dequantized at once otherwise (16 MiB of float32)
INT4_COPY_GROUPS = (128, 64, 32, 16)  # inputs per int4 scale: the largest that divides the weight's input width
INT16_LEAST_EXPONENT = -100  # x blocks under 2^-100 read as zeros in the CPU kernels (kLeastExponent there)


def quantize(weight: torch.Tensor, quantization: str, int4_group: int | None = None,
             smoothing: torch.Tensor | None = None, version: int | None = None,
             adapter: tuple[int, ...] | None = None) -> PackedWeight:
    """A weight-only "int8" or "int4" copy of `weight` [out, in] (`quantize_int8`; `quantize_int4` with `int4_group`
    inputs per scale where that divides the weight's inputs). `smoothing` s [in] (positive; activation-aware
    quantization, unified/model/calibration.py): the copy quantizes weight * s column by column and divides x
    by s before it, which is exact before rounding and moves rounding error off the inputs that carry large
    activations. `version` as for `quantize_int8`."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"weight-only quantization {quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
    version = weight._version if version is None else version
    w = weight.detach()
    if smoothing is not None:
        smoothing = smoothing.detach().float().to(w.device)
        w = w.float() * smoothing
    if quantization == "int8":
        packed = quantize_int8(w, version, adapter)
    else:
        packed = quantize_int4(w, version, adapter, int4_group if int4_group and w.shape[1] % int4_group == 0 else None)
    if smoothing is None:
        return packed
    return dataclasses.replace(packed, input_scale=smoothing.reciprocal().contiguous())


def quantize_int8(weight: torch.Tensor, version: int | None = None, adapter: tuple[int, ...] | None = None,
                  group: int | None = None) -> PackedWeight:
    """Weight-only int8, symmetric: one scale per output feature (vLLM's and compressed-tensors' channel-wise
    int8), or per `group` inputs of it; each span's largest magnitude -> 127. `version`: the version counter of
    the weight this stands for (default: `weight`'s)."""
    w = weight.detach().float()
    rows, cols = w.shape
    grouped = w.view(rows, -1, group or cols)
    scale = (grouped.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [rows, groups]
    q = torch.round(grouped / scale[..., None]).clamp_(-127, 127).to(torch.int8).view(rows, cols)
    return PackedWeight(q.contiguous(), weight._version if version is None else version, "int8", adapter,
                        scale.contiguous())


def int4_group(in_features: int) -> int:
    """Inputs per int4 scale for a weight of `in_features` inputs: the largest of INT4_COPY_GROUPS that divides it,
    else the whole row (one scale per output feature)."""
    return next((g for g in INT4_COPY_GROUPS if in_features % g == 0), in_features)


def quantize_int4(weight: torch.Tensor, version: int | None = None, adapter: tuple[int, ...] | None = None,
                  group: int | None = None) -> PackedWeight:
    """Weight-only int4, symmetric, one scale per `group` inputs of each output feature (default `int4_group`):
    values q in [-8, 7], w = q * scale, stored two to a byte as compressed-tensors' pack-quantized format stores
    them (q + 8, the even input in the low nibble). Each group takes the better of two scales: its largest
    magnitude -> 7, or its most negative value -> -8 when that is the largest magnitude. Weights that came from
    a symmetric int4 checkpoint (either convention: |w|max / 7, or compressed-tensors' / 7.5 with clamping)
    thereby get their stored values and scales back exactly. `version` as for `quantize_int8`."""
    w = weight.detach().float()
    rows, cols = w.shape
    if cols % 2:
        raise ValueError(f"int4 weights pack two inputs to a byte; this weight has {cols} inputs")
    grouped = w.view(rows, -1, group or int4_group(cols))

    def rounded(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(grouped / scale[..., None]).clamp_(-8, 7)
        return q, scale, (q * scale[..., None] - grouped).square().sum(-1)

    lowest = -grouped.amin(-1)
    q7, scale7, error7 = rounded(grouped.abs().amax(-1) / 7)
    q8, scale8, error8 = rounded(lowest / 8)
    eight = (error8 < error7) & (lowest >= grouped.amax(-1))
    q, scale = torch.where(eight[..., None], q8, q7), torch.where(eight, scale8, scale7)
    unsigned = (q.view(rows, cols) + 8).to(torch.uint8)
    packed = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
    return PackedWeight(packed.contiguous(), weight._version if version is None else version, "int4", adapter,
                        scale.contiguous())


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.float32, rows: slice = slice(None),
               smoothed: bool = False) -> torch.Tensor:
    """The weight [N, K] (its `rows`) an int8 or int4 `packed` copy encodes, in `dtype`; with `smoothed`, as
    stored, before its `input_scale` (which x then takes)."""
    q, scale = packed.tensor[rows], packed.scale[rows]
    if packed.layout == "int4":
        q = torch.stack((q & 0x0F, q >> 4), dim=-1).view(q.shape[0], -1).to(torch.int8) - 8
    weight = (q.view(q.shape[0], scale.shape[1], -1).to(dtype) * scale[..., None].to(dtype)).view(q.shape[0], -1)
    return weight if smoothed or packed.input_scale is None else weight * packed.input_scale.to(dtype)


def quantized_linear_reference(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None
                               ) -> torch.Tensor:
    return F.linear(x, dequantize(packed, x.dtype), bias)


def int16_input_block(in_features: int, groups: int) -> int:
    """Inputs per int16 scale of x in `unified_cpu::int8_linear` / `int4_linear` (0: x stays float32). A block's
    integer sums take one weight scale, so with several weight groups the block is the group (a multiple of 32 up
    to 4096, where int32 sums cannot overflow); with one scale per output feature, the largest multiple of 32 up
    to 256 that divides the input width, else 32 (the inputs past the last whole block stay float32). Smaller
    blocks cost a core more time per weight; larger ones let one outlier input coarsen more of its row."""
    if groups > 1:
        group = in_features // groups
        return group if group % 32 == 0 and group <= 4096 else 0
    if in_features < 32:
        return 0
    return next((b for b in range(256, 32, -32) if in_features % b == 0), 32)


def int16_rounded_input(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [rows, in] as the CPU kernels read it with `int16_input_block` = block: each row's whole blocks of
    inputs rounded to a power-of-two step, 2^(e - 15) for a block whose largest magnitude is under 2^e (values
    clamped to +-32767; a block under 2^-100 reads as zeros), the rest as it was. Relative to the block's
    largest magnitude, each input is off by at most 3.1e-5."""
    if block == 0:
        return x
    whole = x.shape[-1] // block * block
    blocks = x[..., :whole].unflatten(-1, (-1, block))
    exponent = torch.frexp(blocks.abs().amax(-1, keepdim=True)).exponent
    one = torch.ones_like(blocks[..., :1])
    step = torch.where(exponent < INT16_LEAST_EXPONENT, 0.0, torch.ldexp(one, exponent - 15))
    inverse = torch.where(step > 0, torch.ldexp(one, 15 - exponent), 0.0)
    rounded = torch.round(blocks * inverse).clamp_(-32767, 32767) * step
    return torch.cat((rounded.flatten(-2), x[..., whole:]), dim=-1)


def quantized_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ the weight an int8 or int4 `packed` copy encodes (+ bias). On CPU in float32, up to
    QUANTIZED_KERNEL_MAX_ROWS rows stream the quantized weight through `unified_cpu::int8_linear` /
    `int4_linear`, which read x rounded to int16 (`int16_rounded_input`: integer multiply-adds convert half as
    many values as float ones, which is what keeps a core at its memory's speed); otherwise the weight is
    dequantized to x's dtype a chunk of output features at a time, so no whole float copy is ever made."""
    q, scale = packed.tensor, packed.scale
    in_features = x.shape[-1]
    rows = x.numel() // max(in_features, 1)
    if (0 < rows <= QUANTIZED_KERNEL_MAX_ROWS and x.dtype == torch.float32 and x.is_cpu
            and packed.cpu_kernel is not None):
        return packed.cpu_kernel(x, q, scale, bias, packed.input_block, packed.input_scale)  # [..., in] -> [..., out]
    if packed.input_scale is not None:
        x = x * packed.input_scale.to(x.dtype)
    step = max(1, DEQUANTIZED_CHUNK_ELEMENTS // max(in_features, 1))
    parts = [F.linear(x, dequantize(packed, x.dtype, slice(i, i + step), smoothed=True),
                      None if bias is None else bias[i:i + step])
             for i in range(0, q.shape[0], step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
