"""Package exports imported on first use (PEP 562), so light submodules load without torch.

A server binds its port, and the CLI parses its config, before the model's heavy imports happen.
"""
from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """Returns a module `__getattr__` that imports `exports[name]` (a module path) on first access."""
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
