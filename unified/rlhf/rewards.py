"""The reward contract: `reward(prompts, completions, **task_fields) -> list[float]`, one float per
completion, named in the config by import path (`package.module:function` or `package.module.function`).

Task fields are the data lines' other keys, each passed as a list aligned with `prompts` (TRL's reward
functions take them the same way). What a function returns is checked on every call: the count, and that
each entry is a finite real number; a wrong one stops the run with the function named.
"""
from __future__ import annotations

import importlib
import math
import numbers
import re
from typing import Callable

from unified.errors import UserError

RewardFn = Callable[..., list]
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def load_reward(path: str) -> RewardFn:
    """The function at `path`; a UserError saying what is missing otherwise."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise UserError(f"reward {path!r} is not an import path; write package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"reward {path!r}: cannot import {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"reward {path!r}: {module_name} has no function {attr!r}")
    return fn


def score(fn: RewardFn, prompts: list, completions: list[str], fields: dict[str, list] | None = None) -> list[float]:
    """`fn`'s rewards for the completions, checked: as many as completions, each a finite real number."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        rewards = fn(prompts, completions, **(fields or {}))
    except Exception as err:  # the user's code: name it, not our stack
        raise UserError(f"reward function {name} raised {type(err).__name__}: {err}") from err
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(completions):
        count = len(rewards) if isinstance(rewards, (list, tuple)) else type(rewards).__name__
        raise UserError(f"reward function {name} returned {count} for {len(completions)} completions; it must "
                        f"return a list of one float per completion")
    for i, value in enumerate(rewards):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise UserError(f"reward function {name} returned {value!r} for completion {i}; rewards must be finite "
                            f"numbers")
    return [float(value) for value in rewards]


def extract_answer(completion: str) -> str | None:
    """The text of the last <answer>...</answer> in a completion, stripped, or None."""
    found = _ANSWER.findall(completion)
    return found[-1].strip() if found else None


def format_reward(prompts: list, completions: list[str], **_fields) -> list[float]:
    """1.0 for a completion that gives its answer between <answer> and </answer>, else 0.0."""
    return [1.0 if extract_answer(c) is not None else 0.0 for c in completions]
