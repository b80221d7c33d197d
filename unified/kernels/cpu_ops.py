"""C++ CPU kernels (kernels/cpu in the repository), compiled on first use for this machine's vector width.

`torch.utils.cpp_extension` builds them once (about 20-40 s; cached under ~/.cache/torch_extensions, or
TORCH_EXTENSIONS_DIR) and registers them as `torch.ops.unified_cpu.*`. A build killed midway leaves
its lock file behind, on which every later build would wait forever; one older than
STALE_LOCK_SECONDS is removed. Without a working C++ compiler,
or with UNIFIED_CPU_KERNELS=0, `available()` is False and callers use their plain-PyTorch path; the
reason is logged once.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from pathlib import Path

import torch

from unified.kernels.sources import sources_root
from unified.tracing import TracedContextVar

log = logging.getLogger(__name__)
SOURCES = [sources_root() / "cpu" / name
           for name in ("cpu_kernels.cpp", "attention_avx512.cpp", "argmax_avx512.cpp", "panel_avx512.cpp",
                        "host_allocator.cpp", "quantized_linear.cpp")]
STALE_LOCK_SECONDS = 600
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


_TRAINING_PATH = TracedContextVar("unified_training_path", default=False)


@contextlib.contextmanager
def training_path():
    """Inside, the ops take the path training takes (plain PyTorch) even with autograd off: the trainer's
    no-grad forwards (RLHF's old and reference log-probabilities) must compute what its gradient forward
    does, not what the inference kernels and packed weight copies do."""
    token = _TRAINING_PATH.set(True)
    try:
        yield
    finally:
        _TRAINING_PATH.reset(token)


def inference_path() -> bool:
    """Autograd off and not inside `training_path()`: the fast inference kernels may run."""
    return not torch.is_grad_enabled() and not _TRAINING_PATH.get()


def applies(*tensors: torch.Tensor) -> bool:
    """Whether a C++ kernel may take these tensors: float32 on the CPU, on the inference path (the kernels
    have no backward), and the kernels built. (Asked several times per layer of every decode step, hence
    `is_cpu` in a plain loop rather than a generator over `device.type`, which builds a device object.)"""
    for t in tensors:
        if not (t.is_cpu and t.dtype is torch.float32):
            return False
    return inference_path() and available()


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """t.contiguous() for a C++ kernel, without the call where t already is: each call is one more op in every
    replay of a traced decode step (engine/traced_steps.py)."""
    return t if t.is_contiguous() else t.contiguous()


def _name() -> str:
    return f"unified_cpu_{torch.backends.cpu.get_cpu_capability().lower()}"


def build_directory() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}" / _name()


def _build() -> None:
    from torch.utils.cpp_extension import load

    flags = _CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(),
                                  ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"])
    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
        log.warning("removing %s, left by a CPU-kernel build that did not finish", lock)
        lock.unlink(missing_ok=True)
    log.info("loading the C++ CPU kernels (the first load on a machine compiles them: 20-40 s)")
    load(name=_name(), sources=[str(s) for s in SOURCES], extra_cflags=["-O3", "-fopenmp", *flags],
         extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False)


def cache_host_allocations() -> bool:
    """Installs kernels/cpu/host_allocator.cpp's caching allocator for CPU tensors (blocks of 1 MiB and more are kept
    when freed, up to an eighth of the machine's memory, and handed out again), so that an engine step does not
    page-fault its large activations in afresh every time. False where the kernels are not built."""
    if not available():
        return False
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    torch.ops.unified_cpu.cache_host_allocations(1 << 20, memory // 8)
    return True


def empty_host_cache() -> int:
    """Frees the caching allocator's free blocks (what a device's empty_cache does); the bytes released."""
    return torch.ops.unified_cpu.empty_host_cache() if available() else 0


def build_and_report() -> None:
    """scripts/setup.sh builds the kernels ahead of the first run."""
    logging.basicConfig(level=logging.INFO)
    print("CPU kernels:", "built" if available() else "unavailable (plain-PyTorch paths in use)")
