"""Packs a scheduled ragged batch into one forward pass and returns the logits that pick tokens.

All sequences' new tokens are concatenated into a single [1, T] batch (no padding); the attention
context tells each layer where those tokens' K/V go and which blocks each sequence reads. Only the
last position of each sequence that reaches its end this step goes through the LM head, with a
speculative draft's positions before it (unified/engine/speculative.py).

Across ranks (tensor, pipeline, expert parallel) one scheduler drives: the driver (global rank 0)
prepares each step's inputs and broadcasts them; every other rank `follow()`s, running the same
forward (its shard of it) until the driver says stop. Only the driver's logits are used. Between steps
the driver may broadcast a command instead of a step (a weight update), which every follower obeys.

Image requests (see unified/engine/multimodal.py): the driver encodes the step's uncached images in one
batched call of the vision tower and sends every rank the embedding rows of the placeholder tokens the
step computes, in token order; M-RoPE models get [3, 1, T] positions. With prefetching, the images of
requests about to run are encoded while the current step's forward is in flight: on an accelerator on a
side stream, so the tower overlaps the language model (on CPU there is nothing to overlap with).
"""
from __future__ import annotations

import logging

import torch

from unified.engine.decode_graphs import DecodeGraphs
from unified.engine.kv_cache import KVCache, PagedAttentionContext, StepMetadata
from unified.engine.multimodal import EncoderCache
from unified.engine.scheduler import ScheduledSeq
from unified.kernels.staging import to_device
from unified.model.forward_context import forward_context

log = logging.getLogger(__name__)


