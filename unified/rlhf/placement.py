"""Where rollouts run: in the trainer's own processes (colocated) or in processes of their own (separate).

Both give the learner the same three calls: `generate` the step's completions, `release` the rollout
memory while training, and `weights_changed` after an update.

Colocated, the engine runs the trainer's very modules: nothing moves. What the engine derives from the
weights (packed CPU copies, with the LoRA adapters folded in) is refreshed after an update, and its prefix
cache starts empty. Launched on several ranks, each rank samples its share of the prompts (`Share`) with
its own engine, trains on it data-parallel, and sees every rank's completions for the step's figures.

Separate (`rlhf.mode=separate`), one launch holds trainer ranks (the first ones) and rollout ranks (the
last `rlhf.rollout_ranks`). The rollout ranks run engines on their own copy of the model, each engine
on one rank or, with `rlhf.rollout_parallel` (tensor, pipeline, expert parallel), on several (each role
with megatron groups of its own: unified.runtime.role_layouts; an engine's first rank drives it and the
others follow its steps). Engine e of E answers a share of the step's prompts (prompt i goes to engine i
mod E, sampled with prompt i's seed, so the completions do not depend on how many engines there are);
the completions are gathered on every rank. The trainer ranks are data-parallel (DeepSpeed over their
own group): trainer t of T trains on the completions of prompts i with i mod T = t (`Share`), weighting
its loss so that the averaged gradients are those of the whole batch. After each update the first
trainer rank broadcasts the trained parameters (the LoRA adapters, or every weight) to the rollout ranks
in buckets of `rlhf.sync_bucket_mb`, one flat tensor per bucket and dtype, and reports the bytes and
seconds it took: as they are where the rollout engines hold whole parameters too, else under their HF
names, each rollout rank taking its own part (unified.rlhf.resharding).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from unified.errors import UserError
from unified.rlhf.resharding import reshard_to_rollouts
from unified.rlhf.rollout import Rollout, generate
from unified.rlhf.whole_weights import WholeWeights
from unified.runtime.layout import Layout

MODES = ("colocated", "separate")


@dataclass(frozen=True)
class Share:
    """Which of a step's prompt groups one trainer rank trains on (group g where g mod `count` = `index`), and
    how the trainer ranks pool what each computed on its share. One trainer: everything, nothing pooled."""

    index: int = 0
    count: int = 1
    group: object = None  # the trainer ranks' process group

    def holds(self, prompt_group: int) -> bool:
        return prompt_group % self.count == self.index

    def pooled(self, values: list[float], op: str = "mean") -> list[float]:
        """Each value's mean (or "max") over the trainer ranks."""
        if self.count == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
        torch.distributed.all_reduce(tensor, op=reduce_op, group=self.group)
        return (tensor if op == "max" else tensor / self.count).tolist()


@dataclass(frozen=True)
class Roles:
    """Which ranks train and which roll out, in a world of `world` ranks, and the rollout engines' layout."""

    world: int
    rollout_ranks: int
    rollout_layout: Layout = Layout()

    @staticmethod
    def of(cfg, world: int) -> "Roles":
        if cfg.mode not in MODES:
            raise UserError(f"rlhf.mode={cfg.mode!r} is unknown; choose {' or '.join(MODES)}")
        if cfg.mode == "colocated":
            return Roles(world, 0)
        rollout = cfg.rollout_ranks if cfg.rollout_ranks is not None else world // 2
        if not 1 <= rollout < world:
            raise UserError(f"rlhf.mode=separate needs at least one trainer rank and one rollout rank; with "
                            f"{world} ranks, rlhf.rollout_ranks={rollout} leaves "
                            f"{'none to train' if rollout >= world else 'none to roll out'}: launch more ranks "
                            f"(deepspeed --num_gpus 2 ...) or set rlhf.rollout_ranks between 1 and {world - 1}")
        p = cfg.rollout_parallel
        layout = Layout(p.tensor, p.pipeline, p.expert)
        engine = layout.tensor * layout.pipeline * layout.expert
        if min(p.tensor, p.pipeline, p.expert) < 1 or rollout % engine:
            raise UserError(f"rlhf.rollout_parallel ({layout}) needs {engine} ranks per rollout engine, which the "
                            f"{rollout} rollout ranks do not divide into: set rlhf.rollout_ranks to a multiple of "
                            f"{engine} or choose a smaller rlhf.rollout_parallel")
        return Roles(world, rollout, layout)

    @property
    def engine_ranks(self) -> list[list[int]]:
        """The ranks of each rollout engine (its first one drives it)."""
        size = self.rollout_layout.tensor * self.rollout_layout.pipeline * self.rollout_layout.expert
        return [self.rollouts[i:i + size] for i in range(0, self.rollout_ranks, size)]

    @property
    def blocks(self) -> list[tuple[int, Layout]]:
        """The world's blocks of ranks with their layouts (unified.runtime.role_layouts): the data-parallel
        trainers, then every rollout engine."""
        return [(len(self.trainers), Layout())] + [(len(ranks), self.rollout_layout) for ranks in self.engine_ranks]

    @property
    def separate(self) -> bool:
        return self.rollout_ranks > 0

    @property
    def trainers(self) -> list[int]:
        return list(range(self.world - self.rollout_ranks))

    @property
    def rollouts(self) -> list[int]:
        return list(range(self.world - self.rollout_ranks, self.world))

    def trains(self, rank: int) -> bool:
        return rank in self.trainers


