"""Predicted against measured peak memory of this rank.

The start-up probe (unified/plan/probe.py) records what the plan predicts for this rank, and the memory the
process held before loading anything (its baseline); after warm-up the engine, and after its first step the
trainer, log the prediction beside what the process has used at its peak, both as totals and as the rise
above the baseline. On CPU the peak is the process's peak resident memory (VmHWM); on an accelerator, the
caching allocator's peak reservation plus the baseline, which holds the device context.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Expectation:
    peak: int  # bytes the plan predicts this rank holds at its peak, baseline included
    baseline: int  # bytes the process held when the plan was made, before loading


_expected: Expectation | None = None


def expect(peak: int, baseline: int) -> None:
    global _expected
    _expected = Expectation(peak, baseline)


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory now (VmRSS) or at its peak so far (VmHWM), from /proc; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_bytes(device: torch.device) -> int:
    if device.type == "cpu":
        return resident_bytes("VmHWM")
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().max_memory_reserved(device) + (_expected.baseline if _expected else 0)


def log_against_plan(when: str, device: torch.device) -> None:
    """Logs the plan's peak beside the measured one (nothing when no plan was made: probe off)."""
    if _expected is None:
        return
    measured, gib = peak_bytes(device), 2 ** 30
    base = _expected.baseline
    log.info("memory %s: the plan predicted a peak of %.2f GiB (%.2f above the %.2f GiB before loading), the "
             "process reached %.2f GiB (%.2f above it): %.0f%% of the prediction", when, _expected.peak / gib,
             (_expected.peak - base) / gib, base / gib, measured / gib, (measured - base) / gib,
             100 * measured / max(_expected.peak, 1))
