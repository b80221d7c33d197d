"""Whole parameters for what reads them outside DeepSpeed's ZeRO-3 hooks.

Under ZeRO-3 each trainer rank keeps only its partition of every parameter and DeepSpeed gathers a
module's parameters around that module's forward when the forward runs through its engine. The rollout
engine, its packed weight copies, the tied LM head and the learner's own no-grad forwards (reference and
old log-probabilities, PPO's values) read the parameters otherwise, so for their duration the whole
parameters are gathered (every partition, on every trainer rank) and dropped again after. What that
costs, bytes and seconds, is reported with each step (`zero3/gathered_bytes`, `zero3/gather_s`).
"""
from __future__ import annotations

import contextlib
import time

from torch import nn


class WholeWeights:
    """`with whole():` has `module`'s whole parameters for its body when `partitioned` (ZeRO-3); else nothing."""

    def __init__(self, module: nn.Module, partitioned: bool):
        self.module, self.partitioned = module, partitioned
        self.bytes, self.seconds = 0, 0.0

    @contextlib.contextmanager
    def __call__(self):
        if not self.partitioned:
            yield
            return
        import deepspeed

        params = list(self.module.parameters())
        started = time.perf_counter()
        with deepspeed.zero.GatheredParameters(params):
            self.seconds += time.perf_counter() - started
            self.bytes += sum(p.numel() * p.element_size() for p in params)
            yield

    def take_stats(self) -> dict[str, float]:
        """Bytes gathered and seconds spent gathering since the last call (nothing without ZeRO-3)."""
        if not self.partitioned:
            return {}
        stats = {"zero3/gathered_bytes": float(self.bytes), "zero3/gather_s": self.seconds}
        self.bytes, self.seconds = 0, 0.0
        return stats
