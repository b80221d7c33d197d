"""Gated activation: act(gate) * up for x = [gate | up] along the last dimension (the gated MLP's middle).

CPU float32 inference with silu (Llama, Qwen, Mistral, DeepSeek) goes through one C++ pass
(`unified_cpu::silu_and_mul`, kernels/cpu) instead of three ops and two temporaries, accelerators through
the Triton kernel (kernels/triton/activation.py); anything else, and anything autograd must see, uses the
plain-PyTorch reference.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from unified.kernels import cpu_ops, registry
from unified.kernels.sources import triton_module


def gated_activation_reference(x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return act(gate) * up


def gated_activation(x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    if act is F.silu and torch.compiler.is_compiling() and cpu_ops.inference_path():  # one opaque op (ops.py)
        return torch.ops.unified.silu_and_mul(x)
    if act is F.silu and registry.use_cpu(x):
        return torch.ops.unified_cpu.silu_and_mul(cpu_ops.contiguous(x))
    if act is F.silu and registry.use_triton(x):
        return triton_module("activation").silu_and_mul(x)
    return gated_activation_reference(x, act)
