import torch
import torch.nn.functional as F
from torch import nn

from unified import kernels
from unified.model.parallel_layers import ColumnLinear, RowLinear, megatron_config

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up fused into one column-parallel projection [gate | up]."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, dtype: torch.dtype):
        super().__init__()
        mp = megatron_config(dtype)
        self.gate_up_proj = ColumnLinear(hidden_size, 2 * intermediate_size, mp)
        self.down_proj = RowLinear(intermediate_size, hidden_size, mp)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.gated_activation(self.gate_up_proj(x), self.act))
