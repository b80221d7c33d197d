"""Resumable training checkpoints (DeepSpeed's format) that a crash during a save cannot break, and that
cannot run code when resumed.

Each save writes a new tag folder `step-NNNNNNN` (model, optimizer and scheduler through DeepSpeed; the
step, which is also the data position, in its client state; every rank's RNG states in a file of its
own), and only when all ranks have finished writing does rank 0 point `latest` at it, by an atomic
rename. A crash mid-save leaves `latest` on the previous complete tag. Older tags beyond
`keep_checkpoints` are removed after `latest` moves.

A checkpoint folder may come from someone else, and unpickling runs whatever a pickle names. The RNG
file holds plain data (tensors, numbers, lists) and is read with `weights_only=True`. DeepSpeed reads its
own files with full unpickling, so before it does, every `.pt` in the tag must pass the weights-only
unpickler with nothing allowed beyond the few plain classes DeepSpeed stores there.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch

from unified.errors import UserError

LATEST = "latest"
RNG_FILES = "rng_rank*.pt"


def _tag(step: int) -> str:
    return f"step-{step:07d}"


def _deepspeed_classes() -> tuple:
    """What DeepSpeed pickles into its checkpoint files besides tensors and containers, found by saving with
    ZeRO 0-3, bf16 and offload: the loss scaler (DynamicLossScaler under fp16, which the CPU cannot run), the
    ZeRO stage and the optimizer's parameter-fragment addresses. Plain records: building one runs nothing."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address


# RNG files written before the RNG state was stored as plain data hold numpy's MT19937 key array.
_reconstruct = np.ndarray(0).__reduce__()[0]
_NUMPY_ARRAYS = ((_reconstruct, "numpy.core.multiarray._reconstruct"),  # as numpy 1.x names it
                 (_reconstruct, "numpy._core.multiarray._reconstruct"),  # and numpy 2
                 np.ndarray, np.dtype, type(np.dtype(np.uint32)))


def _start_over(folder: Path) -> str:
    return (f"resume only from checkpoints you trust: move {folder.parent} away to start from scratch, or write "
            f"the name of an earlier step-* folder into {folder.parent / LATEST}")


def _reason(err: Exception) -> str:
    """The first sentence of torch's own explanation (the rest advises switching the weights-only check off)."""
    text = str(err).split("WeightsUnpickler error:")[-1].strip()
    return text.splitlines()[0].split(". ")[0] if text else type(err).__name__


@contextlib.contextmanager
def _allowing_only(allowed: tuple):
    """The weights-only unpickler's own list plus exactly `allowed`, without what libraries add to it for the
    whole process on import (megatron-core adds paths, namespaces and its configs)."""
    inherited = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(list(allowed))
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(inherited)


def load_plain(path: Path, allowed: tuple = (), mmap: bool = False):
    """`torch.load` of a file in a tag folder that builds only tensors, plain containers and the `allowed`
    classes: a pickle naming anything else is refused, naming the file and the global, before any of it runs.
    `mmap` maps tensor data instead of reading it, for a check of the pickle alone."""
    try:
        with _allowing_only(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except pickle.UnpicklingError as err:
        try:
            with _allowing_only(allowed):
                unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except (RuntimeError, ValueError):  # not a zip archive: the unpickler's reason says what it found
            unsafe = []
        what = ", ".join(unsafe) if unsafe else _reason(err)
        raise UserError(f"{path} is not plain checkpoint data ({what}): loading it could run arbitrary code, so "
                        f"it was refused; {_start_over(path.parent)}") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise UserError(f"{path} is not a readable checkpoint file ({_reason(err)}); it may be truncated or "
                        f"corrupt: {_start_over(path.parent)}") from None


def _check_deepspeed_files(folder: Path) -> None:
    """Every `.pt` file of the tag but the RNG files (DeepSpeed reads nothing else when loading it) must be
    plain data."""
    allowed = _deepspeed_classes()
    rng = set(folder.glob(RNG_FILES))
    for path in sorted(folder.glob("*.pt")):
        if path.is_file() and path not in rng:
            load_plain(path, allowed, mmap=True)


def _rng_state(accelerator) -> dict:
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {"torch": torch.get_rng_state(), "accelerator": accelerator.get_rng_state(),
            "python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, cached_gaussian)}


def _set_rng_state(state: dict, path: Path, accelerator) -> None:
    try:
        torch.set_rng_state(state["torch"])
        accelerator.set_rng_state(state["accelerator"])
        random.setstate(tuple(state["python"]))
        np.random.set_state(tuple(state["numpy"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise UserError(f"{path} does not hold the RNG states this trainer saves ({err!r}); "
                        f"{_start_over(path.parent)}") from None


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_tag(directory: Path) -> str | None:
    pointer = directory / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not (directory / tag).is_dir():
        raise UserError(f"{pointer} names checkpoint {tag!r}, which is missing; remove {pointer} to start over "
                        f"or restore that folder")
    return tag


def save(engine, directory: Path, step: int, accelerator, keep: int, partial: bool, group=None) -> None:
    """`partial`: some weights are frozen (LoRA, train.trainable); only the trained ones are saved. `group`:
    the ranks that train (None: all of them)."""
    rank = torch.distributed.get_rank()
    tag = _tag(step)
    engine.save_checkpoint(str(directory), tag=tag, client_state={"step": step}, save_latest=False,
                           exclude_frozen_parameters=partial)
    torch.save(_rng_state(accelerator), directory / tag / f"rng_rank{rank:05d}.pt")
    torch.distributed.barrier(group=group)
    if torch.distributed.get_rank(group) == 0:
        _write_atomically(directory / LATEST, tag)
        tags = sorted(p for p in directory.glob("step-*") if p.is_dir())
        for old in tags[:-max(keep, 1)]:
            shutil.rmtree(old, ignore_errors=True)
    torch.distributed.barrier(group=group)


def resume(engine, directory: Path, accelerator, partial: bool) -> int:
    """Loads the newest complete checkpoint into `engine`; returns the step to continue from (0: none)."""
    tag = latest_tag(directory) if directory.is_dir() else None
    if tag is None:
        return 0
    folder = directory / tag
    rng = folder / f"rng_rank{torch.distributed.get_rank():05d}.pt"
    rng_state = load_plain(rng, _NUMPY_ARRAYS) if rng.is_file() else None
    _check_deepspeed_files(folder)
    path, client = engine.load_checkpoint(str(directory), tag=tag, load_module_strict=not partial)
    if path is None:
        raise UserError(f"DeepSpeed could not load checkpoint {folder}; it may come from another "
                        f"model or parallel layout. Move it away to start over.")
    if rng_state is not None:
        _set_rng_state(rng_state, rng, accelerator)
    return int(client["step"])