def refresh_engine_copies(engine, model: nn.Module) -> None:
    """The engine's packed copies of the weights, which fold the LoRA adapters in (the optimizer may
    update parameters in place without a version bump that would tell the copies are stale)."""
    if engine.packs_weights:
        model.pack_weights()


def generate_share(engine, prompts: list[list[int]], num_generations: int, max_tokens: int, temperature: float,
                   seed: int | None, index: int, count: int) -> list[Rollout]:
    """The completions of prompts i with i mod `count` = `index`, each prompt sampled with its own seed
    (`seed` + i x num_generations, as on one rank) and labelled with its index i."""
    chosen = list(range(index, len(prompts), count))
    seeds = None if seed is None else [seed + i * num_generations for i in chosen]
    mine = generate(engine, [prompts[i] for i in chosen], num_generations, max_tokens, temperature, seeds=seeds)
    for rollout in mine:
        rollout.group = chosen[rollout.group]
    return mine


def gather_rollouts(mine: list[Rollout], group=None) -> list[Rollout]:
    """Every rank's completions (of `group`, None: the world) on every rank, in prompt order."""
    parts: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(parts, mine, group=group)
    return sorted((r for part in parts for r in part), key=lambda r: r.group)


class Colocated:
    def __init__(self, engine, model: nn.Module, whole: WholeWeights | None = None, share: Share = Share()):
        """`whole`: the trainer's parameters made whole where ZeRO-3 partitions them (the engine samples and
        re-packs inside it; build it inside it too). `share`: with several data-parallel ranks, each samples
        its share of the prompts with its own engine and trains on them; every rank gets all completions."""
        self.engine, self.model, self.share = engine, model, share
        self.whole = whole or WholeWeights(model, partitioned=False)

    def generate(self, prompts: list[list[int]], num_generations: int, max_tokens: int, temperature: float,
                 seed: int | None) -> list[Rollout]:
        with self.whole():
            mine = generate_share(self.engine, prompts, num_generations, max_tokens, temperature, seed,
                                  self.share.index, self.share.count)
        return mine if self.share.count == 1 else gather_rollouts(mine, self.share.group)

    def release(self) -> int:
        return self.engine.release_kv_cache()

    def weights_changed(self) -> dict[str, float]:
        with self.whole():
            refresh_engine_copies(self.engine, self.model)
        return self.whole.take_stats()


def synced_parameters(model: nn.Module, lora: bool) -> list[tuple[str, nn.Parameter]]:
    """What an update changes, in the same order on every rank: the adapters under LoRA, else every weight."""
    params = sorted(model.named_parameters())
    return [(name, p) for name, p in params if ".lora." in name] if lora else params


