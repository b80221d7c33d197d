"""Accounting of the collectives our forward issues: time and bytes per kind, per engine step.

Every collective on the model's path goes through `collective(kind, tensor)` (tensor-parallel
all-reduce and vocabulary gather, expert exchange, pipeline send/recv and logits hand-off), so
serving metrics and `bench/comm.py` read one ledger. Recording is off unless a `CommLedger` is active;
on an accelerator the device is synchronised around each timed call, so only turn it on to measure.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class CommLedger:
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def reset(self) -> None:
        self.seconds.clear()
        self.bytes.clear()
        self.calls.clear()


_active: CommLedger | None = None


@contextlib.contextmanager
def recording(ledger: CommLedger):
    global _active
    previous, _active = _active, ledger
    try:
        yield ledger
    finally:
        _active = previous


@contextlib.contextmanager
def collective(kind: str, tensor: torch.Tensor):
    """Wraps one collective call; `tensor` is what this rank sends (its bytes are counted)."""
    ledger = _active
    if ledger is None:
        yield
        return
    sync = torch.accelerator.synchronize if tensor.device.type != "cpu" else (lambda: None)
    sync()
    start = time.perf_counter()
    yield
    sync()
    ledger.seconds[kind] += time.perf_counter() - start
    ledger.bytes[kind] += tensor.numel() * tensor.element_size()
    ledger.calls[kind] += 1
