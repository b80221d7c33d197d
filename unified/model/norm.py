import torch
from torch import nn

from unified import kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))  # the model's dtype, as in `transformers`
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)
