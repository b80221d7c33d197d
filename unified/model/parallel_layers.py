"""megatron-core tensor-parallel layers, adapted to return a plain tensor.

Megatron's linears return `(output, bias)` so that a fused kernel can add the bias later; our blocks
always want the sum, so these thin subclasses return it. Parameters are allocated with
`use_cpu_initialization`, which creates them on the current default device (the `torch.device`
context), so one code path builds a model on cpu, cuda, musa or meta. Weights come from a checkpoint,
so megatron's random initialisation is skipped unless asked for.
"""
from __future__ import annotations

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def megatron_config(dtype: torch.dtype, initialize: bool = False) -> ModelParallelConfig:
    from megatron.core import parallel_state

    return ModelParallelConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=initialize,
        gradient_accumulation_fusion=False,
    )


def _normal_init(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, std=0.02)


class ColumnLinear(ColumnParallelLinear):
    """Output features split across tensor-parallel ranks; output stays split."""

    def __init__(self, in_features: int, out_features: int, config: ModelParallelConfig, bias: bool = False):
        super().__init__(in_features, out_features, config=config, init_method=_normal_init, bias=bias,
                         gather_output=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]


class RowLinear(RowParallelLinear):
    """Input features split across tensor-parallel ranks; output all-reduced."""

    def __init__(self, in_features: int, out_features: int, config: ModelParallelConfig, bias: bool = False):
        super().__init__(in_features, out_features, config=config, init_method=_normal_init, bias=bias,
                         input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]


class VocabEmbedding(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, config: ModelParallelConfig):
        super().__init__(vocab_size, hidden_size, init_method=_normal_init, config=config)
