"""Continuous batching with chunked prefill and preemption by recompute.

Every step has a token budget. Running sequences go first (a decode needs one token, an unfinished
prefill continues with as much as the budget allows), then waiting sequences join in arrival order.
With chunked prefill off, a prompt joins only when all of it fits the step. When the cache has no
block for a running sequence, the most recently started sequence is preempted: its blocks are freed
and it goes back to the front of the queue to be recomputed later, prompt and generated tokens alike.
A waiting sequence whose next prompt block another sequence is computing right now holds back (keeping its
place) until that block is in the prefix cache (see BlockManager.allocate_prefix).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from unified.engine.block_manager import BlockManager
from unified.engine.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens (drafts included)
    draft: list[int] = field(default_factory=list)  # speculative tokens after the sequence's last (speculative.py)
    first: int = field(init=False)  # the sequence's first position computed this step

    def __post_init__(self):
        self.first = self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence, so its last logits (one row per draft token
        more) pick tokens."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preemptions_before = self.num_preemptions
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted below to make room for an earlier one
                continue
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_new = min(remaining + len(seq.draft), budget)
            while not self.blocks.can_allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.blocks.allocate(seq, seq.num_computed_tokens + num_new)
            scheduled.append(ScheduledSeq(seq, num_new, seq.draft[:max(0, num_new - remaining)]))
            budget -= num_new

        if self.num_preemptions > preemptions_before:
            return scheduled  # memory is short: admit nobody new this step
        held_back = []  # waiting for a prefix in flight: they keep their place in the queue
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table and self.blocks.allocate_prefix(seq) is None:
                held_back.append(self.waiting.popleft())
                continue
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_new = min(remaining, budget)
            fits_step = self.chunked_prefill or remaining <= budget
            if not fits_step or not self.blocks.can_allocate(seq, seq.num_computed_tokens + num_new):
                self._release_prefix(seq)  # holds no blocks while it waits
                break
            self.blocks.allocate(seq, seq.num_computed_tokens + num_new)
            self.blocks.mark_in_flight(seq)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(held_back))
        return scheduled

    def _release_prefix(self, seq: Sequence) -> None:
        self.blocks.free_sequence(seq)
        seq.num_computed_tokens = seq.num_cached_prompt_tokens = 0

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
