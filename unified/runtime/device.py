"""Device selection through DeepSpeed's accelerator abstraction.

`deepspeed.accelerator` already knows cpu and cuda; MUSA gets our own accelerator, registered with
`set_accelerator` (DeepSpeed has none upstream). torch_musa is imported only when musa is chosen.
Everything downstream asks the accelerator (device names, collective backend, synchronisation)
instead of calling torch.cuda.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

from unified.errors import UserError

DEVICES = ("auto", "cpu", "cuda", "musa")


def detect_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("torch_musa") is not None:
        return "musa"
    return "cpu"


def select_accelerator(name: str = "auto"):
    """Makes `name`'s accelerator DeepSpeed's current one and returns it."""
    if name not in DEVICES:
        raise UserError(f"device={name!r} is not a device we know; choose one of {', '.join(DEVICES)}")
    if name == "auto":
        name = detect_device()
    if name in ("cpu", "cuda") and "deepspeed" not in sys.modules:
        os.environ.setdefault("DS_ACCELERATOR", name)  # DeepSpeed picks one at import; tell it ours
    from deepspeed.accelerator import real_accelerator, set_accelerator

    current = real_accelerator.ds_accelerator  # unset until someone asks; get_accelerator() would guess
    if current is not None and current._name == name:
        return current
    if name == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as accelerator_class
    elif name == "cuda":
        if not torch.cuda.is_available():
            raise UserError("device=cuda was chosen but torch sees no CUDA device (torch "
                            f"{torch.__version__}); install a CUDA build of torch or choose device=cpu")
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as accelerator_class
    else:
        from unified.runtime.musa_accelerator import MUSA_Accelerator as accelerator_class
    accelerator = accelerator_class()
    set_accelerator(accelerator)
    return accelerator


def default_dtype(accelerator, requested: str = "auto") -> torch.dtype:
    """fp32 on CPU (no fast bf16 matmul there); bf16 on accelerators that support it."""
    if requested != "auto":
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if requested not in dtypes:
            raise UserError(f"dtype={requested!r} is not supported; choose auto, {', '.join(dtypes)}")
        return dtypes[requested]
    if accelerator._name == "cpu":
        return torch.float32
    return torch.bfloat16 if accelerator.is_bf16_supported() else torch.float16
