"""Whole HF-named tensors, arriving one at a time (a trainer's weight broadcast), written into this rank's shard.

The sender holds the model in the HF layout: a `transformers` model's `state_dict()` (q, k and v apart,
`lm_head.weight` even where it is tied; since transformers 5 the routed experts of a layer fused into
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]), or the names its
checkpoints store on disk (one tensor per expert projection). Each of our ranks takes its own part of every
tensor the way the loader reads a checkpoint (its tensor-parallel slice, its experts, its pipeline
stage's layers) and writes it in place where that part sits in our fused parameters, so the sender's
layout never has to match ours. A tensor another rank holds is taken and dropped here.

`problems` checks a whole update (names, dtypes, shapes) before anything is written, so an update is
applied all or nothing; a rank can only check the shapes of what it holds, so a multi-rank receiver
pools the ranks' problems before writing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from unified.checkpoint.hf_names import Param, parameter_map
from unified.checkpoint.loader import FullTensors, _ep_rank_size, _read_part, _tp_rank_size, part_sizes


SHORT_DTYPE_NAMES = {"fp32": torch.float32, "f32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                     "f16": torch.float16, "fp64": torch.float64, "f64": torch.float64}


def parse_dtype(name: str) -> torch.dtype | None:
    """"float32", "torch.float32", "float" or "fp32" -> torch.float32; None for anything that is not a dtype."""
    name = str(name).removeprefix("torch.")
    found = SHORT_DTYPE_NAMES.get(name.lower(), getattr(torch, name, None))
    return found if isinstance(found, torch.dtype) else None


ALL_ROWS = -1  # a slot that fills every row of a stacked parameter at once (transformers' fused experts)


@dataclass(frozen=True)
class _Slot:
    param: Param
    row: int  # which row of the parameter (an expert of a stacked MoE weight), or ALL_ROWS
    part: int  # which part of the row (q, k or v of a fused qkv)


class WeightStream:
    """Writes whole HF tensors into `model`'s parameters on this rank (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.targets = dict(model.named_parameters()) | dict(model.named_buffers())
        params = parameter_map(model.config)
        self.slots = {name: _Slot(param, row, part) for param in params
                      for row, names in enumerate(param.rows) for part, name in enumerate(names)}
        self.slots.update(_in_memory_expert_names(model.config, params))
        config = model.config
        # transformers' state_dict() lists the tied head; its weights are the embedding's, which come too
        self.ignored = {"lm_head.weight"} if config.tie_word_embeddings and "lm_head.weight" not in self.slots else set()

    def problems(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[str]:
        """What is wrong with an update of these tensors, as far as this rank can tell (empty: nothing)."""
        out = []
        if not len(names) == len(dtypes) == len(shapes):
            return [f"names, dtypes and shapes must be lists of one length; got {len(names)}, {len(dtypes)} "
                    f"and {len(shapes)}"]
        for name, dtype, shape in zip(names, dtypes, shapes):
            if name not in self.slots and name not in self.ignored:
                out.append(f"the model has no tensor {name!r} (names are those of the HF model's state_dict())")
                continue
            if parse_dtype(dtype) != self.dtype:
                out.append(f"{name}: dtype {dtype!r}, but the served weights are {str(self.dtype).removeprefix('torch.')}")
                continue
            expected = self.full_shape(name)
            if expected is not None and tuple(shape) != expected:
                out.append(f"{name}: shape {list(shape)}, but the model's is {list(expected)}")
        return out

    def full_shape(self, name: str) -> tuple[int, ...] | None:
        """The whole (HF) shape of `name`, if this rank holds a part of it; None otherwise."""
        located = self._locate(name)
        if located is None:
            return None
        slot, row, offset, local, full = located
        if slot.row == ALL_ROWS:
            return (len(slot.param.rows), *row.shape[1:])
        shape = list(row.shape)
        shape[slot.param.cat_dim] = full
        return tuple(shape)

    def in_place(self, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor | None:
        """Where the whole tensor `name` lies in this rank's parameters as one contiguous piece (no tensor or
        expert split; not fused, or fused along its first dimension), so a receiver can take it there directly;
        else None."""
        located = self._locate(name)
        if located is None:
            return None
        slot, row, offset, local, full = located
        if slot.row == ALL_ROWS:
            whole = row if len(slot.param.rows) == row.shape[0] else None
        else:
            split = slot.param.split is not None and _tp_rank_size()[1] > 1
            whole = None if split else row.narrow(slot.param.cat_dim, offset, local)  # contiguous: checked below
        if whole is None or tuple(whole.shape) != tuple(shape) or whole.dtype != dtype or not whole.is_contiguous():
            return None
        return whole.detach()

    @torch.no_grad()
    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copies this rank's part of the whole tensor `name` into the model (nothing if another rank holds it)."""
        located = self._locate(name)
        if located is None:
            return
        slot, row, offset, local, _ = located
        if slot.row == ALL_ROWS:  # experts are never split by tensor parallelism: this rank's whole experts
            first = _ep_rank_size()[0] * row.shape[0]
            row.copy_(tensor[first:first + row.shape[0]])
            return
        rank, size = _tp_rank_size() if slot.param.split is not None else (0, 1)
        part = _read_part(FullTensors({name: tensor}), name, slot.param.split, rank, size, slot.param.unit)
        row.narrow(slot.param.cat_dim, offset, local).copy_(part)

    def _locate(self, name: str):
        """(slot, this rank's row tensor, the part's offset and length in it along cat_dim, its whole length),
        or None where another rank or stage holds it (or it is a tied head)."""
        slot = self.slots.get(name)
        if slot is None or slot.param.ours not in self.targets:
            return None
        param, target, row_index = slot.param, self.targets[slot.param.ours], slot.row
        if row_index == ALL_ROWS:
            return slot, target, 0, target.shape[0], len(param.rows)
        if param.is_experts:
            ep_rank, ep_size = _ep_rank_size()
            per_rank = len(param.rows) // ep_size
            if not ep_rank * per_rank <= row_index < (ep_rank + 1) * per_rank:
                return None
            row_index -= ep_rank * per_rank
        row = target[row_index] if param.stacked else target
        tp = _tp_rank_size()[1] if param.split is not None else 1
        full, local, _ = part_sizes(param, row.shape[param.cat_dim], tp)
        return slot, row, sum(local[:slot.part]), local[slot.part], full[slot.part]


def _in_memory_expert_names(config, params: list[Param]) -> dict[str, _Slot]:
    """transformers (5 and later) names of MoE tensors that its checkpoints store otherwise: a layer's
    experts fused into two tensors, and Mixtral's router under `mlp.` rather than `block_sparse_moe.`."""
    out = {}
    for param in params:
        if param.is_experts:
            layer = param.rows[0][0].split(".experts.")[0].rsplit(".", 1)[0]  # the HF layer's prefix
            kind = "gate_up_proj" if param.ours.endswith("gate_up") else "down_proj"
            out[f"{layer}.mlp.experts.{kind}"] = _Slot(param, ALL_ROWS, 0)
        elif ".block_sparse_moe." in param.rows[0][0]:
            out[param.rows[0][0].replace(".block_sparse_moe.", ".mlp.")] = _Slot(param, 0, 0)
    return out
