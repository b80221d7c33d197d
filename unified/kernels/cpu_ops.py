"""C++ CPU kernels (unified/kernels/csrc), compiled on first use for this machine's vector width.

`torch.utils.cpp_extension` builds them once (about 40 s; cached under ~/.cache/torch_extensions, or
TORCH_EXTENSIONS_DIR) and registers them as `torch.ops.unified_cpu.*`. Without a working C++ compiler,
or with UNIFIED_CPU_KERNELS=0, `available()` is False and callers use their plain-PyTorch path; the
reason is logged once.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"]
# The ATen vector width each CPU capability compiles Vectorized<float> for, and the flags it needs.
_CAPABILITY_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}


@functools.cache
def available() -> bool:
    if os.environ.get("UNIFIED_CPU_KERNELS", "1") == "0":
        return False
    try:
        _build()
        return True
    except Exception as error:  # no compiler, no ninja, a failed build: the PyTorch path still works
        lines = str(error).strip().splitlines() or [type(error).__name__]
        reason = next((line for line in lines if "error:" in line), lines[-1])
        log.warning("CPU kernels unavailable (%s); using the plain-PyTorch paths", reason.strip())
        return False


def _build() -> None:
    from torch.utils.cpp_extension import load

    capability = torch.backends.cpu.get_cpu_capability()
    flags = _CAPABILITY_FLAGS.get(capability, ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"])
    load(name=f"unified_cpu_{capability.lower()}", sources=[str(s) for s in SOURCES],
         extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"], is_python_module=False)


def build_and_report() -> None:
    """scripts/setup.sh builds the kernels ahead of the first run."""
    logging.basicConfig(level=logging.INFO)
    print("CPU kernels:", "built" if available() else "unavailable (plain-PyTorch paths in use)")
