"""Which implementation runs an op: the C++ CPU kernels, the Triton kernels, or the plain-PyTorch reference.

`auto` (the default) takes, per call, the C++ kernel for float32 CPU tensors where it is built, the Triton
kernel for tensors on an accelerator (CUDA, or MUSA through Triton for MUSA) where Triton is installed, and
the reference everywhere else; the fast paths only run without autograd (they have no backward). The run
config's `kernels.backend` narrows the choice:
  reference  the plain-PyTorch references everywhere (a numerics baseline; slow)
  cpu        the C++ kernels on CPU, the references elsewhere
  triton     the Triton kernels on accelerators, and on CPU tensors too under TRITON_INTERPRET=1 (its
             interpreter: for tests), the references elsewhere
UNIFIED_CPU_KERNELS=0 is separate and older: it stops the C++ kernels from being built at all, so `auto` and
`cpu` then take the references on CPU.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from unified.errors import UserError
from unified.kernels import cpu_ops
from unified.kernels.sources import interpreting

BACKENDS = ("auto", "reference", "triton", "cpu")
ACCELERATORS = ("cuda", "musa")
_backend = "auto"


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise UserError(f"kernels.backend={name!r} is not one of {', '.join(BACKENDS)}")
    if name == "triton" and not triton_installed():
        raise UserError("kernels.backend=triton, but Triton is not installed (pip install triton; on Moore Threads "
                        "GPUs, Triton for MUSA)")
    if name == "triton" and not (interpreting() or _accelerator_present()):
        raise UserError("kernels.backend=triton needs a CUDA or MUSA device; on CPU only under TRITON_INTERPRET=1 "
                        "(Triton's interpreter, for tests: slow)")
    _backend = name


def backend() -> str:
    return _backend


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _accelerator_present() -> bool:
    musa = getattr(torch, "musa", None)
    return torch.cuda.is_available() or (musa is not None and musa.is_available())


def cpu_allowed() -> bool:
    """The backend lets the C++ kernels run (whether they apply is the caller's or `use_cpu`'s question)."""
    return _backend in ("auto", "cpu")


def use_cpu(*tensors: torch.Tensor) -> bool:
    """The C++ kernel takes these tensors (float32 CPU, inference, built, and the backend allows it)."""
    return cpu_allowed() and cpu_ops.applies(*tensors)


def use_triton(*tensors: torch.Tensor) -> bool:
    """The Triton kernel takes these tensors: all on one accelerator, or on CPU under the interpreter when
    the backend is `triton`; inference only."""
    if tensors[0].is_cpu:  # first and cheap: CPU decode steps ask this for every op
        if _backend != "triton" or not interpreting():
            return False
        device = "cpu"
    else:
        device = tensors[0].device.type
        if device not in ACCELERATORS or _backend not in ("auto", "triton"):
            return False
    return (cpu_ops.inference_path() and triton_installed()
            and all(t.device.type == device for t in tensors[1:]))
