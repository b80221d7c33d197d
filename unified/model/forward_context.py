"""How attention layers learn what kind of forward pass they are in.

Without a context (training, parity checks) attention is causal over each full sequence. An
inference engine sets a context object for the duration of one forward; attention layers then hand
it their projected q, k, v and it decides where K/V live (for example a paged cache) and how to
attend. The model never sees a cache layout, and its forward stays `(input_ids, positions)`.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Protocol

import torch


class AttentionContext(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        """q: [B, S, Hq, Dqk], k: [B, S, Hkv, Dqk], v: [B, S, Hkv, Dv] -> [B, S, Hq, Dv]."""
        ...


_current: contextvars.ContextVar[AttentionContext | None] = contextvars.ContextVar("forward_context", default=None)


def get_forward_context() -> AttentionContext | None:
    return _current.get()


@contextlib.contextmanager
def forward_context(ctx: AttentionContext) -> Iterator[AttentionContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
