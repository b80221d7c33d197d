"""Rows of examples, the order they are trained in, and attention that stays inside each example.

An epoch shuffles the examples (seeded by the epoch) and packs them first-fit, in order, into rows of
at most `seq_len` tokens (one example per row without packing); an example is never split. Rows form
one endless stream across epochs, so a step is fully determined by its number: step `s` takes rows
`[s * R, (s + 1) * R)` of the stream, R = micro-batch x data-parallel ranks x accumulation steps. That is
what makes resume exact (the data position is the step) and lets every rank count the whole step's
target tokens without communicating.

Each example's positions restart at 0, and its targets (the next token's label) are shifted within the
example, so nothing is learned across an example boundary; `PackedAttention` masks attention to the
query's own example. A batch carries the pixels of its examples' images in the order their placeholder
tokens appear in the rows (row by row, example by example), which is the order the model fills them in.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from unified.model.attention import causal_attention
from unified.train.data import IGNORE, Example


def pack_rows(lengths: list[int], order: list[int], seq_len: int, packing: bool) -> list[list[int]]:
    rows, current, used = [], [], 0
    for index in order:
        if current and (not packing or used + lengths[index] > seq_len):
            rows.append(current)
            current, used = [], 0
        current.append(index)
        used += lengths[index]
    if current:
        rows.append(current)
    return rows


class RowStream:
    """The endless, deterministic stream of rows over epochs."""

    def __init__(self, examples: list[Example], seq_len: int, packing: bool, shuffle: bool, seed: int):
        self.examples, self.seq_len, self.packing, self.shuffle, self.seed = examples, seq_len, packing, shuffle, seed
        self._starts = [0]  # the stream offset where each epoch begins (one more entry than epochs packed)
        self._cached: tuple[int, list[list[int]]] | None = None

    def epoch(self, epoch: int) -> list[list[int]]:
        if self._cached is None or self._cached[0] != epoch:
            order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            lengths = [len(e.input_ids) for e in self.examples]
            self._cached = (epoch, pack_rows(lengths, order, self.seq_len, self.packing))
        return self._cached[1]

    def _locate(self, index: int) -> tuple[int, int]:
        while self._starts[-1] <= index:
            self._starts.append(self._starts[-1] + len(self.epoch(len(self._starts) - 1)))
        epoch = next(e for e in range(len(self._starts) - 1) if index < self._starts[e + 1])
        return epoch, index - self._starts[epoch]

    def rows_in_epochs(self, epochs: int) -> int:
        self._locate(0)
        while len(self._starts) <= epochs:
            self._locate(self._starts[-1])
        return self._starts[epochs]

    def rows(self, start: int, count: int) -> list[list[int]]:
        """Rows `start .. start + count` of the stream (each a list of example indices)."""
        out = []
        for i in range(start, start + count):
            epoch, offset = self._locate(i)
            out.append(self.epoch(epoch)[offset])
        return out

    def num_targets(self, rows: list[list[int]]) -> int:
        return sum(self.examples[i].num_targets for row in rows for i in row)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, L], restarting at 0 for each example
    targets: torch.Tensor  # [B, L], the label of the next token of the same example, or IGNORE
    segments: torch.Tensor  # [B, L], example number within the row; -1 on padding
    pixel_values: torch.Tensor | None = None  # the images of every example, in placeholder order
    image_grid_thw: torch.Tensor | None = None  # [images, 3]

    @property
    def num_tokens(self) -> int:
        return int((self.segments >= 0).sum())

    def to(self, device) -> "Batch":
        return Batch(*(None if t is None else t.to(device) for t in (
            self.input_ids, self.positions, self.targets, self.segments, self.pixel_values, self.image_grid_thw)))


def collate(examples: list[Example], rows: list[list[int]], pad_id: int, multiple_of: int = 1) -> Batch:
    """`multiple_of`: pad the width to a multiple of it (sequence parallelism splits it evenly)."""
    width = max(sum(len(examples[i].input_ids) for i in row) for row in rows)
    width = -(-width // multiple_of) * multiple_of
    ids, pos, tgt, seg = (torch.full((len(rows), width), fill, dtype=torch.long) for fill in (pad_id, 0, IGNORE, -1))
    for r, row in enumerate(rows):
        at = 0
        for s, index in enumerate(row):
            example = examples[index]
            n = len(example.input_ids)
            ids[r, at:at + n] = torch.tensor(example.input_ids)
            pos[r, at:at + n] = torch.arange(n)
            tgt[r, at:at + n - 1] = torch.tensor(example.labels[1:])
            seg[r, at:at + n] = s
            at += n
    chosen = [examples[i] for row in rows for i in row]
    pixels = [e.pixel_values for e in chosen if e.pixel_values is not None]
    grids = [e.image_grid_thw for e in chosen if e.image_grid_thw is not None]
    return Batch(ids, pos, tgt, seg, torch.cat(pixels) if pixels else None, torch.cat(grids) if grids else None)


class PackedAttention:
    """Forward context for training on packed rows: causal attention within each example only.
    Rows holding one example each take the plain causal path (padding only ever trails)."""

    def __init__(self, segments: torch.Tensor):
        self.segments = segments
        self.single = bool((segments.max(dim=1).values <= 0).all())
        self._masks: dict[int | None, torch.Tensor] = {}

    def _mask(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window not in self._masks:
            seg = self.segments
            pos = torch.arange(seg.shape[1], device=seg.device)
            distance = pos[:, None] - pos[None, :]  # [L, L]
            allowed = distance >= 0
            if sliding_window is not None:
                allowed = allowed & (distance < sliding_window)
            self._masks[sliding_window] = ((seg[:, :, None] == seg[:, None, :]) & allowed).unsqueeze(1)  # [B, 1, L, L]
        return self._masks[sliding_window]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        if self.single:
            return causal_attention(q, k, v, scale, sliding_window)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=self._mask(sliding_window), scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2)
