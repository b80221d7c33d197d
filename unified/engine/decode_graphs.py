"""Decode steps replayed from captured graphs (CUDA graphs, or MUSA's), one per padded batch size.

A decode step's forward is the same few hundred kernel launches every time, and at small batches the host
takes longer to launch them than the accelerator to run them. So, as vLLM does, the engine captures the
forward (and LM head) of a step of one-token decodes once per padded batch size (1, 2, 4, 8, then every 16
up to engine.max_num_seqs) over static input buffers; a later decode step copies its inputs into the
buffers (asynchronously, from pinned memory) and replays the graph of the smallest size that holds it.
Padding rows decode token 0 at position 0 into the cache's scratch block, which the block manager never hands out.

A replay reads whatever lies where the capture found it: the buffers here, the weights (weight updates copy
in place), the KV cache (its reallocation, after sleep, drops the graphs, which are captured again when next
needed), the int4 key centres (written in place). Attention takes its metadata from the device alone
(kernels.paged_decode), so nothing in the forward depends on the step's host-side values. Graphs need the
Triton attention kernel (the reference would read every block of the longest context for every row); steps
with prefill chunks, prompt logprobs or more sequences than the largest size run eagerly, as everything
does with engine.enforce_eager=true and under tensor or pipeline parallelism. On CPU, traced_steps.py records
small decode steps with TorchScript instead.
"""
from __future__ import annotations

import logging
import time
import torch

from unified.engine.kv_cache import KVCache, PagedAttentionContext, StepMetadata
from unified.engine.scheduler import ScheduledSeq
from unified import kernels
from unified.kernels import registry
from unified.kernels.sources import triton_module
from unified.kernels.staging import copy_to
from unified.model.forward_context import forward_context

log = logging.getLogger(__name__)


def batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def unsupported_reason(model, cache: KVCache, device: torch.device, accelerator, distributed: bool) -> str | None:
    """Why this engine cannot replay decode graphs (on CPU: traced steps, traced_steps.py), or None when it can."""
    if distributed:
        return "not yet under tensor or pipeline parallelism"
    if getattr(model.config, "mrope_section", None) is not None:
        return "M-RoPE positions"
    if device.type == "cpu":
        return None
    if accelerator is None or accelerator.create_graph() is None:
        return "no accelerator to capture graphs on"
    layer = next(i for i, values in enumerate(cache.values) if values is not None)
    k_cache = cache.values[layer][0]
    probe = torch.empty(1, model.config.num_heads, model.config.head_dim if model.config.mla is None
                        else k_cache.shape[-1], dtype=model.dtype, device=device)
    dv = model.config.head_dim if model.config.mla is None else model.config.mla.kv_lora_rank
    if not (registry.use_triton(probe, k_cache)
            and triton_module("paged_attention").applies(probe, k_cache, dv, cache.bits)):
        return "the Triton attention kernel does not take this model's heads or this backend"
    return None


