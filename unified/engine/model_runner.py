"""Packs a scheduled ragged batch into one forward pass and returns the logits that pick tokens.

All sequences' new tokens are concatenated into a single [1, T] batch (no padding); the attention
context tells each layer where those tokens' K/V go and which blocks each sequence reads. Only the
last position of each sequence that reaches its end this step goes through the LM head.

Across ranks (tensor, pipeline, expert parallel) one scheduler drives: the driver (global rank 0)
prepares each step's inputs and broadcasts them; every other rank `follow()`s, running the same
forward (its shard of it) until the driver says stop. Only the driver's logits are used. Between steps
the driver may broadcast a command instead of a step (a weight update), which every follower obeys.
"""
from __future__ import annotations

import torch

from unified.engine.kv_cache import KVCache, PagedAttentionContext, StepMetadata
from unified.engine.scheduler import ScheduledSeq
from unified.model.forward_context import forward_context


class ModelRunner:
    def __init__(self, model, device: torch.device):
        self.model = model
        self.device = device
        self.cache: KVCache | None = None

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, list[int]]:
        block_size = self.cache.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start, context_lens, sample_rows = [0], [], []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            table = seq.block_table
            tokens += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            query_start.append(query_start[-1] + item.num_new_tokens)
            context_lens.append(end)
            if item.samples:
                sample_rows.append(query_start[-1] - 1)
        width = max(len(item.seq.block_table) for item in batch)
        tables = torch.tensor([item.seq.block_table + [0] * (width - len(item.seq.block_table)) for item in batch],
                              dtype=torch.long)
        meta = StepMetadata(torch.tensor(slots, dtype=torch.long, device=self.device), tables.to(self.device),
                            query_start, context_lens)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        pos = torch.tensor([positions], dtype=torch.long, device=self.device)
        return ids, pos, meta, sample_rows

    @property
    def distributed(self) -> bool:
        return torch.distributed.get_world_size() > 1

    def execute(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Runs the step; returns float32 logits [num sampling sequences, V] in batch order."""
        plan = self.prepare(batch)
        if self.distributed:
            torch.distributed.broadcast_object_list([plan], src=0)
        return self._run(*plan)

    def follow(self, on_command) -> None:
        """On a non-driver rank: runs the driver's steps, and passes its `command()`s to `on_command`,
        until it calls `stop_followers()`."""
        while True:
            box = [None]
            torch.distributed.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            if isinstance(box[0], tuple):
                self._run(*box[0])
            else:
                on_command(box[0])

    def command(self, message) -> None:
        """On the driver, between steps: sends every follower a message that is not a step."""
        torch.distributed.broadcast_object_list([message], src=0)

    def stop_followers(self) -> None:
        if self.distributed:
            torch.distributed.broadcast_object_list([None], src=0)

    @torch.inference_mode()
    def _run(self, ids, positions, meta: StepMetadata, sample_rows: list[int]) -> torch.Tensor:
        with forward_context(PagedAttentionContext(self.cache, meta)):
            hidden = self.model(ids, positions)  # [1, T, H]
        if not sample_rows:
            return hidden.new_empty(0, 0)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.logits(hidden[0].index_select(0, rows)).float()
