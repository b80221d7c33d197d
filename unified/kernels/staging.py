"""Host values to device tensors without a host sync.

`torch.tensor(values, device=cuda)` copies from pageable memory, which blocks the host until the copy is
done: one sync per small tensor, several per step. Staged in pinned memory, the copy is queued on the stream
like a kernel, and the pinned buffer is held by PyTorch's caching host allocator until that copy has run.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (nested) list of numbers as a tensor on `device`; on an accelerator, copied asynchronously."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def copy_to(target: torch.Tensor, values) -> None:
    """Writes a (nested) list of numbers into the leading corner of `target` (a buffer that stays in place),
    asynchronously."""
    if not values:
        return
    staged = torch.tensor(values, dtype=target.dtype, pin_memory=target.device.type != "cpu")
    target[tuple(slice(0, n) for n in staged.shape)].copy_(staged, non_blocking=True)
