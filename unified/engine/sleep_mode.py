"""Giving an engine's memory back while an RL trainer uses the device, and taking it again (vLLM's sleep mode).

Level 1 frees the KV cache and the packed weight copies, which are rebuilt on waking; level 2 also frees
the weights themselves: the parameters keep their shapes and owners but hold no storage until waking
gives them fresh (zeroed) storage, which a weight update then fills. On the host, the freed pages go
back to the kernel at once (the engine otherwise keeps freed host memory for its next steps).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from unified.errors import UserError
from unified.kernels import cpu_ops
from unified.runtime.host_memory import release_freed_host_memory


class EngineBusy(UserError, RuntimeError):
    """The engine cannot sleep: requests are still in flight."""


@dataclass
class Sleep:
    level: int


@dataclass
class WakeUp:
    pass


def drop_weights(model: torch.nn.Module) -> tuple[dict[str, torch.Size], int]:
    """Frees every parameter's storage; returns their shapes (for `restore_weights`) and the bytes freed."""
    shapes, freed = {}, 0
    for name, p in model.named_parameters():
        shapes[name] = p.shape
        freed += p.numel() * p.element_size()
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return shapes, freed


def restore_weights(model: torch.nn.Module, shapes: dict[str, torch.Size]) -> None:
    """Gives every parameter its storage back, filled with NaN until an update writes it (`weights_missing`)."""
    for name, p in model.named_parameters():
        p.data = torch.full(shapes[name], float("nan"), dtype=p.dtype, device=p.device)


def weights_missing(model: torch.nn.Module) -> bool:
    """Whether a parameter restored by `restore_weights` still holds values no update has written."""
    return any(p.is_floating_point() and bool(torch.isnan(p).any()) for p in model.parameters())


def give_memory_back(device: torch.device, accelerator) -> None:
    if device.type == "cpu":
        cpu_ops.empty_host_cache()
        release_freed_host_memory()
    elif accelerator is not None:
        accelerator.empty_cache()