class DecodeGraphs:
    def __init__(self, model, cache: KVCache, max_num_seqs: int, max_model_len: int, device: torch.device,
                 accelerator):
        """`accelerator`: whose graphs record the forward (DeepSpeed's abstraction: create_graph, capture_to_graph,
        replay_graph); None runs the forward on the buffers again at each step instead (the tests on CPU)."""
        self.model, self.cache, self.device, self.accelerator = model, cache, device, accelerator
        self.sizes = batch_sizes(max_num_seqs)
        width = -(-max_model_len // cache.block_size)
        largest = self.sizes[-1]
        self.ids = torch.zeros(1, largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, largest, dtype=torch.long, device=device)
        self.slots = torch.zeros(largest, dtype=torch.long, device=device)
        self.tables = torch.zeros(largest, width, dtype=torch.long, device=device)
        # Context lengths in the dtype the step's attention reads: the CPU kernels' int64, Triton's int32 (a
        # conversion would be one more op per layer of every step)
        self.lens = torch.ones(largest, dtype=torch.int64 if device.type == "cpu" else torch.int32, device=device)
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.contexts: dict[int, PagedAttentionContext] = {}  # per size: the same objects at every replay
        self.pool = None
        self.generation = cache.generation

    def takes(self, batch: list[ScheduledSeq]) -> bool:
        """A step of output-token decodes that a graph holds."""
        return len(batch) <= self.sizes[-1] and all(
            item.num_new_tokens == 1 and item.samples and item.seq.num_computed_tokens >= item.seq.num_prompt_tokens
            for item in batch)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], greedy: bool = False) -> torch.Tensor:
        """float32 logits [len(batch), V] (greedy: each row's most likely token), one row per sequence in batch
        order."""
        logits = self._logits(batch)
        return kernels.argmax_rows(logits) if greedy else logits

    def _logits(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        size = next(s for s in self.sizes if s >= len(batch))
        self._fill(batch, size)
        if self.generation != self.cache.generation:
            self.clear()
            self.generation = self.cache.generation
        if self.accelerator is None:
            return self._forward(size)[:len(batch)].clone()
        if size not in self.graphs:
            self._capture(size)
        graph, logits = self.graphs[size]
        self.accelerator.replay_graph(graph)
        return logits[:len(batch)].clone()  # the next replay (of any size: one memory pool) overwrites it

    def capture_all(self) -> None:
        """Captures every size, largest first, so the smaller graphs reuse its memory."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            if size not in self.graphs:
                self._fill([], size)
                self._capture(size)
        log.info("decode graphs: captured %d batch sizes (up to %d sequences) in %.1f s", len(self.sizes),
                 self.sizes[-1], time.perf_counter() - start)

    def clear(self) -> None:
        """Drops every graph and its memory (captured again when next needed)."""
        self.graphs.clear()
        self.pool = None

    def _fill(self, batch: list[ScheduledSeq], size: int) -> None:
        block_size, pad = self.cache.block_size, size - len(batch)
        tokens, positions, slots, lens, tables = [], [], [], [], []
        for item in batch:
            seq = item.seq
            position = seq.num_computed_tokens
            tokens.append(seq.token_ids[position])
            positions.append(position)
            slots.append(seq.block_table[position // block_size] * block_size + position % block_size)
            lens.append(position + 1)
            tables.append(seq.block_table)
        width = max((len(t) for t in tables), default=1)
        copy_to(self.ids[0], tokens + [0] * pad)
        copy_to(self.positions[0], positions + [0] * pad)
        copy_to(self.slots, slots + [self.cache.scratch_block * block_size] * pad)
        copy_to(self.lens, lens + [1] * pad)
        copy_to(self.tables, [t + [0] * (width - len(t)) for t in tables] + [[self.cache.scratch_block] * width] * pad)

    def context(self, size: int) -> PagedAttentionContext:
        """The attention context of a step of `size` rows: metadata in the buffers only."""
        if size not in self.contexts:
            meta = StepMetadata(self.slots[:size], self.tables[:size], [], [], decode_lens=self.lens[:size])
            self.contexts[size] = PagedAttentionContext(self.cache, meta)
        return self.contexts[size]

    def _hidden(self, size: int) -> torch.Tensor:
        """The final hidden states [1, size, H] of the step in the buffers."""
        with forward_context(self.context(size)):
            return self.model(self.ids[:, :size], self.positions[:, :size])

    def _forward(self, size: int) -> torch.Tensor:
        return self.model.logits(self._hidden(size)[0]).float()

    def _capture(self, size: int) -> None:
        self._forward(size)  # compiles and tunes the kernels, outside the capture
        graph = self.accelerator.create_graph()
        with self.accelerator.capture_to_graph(graph, pool=self.pool):
            logits = self._forward(size)
        self.pool = self.pool if self.pool is not None else graph.pool()
        self.graphs[size] = (graph, logits)
