"""What an external RL trainer asks of an engine, done on every rank of it alike: weight updates over the
trainer's process group (weight_sync) and sleep mode (sleep_mode).

The driver sends each request to the follower ranks as a command of the engine's own loop, then carries
it out itself; the ranks' errors are pooled, so that all of them act alike (all join a group or none,
all write an update or none).
"""
from __future__ import annotations

import logging

import torch

from unified.engine.sleep_mode import (EngineBusy, Sleep, WakeUp, drop_weights, give_memory_back, restore_weights,
                                       weights_missing)
from unified.engine.weight_sync import (JoinUpdateGroup, LeaveUpdateGroup, ReceiveWeights, UpdateGroups,
                                        WeightSyncError, check_join, unknown_sizes)

log = logging.getLogger(__name__)
COMMANDS = (JoinUpdateGroup, ReceiveWeights, LeaveUpdateGroup, Sleep, WakeUp)


class TrainerLink:
    def __init__(self, engine):
        self.engine = engine
        self.groups = UpdateGroups(engine.model, engine.device)
        self.sleep_level = 0  # 0 awake, 1 KV cache and packed copies freed, 2 the weights too
        self.weights_missing = False  # woken from level 2: no weights until an update brings them
        self._dropped_shapes: dict = {}

    # On the driver, between steps ---------------------------------------------------------------------

    def join_update_group(self, spec: JoinUpdateGroup) -> None:
        """Every rank joins the trainer's update group (or none does)."""
        check_join(spec, self.engine.runner.group_size)
        self._drive(spec)

    def receive_weights(self, spec: ReceiveWeights) -> int:
        """Every rank receives the update's tensors from the trainer and writes its part; returns the bytes
        received. All or nothing: a bad name, dtype or shape on any rank leaves every rank's weights
        untouched (WeightSyncError)."""
        return self._drive(spec)

    def leave_update_group(self, name: str) -> None:
        if name not in self.groups.groups:
            raise WeightSyncError(self.groups.not_joined(name))
        self._drive(LeaveUpdateGroup(name))

    def sleep(self, level: int) -> dict[str, int]:
        """With no request in flight: frees memory on every rank (see sleep_mode); returns the bytes this
        rank freed, by kind."""
        if self.engine.requests:
            raise EngineBusy(f"{len(self.engine.requests)} requests are still in flight; finish or abort them first")
        return self._drive(Sleep(level))

    def wake_up(self) -> None:
        self._drive(WakeUp())

    def check_weights_present(self) -> None:
        if self.sleep_level >= 2:
            raise WeightSyncError("the weights were freed by sleep level 2; wake the engine up first, then send them")

    def _drive(self, command):
        if self.engine.runner.distributed:
            self.engine.runner.command(command)
        return self.run(command)

    # On every rank -----------------------------------------------------------------------------------

    def follow(self, command) -> None:
        """A follower's share of a command the driver sent; the driver reports errors."""
        try:
            self.run(command)
        except WeightSyncError as err:
            log.warning("weight sync: %s", err)

    def run(self, command):
        if isinstance(command, Sleep):
            return self._sleep(command.level)
        if isinstance(command, WakeUp):
            return self._wake_up()
        if isinstance(command, LeaveUpdateGroup):
            return self.groups.leave(command.group_name)
        if isinstance(command, JoinUpdateGroup):
            return self._join(command)
        unknown = unknown_sizes(command)
        if unknown:  # what to receive is not known: receiving anything could overrun a buffer or never end
            self.groups.leave(command.group_name)
            raise WeightSyncError(f"{unknown}; nothing was received and the update group {command.group_name!r} was "
                                  f"dropped, so the trainer's broadcasts fail instead of waiting: fix the request "
                                  f"and create the group again")
        asleep = ["the weights were freed by sleep level 2: wake the engine up first (POST /wake_up), then send "
                  "them"] if self.sleep_level >= 2 else []
        problems = self._pooled(*(asleep or self.groups.stream.problems(command.names, command.dtypes, command.shapes)))
        received = self.groups.receive(command, sorted(set(problems)))
        self.engine.weights_changed()
        if self.weights_missing:  # woken from level 2: generation waits until every weight has come
            self.weights_missing = bool(self._pooled("missing" if weights_missing(self.engine.model) else None))
        return received

    def _join(self, command: JoinUpdateGroup) -> None:
        error, existed = None, command.group_name in self.groups.groups
        try:
            self.groups.join(command, self.engine.runner.group_rank)
        except WeightSyncError as err:
            error = str(err)
        errors = self._pooled(error)
        if errors:
            if not existed:  # a group of that name that already worked stays
                self.groups.leave(command.group_name)
            raise WeightSyncError("; ".join(errors))

    def _sleep(self, level: int) -> dict[str, int]:
        engine = self.engine
        if self.sleep_level:
            return {}
        freed = {"kv_cache_bytes": engine.release_kv_cache(), "packed_weight_bytes": engine.model.unpack_weights()}
        if level >= 2:
            self._dropped_shapes, freed["weight_bytes"] = drop_weights(engine.model)
        give_memory_back(engine.device, engine.runner.accelerator)
        self.sleep_level = level
        return freed

    def _wake_up(self) -> None:
        engine = self.engine
        if not self.sleep_level:
            return
        if self.sleep_level >= 2:
            restore_weights(engine.model, self._dropped_shapes)
            self.weights_missing = True
        engine.restore_kv_cache()
        self.sleep_level = 0
        engine.repack_weights()

    def _pooled(self, *errors: str | None) -> list[str]:
        """Every rank's errors (one call on every rank of the engine)."""
        mine = [e for e in errors if e]
        runner = self.engine.runner
        if not runner.distributed:
            return mine
        everyone: list = [None] * runner.group_size
        torch.distributed.all_gather_object(everyone, mine, group=runner.group)
        return [e for rank_errors in everyone for e in rank_errors]