class ImagesFailed(Exception):
    """The vision tower fails on the images of `request_ids` (each tried alone); the step can go on without them."""

    def __init__(self, request_ids: set[str], error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.request_ids, self.error = request_ids, error


class KeepAlive:
    """A driver's message that is neither a step nor a command (see `ModelRunner.keep_alive`)."""


class ModelRunner:
    def __init__(self, model, device: torch.device, encoder_cache_bytes: int = 0, accelerator=None,
                 prefetch_images: bool | None = None, group=None):
        """`group`: the ranks that run this engine together (None: the whole world); its first rank drives."""
        self.model = model
        self.group = group
        self.driver = torch.distributed.get_global_rank(group, 0) if group is not None else 0
        self.device = device
        self.cache: KVCache | None = None
        self.graphs: DecodeGraphs | None = None  # replays pure-decode steps on accelerators (decode_graphs.py)
        self.prompt_rows: list[tuple] = []  # the last prepared step's prompt-logprob rows (see prepare)
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        self.mrope = getattr(model.config, "mrope_section", None) is not None
        on_accelerator = device.type != "cpu" and accelerator is not None
        self.prefetches = getattr(model.config, "vision", None) is not None and (
            on_accelerator if prefetch_images is None else prefetch_images)
        self.side_stream = accelerator.Stream() if self.prefetches and on_accelerator else None
        self.accelerator = accelerator
        self.keeps_hidden = False  # keep the last step's final hidden states in `hidden` (for an MTP drafter)
        self.hidden: torch.Tensor | None = None

    def prepare(self, batch: list[ScheduledSeq]) -> tuple:
        block_size = self.cache.block_size
        tokens: list[int] = []
        positions: list = []
        slots: list[int] = []
        query_start, context_lens, sample_rows = [0], [], []
        # (sequence, first prompt position, count): rows whose logits score the prompt's next tokens, after
        # the sampling rows in the logits `execute` returns
        prompt_rows: list[tuple] = []
        prompt_row_indexes: list[int] = []
        image_rows: list[tuple] = []  # (request id, span, first row, end row) in token order
        image_tokens: list[int] = []  # indexes in the step's tokens that take image rows
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            table = seq.block_table
            tokens += seq.token_ids[start:end] + item.draft
            mm = seq.multimodal
            if self.mrope:
                positions.append(mm.positions(start, end, seq.num_prompt_tokens) if mm
                                 else torch.arange(start, end).expand(3, -1))
            else:
                positions += range(start, end)
            if mm:
                for span in mm.overlapping(start, end):
                    lo, hi = max(start, span.offset), min(end, span.end)
                    image_rows.append((seq.request_id, span, lo - span.offset, hi - span.offset))
                    image_tokens += range(len(tokens) - (end - lo), len(tokens) - (end - hi))
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            query_start.append(query_start[-1] + item.num_new_tokens)
            context_lens.append(end)
            if item.samples:  # the last position's row, after one per draft token
                sample_rows += range(query_start[-1] - 1 - len(item.draft), query_start[-1])
            if seq.params.prompt_logprobs is not None and seq.index == 0 and start < seq.num_prompt_tokens - 1:
                last = min(end, seq.num_prompt_tokens - 1)  # the prompt's last row predicts the first output
                prompt_rows.append((seq, start, last - start))
                prompt_row_indexes += range(query_start[-2], query_start[-2] + last - start)
        width = max(len(item.seq.block_table) for item in batch)
        tables = to_device([item.seq.block_table + [0] * (width - len(item.seq.block_table)) for item in batch],
                           torch.long, self.device)
        meta = StepMetadata(to_device(slots, torch.long, self.device), tables, query_start, context_lens)
        ids = to_device([tokens], torch.long, self.device)
        if self.mrope:
            pos = torch.cat(positions, dim=1).unsqueeze(1).to(self.device)  # [3, 1, T]
        else:
            pos = to_device([positions], torch.long, self.device)
        images = None
        if image_rows:
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[0, image_tokens] = True
            images = (self._image_embeds(image_rows), mask)
        self.prompt_rows = prompt_rows
        return ids, pos, meta, sample_rows + prompt_row_indexes, images

    def _encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None) -> torch.Tensor:
        return self.model.encode_images(pixel_values.to(self.device, self.model.dtype),
                                        None if grid_thw is None else grid_thw.to(self.device))

    @torch.inference_mode()
    def _image_embeds(self, image_rows: list[tuple]) -> torch.Tensor:
        if self.side_stream is not None:  # rows prefetched on the side stream must be complete
            current = self.accelerator.current_stream()
            current.wait_stream(self.side_stream)
        try:
            found = self.encoder_cache.embeddings(self._encode, [span for _, span, _, _ in image_rows])
        except Exception as err:  # noqa: BLE001 - whose images? ImagesFailed names them, else it is the step's
            raise self._requests_whose_images_fail(image_rows, err) from err
        if self.side_stream is not None:  # their memory must outlive this stream's use of it
            for rows in found.values():
                rows.record_stream(current)
        return torch.cat([found[span.hash][lo:hi] for _, span, lo, hi in image_rows])

    def _requests_whose_images_fail(self, image_rows: list[tuple], err: Exception) -> Exception:
        """Encodes each request's images alone (caching those that work): ImagesFailed naming the requests
        whose own images fail, or `err` itself when every request's images encode alone."""
        by_request: dict[str, list] = {}
        for request_id, span, _, _ in image_rows:
            by_request.setdefault(request_id, []).append(span)
        failed = set()
        for request_id, spans in by_request.items():
            try:
                self.encoder_cache.embeddings(self._encode, spans)
            except Exception:  # noqa: BLE001 - this request's own images
                failed.add(request_id)
        return ImagesFailed(failed, err) if failed else err

    @torch.inference_mode()
    def prefetch_images(self, spans: list) -> None:
        """Encodes the uncached images of `spans` (of requests about to run) ahead of their step, as far as
        the encoder cache holds them; on an accelerator on the side stream, behind the work queued so far."""
        hidden, size = self.model.config.hidden_size, self.model.dtype.itemsize
        room = self.encoder_cache.max_bytes - self.encoder_cache.bytes
        todo, seen = [], set()
        for span in spans:
            need = span.num_tokens * hidden * size
            if span.hash in self.encoder_cache.entries or span.hash in seen or need > room:
                continue
            todo.append(span)
            seen.add(span.hash)
            room -= need
        if not todo:
            return
        try:
            if self.side_stream is None:
                self.encoder_cache.embeddings(self._encode, todo)
                return
            self.side_stream.wait_stream(self.accelerator.current_stream())
            with self.accelerator.stream(self.side_stream):
                self.encoder_cache.embeddings(self._encode, todo)
        except Exception:  # noqa: BLE001 - best effort: the step that needs these images finds whose they were
            log.debug("prefetching %d images failed; their step encodes them again", len(todo), exc_info=True)

    @property
    def distributed(self) -> bool:
        return self.group_size > 1

    @property
    def group_size(self) -> int:
        return torch.distributed.get_world_size(self.group)

    @property
    def group_rank(self) -> int:
        """This rank's index among the engine's ranks (0 on the driver)."""
        return torch.distributed.get_rank(self.group)

    def execute(self, batch: list[ScheduledSeq], greedy: bool = False) -> torch.Tensor:
        """Runs the step; returns float32 logits [sampling rows, V]: each sampling sequence's in batch order
        (one, or 1 + len(draft) with a speculative draft), then the rows of `prompt_rows` (prompt logprobs).
        `greedy` (no prompt rows): each sampling row's most likely token instead, int64 [sampling rows], which
        the model may find without writing the logits."""
        if self.graphs is not None and self.graphs.takes(batch):
            self.prompt_rows = []
            return self.graphs.run(batch, greedy)
        plan = (*self.prepare(batch), greedy)
        if self.distributed:
            torch.distributed.broadcast_object_list([plan], src=self.driver, group=self.group)
        return self._run(*plan)

    def follow(self, on_command) -> None:
        """On a non-driver rank: runs the driver's steps, and passes its `command()`s to `on_command`,
        until it calls `stop_followers()`."""
        while True:
            box = [None]
            torch.distributed.broadcast_object_list(box, src=self.driver, group=self.group)
            if box[0] is None:
                return
            if isinstance(box[0], KeepAlive):
                continue
            if isinstance(box[0], tuple):
                self._run(*box[0])
            else:
                on_command(box[0])

    def command(self, message) -> None:
        """On the driver, between steps: sends every follower a message that is not a step."""
        torch.distributed.broadcast_object_list([message], src=self.driver, group=self.group)

    def keep_alive(self) -> None:
        """On an idle driver: a message followers ignore, so that their wait for the next step never outlasts
        the process group's timeout (30 minutes by default) while no request comes."""
        if self.distributed:
            self.command(KeepAlive())

    def stop_followers(self) -> None:
        if self.distributed:
            torch.distributed.broadcast_object_list([None], src=self.driver, group=self.group)

    @torch.inference_mode()
    def _run(self, ids, positions, meta: StepMetadata, sample_rows: list[int],
             images: tuple[torch.Tensor, torch.Tensor] | None = None, greedy: bool = False) -> torch.Tensor:
        images = {} if images is None else {"image_embeds": images[0].to(self.device), "image_mask": images[1]}
        with forward_context(PagedAttentionContext(self.cache, meta)):
            hidden = self.model(ids, positions, **images)  # [1, T, H]
        self.hidden = hidden[0] if self.keeps_hidden else None
        if not sample_rows:
            return hidden.new_empty(0, dtype=torch.long) if greedy else hidden.new_empty(0, 0)
        rows = hidden[0].index_select(0, to_device(sample_rows, torch.long, self.device))
        return self.model.greedy_tokens(rows) if greedy else self.model.logits(rows).float()
