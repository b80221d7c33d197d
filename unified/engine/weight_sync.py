"""Weights pushed by an external trainer over torch.distributed: SGLang's weight-sync protocol, engine side.

The trainer and every rank of the engine form a process group of their own: the trainer is its rank 0
and engine rank i is `rank_offset + i`. They meet through the TCP store the trainer's rank 0 hosts at
master_address:master_port, with the group's keys under a prefix of its name, the way SGLang's
`init_custom_process_group` builds its group, so a trainer written for SGLang joins unchanged. An
update is a list of HF tensor names, dtypes and shapes; the trainer broadcasts each tensor from its
rank 0 in that order, and every engine rank writes its own part of it (checkpoint.weight_stream): straight
into the weights where the whole tensor lies in them in one piece, else through a receive buffer kept
for the next update.

An update is checked on every rank before anything is written (names, dtypes, shapes); a bad one is
still received in full, into scratch buffers, so the trainer's broadcasts never hang, and then refused
with the weights untouched. A trainer that stops sending is given up on after the group's timeout, and
the group is dropped.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch

from unified.checkpoint.weight_stream import WeightStream, parse_dtype
from unified.errors import UserError

log = logging.getLogger(__name__)
BACKENDS = ("gloo", "nccl", "mccl")


class WeightSyncError(UserError, ValueError):
    """A weight-sync request that cannot be carried out; the served weights are untouched."""


@dataclass
class JoinUpdateGroup:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float


@dataclass
class LeaveUpdateGroup:
    group_name: str


@dataclass
class ReceiveWeights:
    group_name: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


def check_join(spec: JoinUpdateGroup, engine_ranks: int) -> None:
    if spec.backend not in BACKENDS:
        raise WeightSyncError(f"backend {spec.backend!r} is not one of {', '.join(BACKENDS)} (gloo on CPU, nccl on "
                              f"NVIDIA GPUs, mccl on Moore Threads GPUs)")
    if spec.rank_offset < 1 or spec.rank_offset + engine_ranks > spec.world_size:
        raise WeightSyncError(f"rank_offset={spec.rank_offset} with world_size={spec.world_size} leaves no room for "
                              f"this server's {engine_ranks} rank(s) after the trainer's rank 0: ranks "
                              f"rank_offset .. rank_offset + {engine_ranks - 1} must lie within 1 .. world_size - 1")


def unknown_sizes(spec: ReceiveWeights) -> str | None:
    """Why the bytes of an update cannot be known from its request (None: they can)."""
    if not len(spec.names) == len(spec.dtypes) == len(spec.shapes):
        return (f"names, dtypes and shapes must be lists of one length; got {len(spec.names)}, {len(spec.dtypes)} "
                f"and {len(spec.shapes)}")
    for name, dtype, shape in zip(spec.names, spec.dtypes, spec.shapes):
        if parse_dtype(dtype) is None:
            return f"{name}: dtype {dtype!r} is not a torch dtype (such as \"float32\" or \"torch.bfloat16\")"
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            return f"{name}: shape {shape!r} is not a list of sizes"
    return None


class UpdateGroups:
    """The update groups one engine rank belongs to, by name."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.groups: dict[str, object] = {}
        self._stream: WeightStream | None = None
        self._scratch: dict[tuple, torch.Tensor] = {}  # receive buffers by shape and dtype, kept between updates

    @property
    def stream(self) -> WeightStream:
        if self._stream is None:
            self._stream = WeightStream(self.model)
        return self._stream

    def join(self, spec: JoinUpdateGroup, engine_rank: int) -> None:
        """Blocks until every member (the trainer included) has joined, or the timeout."""
        from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

        if spec.group_name in self.groups:
            raise WeightSyncError(f"an update group named {spec.group_name!r} exists already; destroy it first "
                                  f"(POST /destroy_weights_update_group) or pick another group_name")
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        rank = spec.rank_offset + engine_rank
        try:
            store, _, _ = next(rendezvous(f"tcp://{spec.master_address}:{spec.master_port}", rank, spec.world_size,
                                          timeout=timeout))
            store.set_timeout(timeout)
            group, _ = _new_process_group_helper(spec.world_size, rank, [], spec.backend,
                                                 PrefixStore(spec.group_name, store), group_name=spec.group_name,
                                                 timeout=timeout)
        except (RuntimeError, ValueError, OSError) as err:  # DistStoreError and DistNetworkError are RuntimeErrors
            raise WeightSyncError(f"could not form the update group {spec.group_name!r} with the trainer at "
                                  f"{spec.master_address}:{spec.master_port} within {spec.timeout_s:g} s: {err}") from None
        # group ranks are global ranks in this group of its own: broadcast(src=0) and destroy_process_group need it
        _world.pg_group_ranks[group] = {i: i for i in range(spec.world_size)}
        self.groups[spec.group_name] = group
        log.info("joined weight update group %r as rank %d of %d", spec.group_name, rank, spec.world_size)

    def leave(self, name: str) -> None:
        group = self.groups.pop(name, None)
        if group is not None:
            torch.distributed.destroy_process_group(group)

    def receive(self, spec: ReceiveWeights, problems: list[str]) -> int:
        """Receives every tensor of the update; writes them unless `problems` (every rank's, pooled) say
        the update is bad. Returns the bytes received; raises WeightSyncError if nothing was written."""
        group = self.groups.get(spec.group_name)
        if group is None:
            raise WeightSyncError(self.not_joined(spec.group_name))
        received = 0
        try:
            for name, dtype, shape in zip(spec.names, spec.dtypes, spec.shapes):
                dtype = parse_dtype(dtype)
                direct = None if problems else self.stream.in_place(name, shape, dtype)
                buffer = direct if direct is not None else self._buffer(shape, dtype)
                torch.distributed.broadcast(buffer, group_src=0, group=group)
                received += buffer.numel() * buffer.element_size()
                if direct is None and not problems:
                    self.stream.write(name, buffer)
        except (RuntimeError, ValueError) as err:  # the trainer stopped sending: a timeout, or it went away
            self.leave(spec.group_name)
            raise WeightSyncError(f"the trainer stopped sending after {received} bytes of the update "
                                  f"({err}); the update group {spec.group_name!r} was dropped"
                                  + ("; the weights are partly updated: send the update again"
                                     if received and not problems else "")) from None
        if problems:
            raise WeightSyncError("the update was received and dropped, the served weights are untouched: "
                                  + "; ".join(problems))
        return received

    def _buffer(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self._scratch:
            self._scratch[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return self._scratch[key]

    def not_joined(self, name: str) -> str:
        known = f" (this server's groups: {', '.join(sorted(self.groups))})" if self.groups else ""
        return (f"no weight update group named {name!r}{known}; create it first with POST "
                f"/init_weights_update_group")
