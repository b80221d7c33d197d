"""Sequence parallelism for training under tensor parallelism (Megatron's scheme, on plain collectives).

Between a row-parallel linear and the next column-parallel one (norms, residual adds) every
tensor-parallel rank would hold the same [B, S, H] activations; here each keeps only its S/tp slice of
the sequence. A column linear all-gathers the sequence before its matmul (backward: reduce-scatter, which
also sums the ranks' partial input gradients); a row linear reduce-scatters instead of all-reducing
(backward: all-gather). The communication volume is that of the all-reduces it replaces; the saving is
activation memory. Weights used inside the split region (the norms, row biases) see only their rank's
tokens, so their gradients are partial and are summed over the group (see `sum_partial_grads`).
megatron-core's own mappings allocate on `torch.cuda.current_device()`, so these work on any device.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from unified.runtime.comm import collective
from unified.tracing import TracedContextVar

_active: TracedContextVar[bool] = TracedContextVar("sequence_parallel", default=False)


def active() -> bool:
    return _active.get()


@contextlib.contextmanager
def region() -> Iterator[None]:
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)


def _slice(x: torch.Tensor, group) -> torch.Tensor:
    part = x.shape[1] // group.size()
    return x[:, group.rank() * part:(group.rank() + 1) * part].contiguous()


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group.size())]
    with collective("tp_all_gather", x):
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    with collective("tp_reduce_scatter", x):
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter of its own
            dist.all_reduce(x, group=group)
            return _slice(x, group)
        out = torch.empty_like(_slice(x, group).transpose(0, 1))  # [S/tp, B, ...]: scatter along dim 0
        dist.reduce_scatter_tensor(out, x.transpose(0, 1).contiguous(), group=group)
        return out.transpose(0, 1).contiguous()


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        grad = _reduce_scatter(grad, ctx.group) if ctx.grad_is_partial else _slice(grad, ctx.group)
        return grad, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None


def scatter(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, ...] replicated -> this rank's [B, S/tp, ...]."""
    return _Scatter.apply(x, group)


def gather(x: torch.Tensor, group, grad_is_partial: bool = True) -> torch.Tensor:
    """[B, S/tp, ...] -> [B, S, ...]. `grad_is_partial`: each rank's gradient of the result holds only its
    own contribution (a column linear's matmul), so backward sums them; otherwise they are already equal."""
    return _Gather.apply(x, group, grad_is_partial)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, ...] partial sums -> this rank's [B, S/tp, ...] of the total."""
    return _ReduceScatter.apply(x, group)


def sum_partial_grads(params, group) -> None:
    """Makes each of `params` (replicated over `group`, but seeing only part of the work on each rank)
    get the sum of its ranks' gradients."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for p in params:
        p.register_hook(hook)
