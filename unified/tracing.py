"""Context variables that torch.compile can trace.

Dynamo cannot trace `ContextVar.get`, and the model reads a few per-call flags that way (the forward
context, sequence parallelism, the training path), so a traced forward would break its graph at each. A
`TracedContextVar` keeps a plain mirror of the value its set/reset calls leave, which traced code reads:
the value a trace sees is the one current where the compiled function was called, in that thread.
"""
from __future__ import annotations

import contextvars
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
_is_compiling = torch.compiler.is_compiling  # bound once: read several times per layer of a decode step


class TracedContextVar(Generic[T]):
    def __init__(self, name: str, default: T):
        self._var: contextvars.ContextVar[T] = contextvars.ContextVar(name, default=default)
        self._mirror = default

    def get(self) -> T:
        return self._mirror if _is_compiling() else self._var.get()

    def set(self, value: T) -> contextvars.Token:
        token = self._var.set(value)
        self._mirror = value
        return token

    def reset(self, token: contextvars.Token) -> None:
        self._var.reset(token)
        self._mirror = self._var.get()
