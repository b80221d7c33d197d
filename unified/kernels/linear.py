"""Linear layers, through oneDNN's matmul for CPU inference.

On CPU, in float32 and with no gradient wanted, `linear` calls oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`, the op PyTorch's compiler emits for CPU linears; vLLM's CPU
backend also runs its linears through oneDNN) instead of F.linear's MKL sgemm. On our AMD EPYC (AVX2)
it makes whole engine steps ~10% faster (64-sequence decode, 2048-token prefill chunks and batch-1
decode alike) and the wide LM-head matmul up to 1.8x (both against MKL sgemm with MKL-packed weights),
reading the weight as it is. Results differ from F.linear by rounding only. Training (autograd) and
other dtypes and devices use F.linear.

An inference engine may also hand `linear` a `PackedWeight`: oneDNN's blocked copy of the weight
(`pack_weight`; vLLM's CPU backend prepacks the same way), which makes SmolLM2's 64-row decode
matmuls another 1.14-1.29x faster here, at the cost of a second copy of the weights. A packed copy remembers the weight's version
counter and is ignored once the weight changes in place (`copy_`, `add_`), so it is never stale; the
owner packs again to get the speed back.

With at most SKINNY_MAX_ROWS rows of input (batch-1 decode) the matmul is a stream over the weight, which
oneDNN reads at about 60% of the memory bandwidth here; those go to a C++ kernel
(`unified_cpu::skinny_linear`, csrc) that reads eight weight rows at a time at close to the bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unified.kernels import cpu_ops

_ONEDNN = torch.backends.mkldnn.is_available()
PACK_ROWS = 64  # the row count oneDNN tunes the blocked layout for; any row count works with it
SKINNY_MAX_ROWS = 8  # measured here: 1.2-1.37x over oneDNN for 1-8 rows over SmolLM2's weights


@dataclass(frozen=True)
class PackedWeight:
    tensor: torch.Tensor  # oneDNN's blocked layout of the weight
    version: int  # the weight's `_version` when packed


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """oneDNN's blocked copy of a CPU float32 weight [out, in]; None where `linear` would not use it."""
    if not (_ONEDNN and weight.device.type == "cpu" and weight.dtype == torch.float32) or weight.is_inference():
        return None  # inference-mode tensors keep no version counter to tell a stale copy by
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS), weight._version)


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_ONEDNN and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not torch.is_grad_enabled())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """F.linear: x [..., in] @ weight [out, in].T + bias, through `packed` when it is still the weight's."""
    if uses_onednn(x, weight):
        rows = x.numel() // max(x.shape[-1], 1)
        if 0 < rows <= SKINNY_MAX_ROWS and weight.is_contiguous() and cpu_ops.available():
            out = torch.ops.unified_cpu.skinny_linear(x.reshape(rows, -1).contiguous(), weight, bias)
            return out.view(*x.shape[:-1], weight.shape[0])
        if packed is not None and packed.version == weight._version:
            weight = packed.tensor
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
