"""Replacing a served model's weights with another checkpoint's of the same architecture, without a restart.

`stage_weights` runs off the engine thread (it reads the whole checkpoint): it checks that the new
checkpoint's architecture is the served one, field by field, before reading any tensor, then reads this
rank's shard into host memory, so a big model never holds two copies on the accelerator. The engine
then copies the staged tensors into its own parameters in place between two steps (see
`LLMEngine.update_weights`): storage stays where it is, so the KV cache and anything else sized from the
model stay valid.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from unified.errors import UserError


class WeightMismatch(UserError, ValueError):
    pass


@dataclass
class UpdateWeights:
    """The driver's command to follower ranks: stage `path` and swap it in with the driver."""
    path: str


def stage_weights(path: str | Path, model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's shard of the checkpoint at `path`, in host memory, named as `model`'s parameters and
    buffers. Raises WeightMismatch if its architecture differs from `model`'s (nothing is read then)."""
    from unified.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from unified.checkpoint.loader import load_model

    served = model.config
    new = model_config_from_hf(read_hf_config(path))
    differences = [f"{f.name} is {getattr(new, f.name)!r}, served {getattr(served, f.name)!r}"
                   for f in fields(served) if getattr(new, f.name) != getattr(served, f.name)]
    if differences:
        raise WeightMismatch(f"{path} has another architecture than the served model ({'; '.join(differences)}); "
                             f"only a checkpoint with the same config.json architecture can replace the served weights")
    staged = load_model(path, "cpu", dtype).model
    tensors = dict(staged.named_parameters()) | dict(staged.named_buffers())
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    assert tensors.keys() == targets.keys(), "one architecture built two different sets of parameters"
    return {name: t.detach() for name, t in tensors.items()}


@torch.no_grad()
def copy_weights(model, staged: dict[str, torch.Tensor]) -> None:
    for name, target in (dict(model.named_parameters()) | dict(model.named_buffers())).items():
        source = staged[name]
        assert source.shape == target.shape, f"{name}: staged {tuple(source.shape)}, served {tuple(target.shape)}"
        target.copy_(source)
