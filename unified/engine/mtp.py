"""Method `mtp`: drafts from the model's own multi-token prediction layer (unified/model/mtp.py).

The layer keeps K/V of its own in the engine's paged cache: one cache layer after the model's, in the same
blocks, so a sequence's block table serves both. Its position i holds token i + 1 with the main model's
hidden state at i, so it trails the main model by one token:

- after each step, `after_step` runs it over the positions the step made final (a prefill chunk's, or a
  verified decode's accepted ones), on the hidden states of that step's forward; at a decoding
  sequence's last position (n - 2, its newest token being n - 1) that predicts token n: the first draft;
- before the next step the sequence is given `num_tokens` drafts, the first one known and the rest
  placeholders, so the scheduler allocates blocks for all of them; `before_forward` then chains the layer
  over them (position n - 2 + j from draft j - 1, its own normed output standing in for the main model's
  hidden state), writing K/V at positions that the next `after_step` overwrites with the final ones.

Verification makes the output exact whatever the drafts are. Two things lower only the acceptance rate: a
prefix-cache hit reuses the layer's K/V at the cached prefix's last position, which a sequence whose next
token differs would have computed otherwise; and a finished sequence's last position is never run.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from unified.engine.kv_cache import PagedAttentionContext, StepMetadata
from unified.engine.scheduler import ScheduledSeq
from unified.engine.sequence import Sequence
from unified.kernels.staging import to_device
from unified.model.forward_context import forward_context
from unified.model.mtp import MTPLayer
from unified.model.parallel_layers import PackableLinear


class MTPDrafter:
    """A drafter (speculative.py's `Drafter` interface) over the MTP layer."""

    def __init__(self, layer: MTPLayer, model, runner, pack: bool):
        """`pack`: give the layer's matmuls the packed (or quantized) weight copies the model's have."""
        self.layer, self.model, self.runner = layer, model, runner
        runner.keeps_hidden = True
        if pack:
            for module in layer.modules():
                if isinstance(module, PackableLinear):
                    module.pack(model.weight_quantization, model.int4_group)

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (sequence, room): its first draft, repeated as placeholders up to `room` (see the module)."""
        drafts = []
        for seq, room in wanted:
            made = seq.proposal
            drafts.append([made[1]] * room if made is not None and made[0] == seq.num_tokens else [])
        return drafts

    @torch.inference_mode()
    def before_forward(self, batch: list[ScheduledSeq]) -> None:
        """Fills each scheduled draft's placeholders, chaining the layer from its first token."""
        chains = [item for item in batch if len(item.draft) > 1]
        hidden = {id(item): item.seq.proposal[2] for item in chains}
        for j in range(1, max((len(item.draft) for item in chains), default=0)):
            chains = [item for item in chains if len(item.draft) > j]
            positions = [item.seq.num_tokens - 2 + j for item in chains]
            tokens, normed = self._drafts(MTPForward(
                [item.draft[j - 1] for item in chains], [range(p, p + 1) for p in positions],
                [item.seq.block_table for item in chains], list(range(len(chains))),
                previous=torch.stack([hidden[id(item)] for item in chains]).cpu()))
            for item, token, row in zip(chains, tokens, normed):
                item.draft[j], hidden[id(item)] = token, row

    @torch.inference_mode()
    def after_step(self, batch: list[ScheduledSeq]) -> None:
        """Runs the layer over the positions each sequence's step made final; a decoding sequence's last one
        gives its next first draft, kept in `Sequence.proposal` as (its token count then, the draft token, the
        layer's normed output there)."""
        ids, rows, spans, owners = [], [], [], []
        offset = 0
        for item in batch:
            seq, start = item.seq, item.first
            end = seq.num_computed_tokens
            seq.proposal = None
            if not seq.is_finished and end > start:
                ids += seq.token_ids[start + 1:end + 1]
                rows += range(offset, offset + end - start)
                spans.append(range(start, end))
                owners.append(seq)
            offset += item.num_new_tokens
        if not owners:
            return
        last = [end - 1 for end in itertools.accumulate(map(len, spans))]
        tokens, normed = self._drafts(MTPForward(ids, spans, [seq.block_table for seq in owners], last,
                                                 hidden_rows=rows))
        for seq, token, row in zip(owners, tokens, normed):
            if seq.num_computed_tokens == seq.num_tokens - 1:
                seq.proposal = (seq.num_tokens, token, row)

    def _drafts(self, command: "MTPForward") -> tuple[list[int], torch.Tensor]:
        """On the driver: `run`s the command on every rank of the engine."""
        if self.runner.distributed:
            self.runner.command(command)
        return self.run(command)

    def follow(self, command: "MTPForward") -> None:
        self.run(command)

    @torch.inference_mode()
    def run(self, command: "MTPForward") -> tuple[list[int], torch.Tensor]:
        """The layer over each sequence's run of positions: the next tokens at the `last` rows, and the
        layer's normed output there [len(last), H]. Every rank of the engine runs it (its shard)."""
        runner, device, size = self.runner, self.runner.device, self.runner.cache.block_size
        spans, tables = command.spans, command.tables
        if command.hidden_rows is not None:  # the main model's final hidden states at the step's tokens
            previous = runner.hidden.index_select(0, to_device(command.hidden_rows, torch.long, device))
        else:
            previous = command.previous.to(device)
        slots = [table[p // size] * size + p % size for span, table in zip(spans, tables) for p in span]
        width = max(map(len, tables))
        meta = StepMetadata(to_device(slots, torch.long, device),
                            to_device([t + [0] * (width - len(t)) for t in tables], torch.long, device),
                            list(itertools.accumulate(map(len, spans), initial=0)), [span[-1] + 1 for span in spans])
        with forward_context(PagedAttentionContext(runner.cache, meta)):
            embeds = self.model.embed(to_device([command.ids], torch.long, device))
            positions = to_device([[p for span in spans for p in span]], torch.long, device)
            out = self.layer(embeds, previous.unsqueeze(0), positions, self.model.rope)[0]  # [T, H]
        normed = self.layer.head_norm(out.index_select(0, to_device(command.last, torch.long, device)))
        return self.model.greedy_tokens(normed).tolist(), normed


@dataclass
class MTPForward:
    """One pass of the MTP layer, which the driver sends to every rank of a multi-rank engine."""

    ids: list[int]  # the tokens, flattened over the sequences' spans
    spans: list[range]  # each sequence's positions
    tables: list[list[int]]  # each sequence's block table
    last: list[int]  # the rows whose next tokens are wanted
    hidden_rows: list[int] | None = None  # the rows of the last step's hidden states the positions take, or
    previous: torch.Tensor | None = None  # the rows themselves [T, H], on the host
