"""The tensor-, pipeline- and expert-parallel groups a model reads while it is built.

Model modules take their shard sizes and ranks from these three groups, never from megatron-core's
parallel_state directly. In a run they are parallel_state's groups. `placed_as(...)` instead builds the
modules of one rank of any layout inside this process, without process groups of that size (on the meta
device, to check the bytes a rank holds against the planner): the groups are then `Place`s, which know
only their size and this rank's index. Such a model is for inspection: a forward would need real groups.

megatron-core's layers read a group's size only once torch.distributed is initialised, so `placed_as`
forms a world of one in this process if there is none (as a run without a launcher does).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.distributed as dist

from unified.runtime.distributed import init_single_process_group


@dataclass(frozen=True)
class Place:
    """A group as a module being built sees it: `ranks` in it, this rank at `index`."""

    ranks: int
    index: int

    def size(self) -> int:
        return self.ranks

    def rank(self) -> int:
        return self.index


@dataclass(frozen=True)
class RankPlaces:
    tensor: Place
    pipeline: Place
    expert: Place


# A plain module variable, not a ContextVar: torch.compile traces the model's reads of it (a ContextVar's get
# breaks its graph), and meta builds happen on one thread.
_places: RankPlaces | None = None


@contextlib.contextmanager
def placed_as(tensor: Place = Place(1, 0), pipeline: Place = Place(1, 0), expert: Place = Place(1, 0)):
    """Modules built inside are those of the rank at these places of a layout of these sizes."""
    for name, place in (("tensor", tensor), ("pipeline", pipeline), ("expert", expert)):
        assert 0 <= place.index < place.ranks, f"{name} rank {place.index} outside a group of {place.ranks}"
    if not dist.is_initialized():
        init_single_process_group("gloo")
    global _places
    outer, _places = _places, RankPlaces(tensor, pipeline, expert)
    try:
        yield
    finally:
        _places = outer


def placed() -> bool:
    """Whether modules are being built for a place of another layout (`placed_as`), not for this run's groups."""
    return _places is not None


def tensor_group():
    places = _places
    if places is not None:
        return places.tensor
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def pipeline_group():
    places = _places
    if places is not None:
        return places.pipeline
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def expert_group():
    places = _places
    if places is not None:
        return places.expert
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_group()
