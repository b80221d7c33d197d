"""How attention layers learn what kind of forward pass they are in.

Without a context (training, parity checks) attention is causal over each full sequence. An
inference engine sets a context object for the duration of one forward; attention layers then hand
it their projected q, k, v and it decides where K/V live (for example a paged cache) and how to
attend. The model never sees a cache layout, and its forward stays `(input_ids, positions)`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch

from unified.tracing import TracedContextVar


class AttentionContext(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        """q: [B, S, Hq, Dqk], k: [B, S, Hkv, Dqk], v: [B, S, Hkv, Dv] -> [B, S, Hq, Dv]."""
        ...

    # Contexts that cache MLA's compressed latent (an inference KV cache) also define
    # attend_latent(layer, q [B, S, H, R+P], kv [B, S, 1, R+P], v_dim, scale) -> [B, S, H, v_dim]
    # (values are kv[..., :v_dim]; one entry per token, shared by all heads). MLA then attends in latent
    # space; without it MLA expands keys and values per head and calls `attend`.


_current: TracedContextVar[AttentionContext | None] = TracedContextVar("forward_context", default=None)


def get_forward_context() -> AttentionContext | None:
    return _current.get()


@contextlib.contextmanager
def forward_context(ctx: AttentionContext) -> Iterator[AttentionContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`context_fn` for torch.utils.checkpoint: a layer recomputed in backward (after the forward's
    `with forward_context(...)` has exited) attends the way it did in the forward."""
    ctx = get_forward_context()
    return contextlib.nullcontext(), (forward_context(ctx) if ctx is not None else contextlib.nullcontext())