class Separate:
    """Every rank of a separate-mode launch holds one; rollout ranks then set `engine`, built on `engine_group`."""

    def __init__(self, roles: Roles, model: nn.Module, lora: bool, bucket_bytes: int = 256 << 20):
        self.roles, self.model, self.lora = roles, model, lora
        self.whole = WholeWeights(model, partitioned=False)  # trainer ranks under ZeRO-3 set theirs
        self.engine = None
        self.rank = torch.distributed.get_rank()
        self.bucket_bytes = bucket_bytes
        # Every rank creates every group, in the same order (torch.distributed requires it).
        self.sync_group = torch.distributed.new_group([roles.trainers[0], *roles.rollouts])
        self.trainer_group = torch.distributed.new_group(roles.trainers)
        engines = roles.engine_ranks
        engine_groups = [torch.distributed.new_group(ranks) for ranks in engines]
        self.engine_index = next((i for i, ranks in enumerate(engines) if self.rank in ranks), None)
        self.engine_group = None if self.engine_index is None else engine_groups[self.engine_index]
        self.share = (Share(roles.trainers.index(self.rank), len(roles.trainers), self.trainer_group)
                      if roles.trains(self.rank) else None)
        self.device = next(model.parameters()).device
        self.resharded = roles.rollout_layout != Layout()  # else both sides hold whole parameters alike

    def generate(self, prompts: list[list[int]], num_generations: int, max_tokens: int, temperature: float,
                 seed: int | None) -> list[Rollout]:
        """A collective of every rank: each rollout engine answers its share (its driver gets them; the
        engine's other ranks follow its steps), and every rank gets all of them."""
        mine: list[Rollout] = []
        if self.engine is not None and not self.engine.is_driver:
            self.engine.follow(ignore_signals=False)  # until the driver has its share
        elif self.engine is not None:
            mine = generate_share(self.engine, prompts, num_generations, max_tokens, temperature, seed,
                                  self.engine_index, len(self.roles.engine_ranks))
            self.engine.release_followers()
        return gather_rollouts(mine)

    def release(self) -> int:
        return 0  # the trainer ranks hold no KV cache; the rollout ranks keep theirs

    def weights_changed(self) -> dict[str, float]:
        """From the first trainer rank to every rollout rank; the other trainer ranks only take part in
        making the parameters whole under ZeRO-3."""
        started = time.perf_counter()
        with self.whole():
            if self.rank not in (self.roles.trainers[0], *self.roles.rollouts):
                return self.whole.take_stats()
            if self.resharded:
                sent = reshard_to_rollouts(self.model, self.lora, self.roles.trainers[0], self.sync_group,
                                           self.bucket_bytes, self.device, receives=self.engine is not None)
            else:
                sent = self._send_same_layout()
        if self.engine is not None:
            refresh_engine_copies(self.engine, self.model)
            self.engine.blocks.reset_prefix_cache()  # its K/V came from the weights before this update
        return {"sync/bytes": float(sent), "sync/seconds": time.perf_counter() - started, **self.whole.take_stats()}

    def _send_same_layout(self) -> int:
        """Every synced parameter as it is, in flat buckets: both sides hold whole parameters."""
        sent = 0
        with torch.no_grad():
            for bucket in self._buckets():
                flat = (torch.cat([p.detach().reshape(-1) for _, p in bucket]) if self.rank == self.roles.trainers[0]
                        else torch.empty(sum(p.numel() for _, p in bucket), dtype=bucket[0][1].dtype,
                                         device=self.device))
                torch.distributed.broadcast(flat, self.roles.trainers[0], group=self.sync_group)
                sent += flat.numel() * flat.element_size()
                if self.engine is not None:
                    offset = 0
                    for _, p in bucket:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
        return sent

    def checkpoint_saved(self) -> None:
        """On rollout ranks, while the trainer saves a checkpoint: DeepSpeed's save_checkpoint holds two
        barriers of the whole world, which these ranks must meet."""
        if self.engine is not None:
            for _ in range(2):
                torch.distributed.barrier()

    def _buckets(self) -> list[list[tuple[str, nn.Parameter]]]:
        buckets: list[list[tuple[str, nn.Parameter]]] = []
        size = 0
        for name, p in synced_parameters(self.model, self.lora):
            nbytes = p.numel() * p.element_size()
            if not buckets or size + nbytes > self.bucket_bytes or buckets[-1][0][1].dtype != p.dtype:
                buckets.append([])
                size = 0
            buckets[-1].append((name, p))
            size += nbytes
        return buckets
