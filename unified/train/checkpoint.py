"""Resumable training checkpoints (DeepSpeed's format) that a crash during a save cannot break.

Each save writes a new tag folder `step-NNNNNNN` (model, optimizer and scheduler through DeepSpeed; the
step, which is also the data position, in its client state; every rank's RNG states in a file of its
own), and only when all ranks have finished writing does rank 0 point `latest` at it, by an atomic
rename. A crash mid-save leaves `latest` on the previous complete tag. Older tags beyond
`keep_checkpoints` are removed after `latest` moves.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from unified.errors import UserError

LATEST = "latest"


def _tag(step: int) -> str:
    return f"step-{step:07d}"


def _rng_state(accelerator) -> dict:
    return {"torch": torch.get_rng_state(), "accelerator": accelerator.get_rng_state(),
            "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict, accelerator) -> None:
    torch.set_rng_state(state["torch"])
    accelerator.set_rng_state(state["accelerator"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


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


def save(engine, directory: Path, step: int, accelerator, keep: int, partial: bool) -> None:
    """`partial`: some weights are frozen (LoRA, train.trainable); only the trained ones are saved."""
    rank = torch.distributed.get_rank()
    tag = _tag(step)
    engine.save_checkpoint(str(directory), tag=tag, client_state={"step": step}, save_latest=False,
                           exclude_frozen_parameters=partial)
    torch.save(_rng_state(accelerator), directory / tag / f"rng_rank{rank:05d}.pt")
    torch.distributed.barrier()
    if rank == 0:
        _write_atomically(directory / LATEST, tag)
        tags = sorted(p for p in directory.glob("step-*") if p.is_dir())
        for old in tags[:-max(keep, 1)]:
            shutil.rmtree(old, ignore_errors=True)
    torch.distributed.barrier()


def resume(engine, directory: Path, accelerator, partial: bool) -> int:
    """Loads the newest complete checkpoint into `engine`; returns the step to continue from (0: none)."""
    tag = latest_tag(directory) if directory.is_dir() else None
    if tag is None:
        return 0
    path, client = engine.load_checkpoint(str(directory), tag=tag, load_module_strict=not partial)
    if path is None:
        raise UserError(f"DeepSpeed could not load checkpoint {directory / tag}; it may come from another "
                        f"model or parallel layout. Move it away to start over.")
    rng = directory / tag / f"rng_rank{torch.distributed.get_rank():05d}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False), accelerator)
    return int(client["step"])
