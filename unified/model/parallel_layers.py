"""megatron-core tensor-parallel layers, adapted to return a plain tensor.

Megatron's linears return `(output, bias)` so that a fused kernel can add the bias later; our blocks
always want the sum. Their forward also routes the matmul through a custom autograd function built
for CUDA-only extras (async all-reduce, fused gradient accumulation) that computes
`matmul(x, W.t())`; on CPU that costs a few percent more than `F.linear` for a 128-token prefill and
1.7-3.5x more per one-token decode call (bench/forward.py prints both). So we keep
megatron's parameters, sharding and autograd communication mappings (copy-to / reduce-from the
tensor-parallel region) and do the matmul with `kernels.linear` (F.linear, or oneDNN for CPU
inference). Parameters are allocated with `use_cpu_initialization`, which creates them on the current
default device (the `torch.device` context), so one code path builds a model on cpu, cuda, musa or
meta. Weights come from a checkpoint, so megatron's random initialisation is skipped unless asked for.

Column and row linears carry an optional `lora` adapter (unified.checkpoint.lora) whose output is added to
theirs. It receives the layer's own input (before the column layer's copy-to-region) and does its own
tensor-parallel mapping, so the base parameters keep their names and the path without one is unchanged.
"""
from __future__ import annotations

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from unified import kernels
from unified.model import sequence_parallel
from unified.runtime import placement
from unified.runtime.comm import collective


def _tp_group():
    return placement.tensor_group()


def megatron_config(dtype: torch.dtype, initialize: bool = False) -> ModelParallelConfig:
    return ModelParallelConfig(
        tensor_model_parallel_size=placement.tensor_group().size(),
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=initialize,
        gradient_accumulation_fusion=False,
    )


def _normal_init(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, std=0.02)


def _mark_split(weight: torch.Tensor, dim: int) -> None:
    """Tags a weight as split across tensor-parallel ranks (megatron does so only when it initialises the
    weight itself); gradient-norm code (DeepSpeed's clipping) then sums its norm over the ranks instead of
    counting it once as a replicated weight."""
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


class PackableLinear:
    """An inference engine may attach a packed copy of the weight (kernels.pack_weight) for its matmuls.
    With a LoRA adapter attached (`lora`), the copy folds it in, and stands for weight and adapter both
    while neither has changed since and the adapter is on."""

    packed: kernels.PackedWeight | None = None
    # Per-input factors that make a quantized copy activation-aware (unified/model/calibration.py; kept across
    # packs, so that copies of updated weights use them too); None: plain
    input_smoothing: torch.Tensor | None = None

    def pack(self, quantization: str | None = None, int4_group: int | None = None) -> None:
        """`quantization` "int8" or "int4": a weight-only quantized copy (kernels.pack_weight), which the matmuls
        then use on any device; activation-aware where `input_smoothing` is set."""
        smoothing = self.input_smoothing if quantization is not None else None
        if self.lora is None or not self.lora.active:
            self.packed = kernels.pack_weight(self.weight, quantization=quantization, int4_group=int4_group,
                                              smoothing=smoothing)
        else:
            with torch.no_grad():
                self.packed = kernels.pack_weight(self.weight, self.lora.delta_weight(), self._adapter_versions(),
                                                  quantization, int4_group, smoothing)

    def serves_quantized(self) -> bool:
        """Whether forward multiplies by a quantized copy of the weight alone (no adapter folded into it)."""
        return self.lora is None and kernels.serves_quantized(self.packed, self.weight)

    def _adapter_versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.lora.parameters())

    def _base_and_adapter(self, x: torch.Tensor) -> tuple[kernels.PackedWeight | None, bool]:
        """(the packed copy for kernels.linear, whether it already holds the adapter's share of x's output)."""
        packed = self.packed
        if packed is None or packed.adapter is None:
            return packed, False
        current = (self.lora is not None and self.lora.active and packed.adapter == self._adapter_versions()
                   and packed.version == self.weight._version and kernels.takes_inference_path(x, self.weight))
        return (packed, True) if current else (None, False)


class ColumnLinear(PackableLinear, ColumnParallelLinear):
    """Output features split across tensor-parallel ranks; output stays split."""

    def __init__(self, in_features: int, out_features: int, config: ModelParallelConfig, bias: bool = False):
        super().__init__(in_features, out_features, config=config, init_method=_normal_init, bias=bias,
                         gather_output=False, tp_group=_tp_group())
        _mark_split(self.weight, dim=0)
        self.lora: torch.nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if sequence_parallel.active():
            inp = sequence_parallel.gather(x, self.tp_group)  # backward: reduce-scatter of the input's grads
        elif self.tp_group.size() > 1:
            inp = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        else:
            inp = x
        packed, folded = self._base_and_adapter(inp)
        y = kernels.linear(inp, self.weight, self.bias, packed)  # backward: inp's grads all-reduced
        return y if self.lora is None or folded else y + self.lora(x)

    def effective_weight(self) -> torch.Tensor:
        """This rank's weight with the adapter folded in, for code that uses the matrix itself (MLA's
        latent-space attention)."""
        return self.weight if self.lora is None else self.weight + self.lora.delta_weight().to(self.weight.dtype)


class RowLinear(PackableLinear, RowParallelLinear):
    """Input features split across tensor-parallel ranks; output all-reduced."""

    def __init__(self, in_features: int, out_features: int, config: ModelParallelConfig, bias: bool = False):
        super().__init__(in_features, out_features, config=config, init_method=_normal_init, bias=bias,
                         input_is_parallel=True, skip_bias_add=False, tp_group=_tp_group())
        _mark_split(self.weight, dim=1)
        self.lora: torch.nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, folded = self._base_and_adapter(x)
        y = kernels.linear(x, self.weight, None, packed)
        if sequence_parallel.active():
            y = sequence_parallel.reduce_scatter(y, self.tp_group)
        elif self.tp_group.size() > 1:
            with collective("tp_all_reduce", y):
                y = reduce_from_tensor_model_parallel_region(y, group=self.tp_group)
        y = y if self.bias is None else y + self.bias
        return y if self.lora is None or folded else y + self.lora(x)


def gather_vocab(x: torch.Tensor) -> torch.Tensor:
    """Concatenates the tensor-parallel ranks' vocabulary slices along the last dimension (inference).

    megatron-core's gather mapping allocates on `torch.cuda.current_device()`; this one works on any device."""
    group = _tp_group()
    if group.size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size())]
    with collective("tp_vocab_gather", x):
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class VocabEmbedding(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, config: ModelParallelConfig):
        super().__init__(vocab_size, hidden_size, init_method=_normal_init, config=config, tp_group=_tp_group())
        _mark_split(self.weight, dim=0)
        self.lora: torch.nn.Module | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """megatron's lookup (each rank embeds the ids in its vocabulary slice, zeros elsewhere, then the
        ranks sum), with the all-reduce on our communication ledger."""
        if self.tp_group.size() == 1:
            return torch.nn.functional.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        out = torch.nn.functional.embedding((ids - self.vocab_start_index).masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        with collective("tp_all_reduce", out):
            return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
