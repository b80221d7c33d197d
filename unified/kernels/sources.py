"""Where the custom kernels' sources live, and loading the Triton ones.

The sources sit in the repository's top-level `kernels/` folder (`cpu/` C++, `triton/` Triton), which has
no `__init__.py` on purpose: `import kernels` must keep finding Hugging Face's package of that name, which
`transformers` imports. A checkout or an editable install reads them there; a wheel ships the same folder
as `unified/_kernels`. Triton modules are therefore loaded from their files, not imported by name.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

_PACKAGE = Path(__file__).resolve().parent.parent  # unified/


def sources_root() -> Path:
    packaged = _PACKAGE / "_kernels"
    return packaged if packaged.is_dir() else _PACKAGE.parent / "kernels"


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1: on CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_module(name: str) -> ModuleType:
    """kernels/triton/<name>.py, loaded once per interpreter setting: Triton decides at decoration time whether
    a kernel compiles for a device or runs in its interpreter."""
    return _load(name, interpreting())


@functools.cache
def _load(name: str, interpret: bool) -> ModuleType:
    module_name = f"unified._kernels.triton.{name}" + ("_interpreted" if interpret else "")
    spec = importlib.util.spec_from_file_location(module_name, sources_root() / "triton" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # Triton reads a kernel's source through its module
    spec.loader.exec_module(module)
    return module
