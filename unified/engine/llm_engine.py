"""The engine loop: requests in, one scheduled forward per step, tokens and finished outputs out.

`step()` = schedule -> model runner -> sampler -> postprocess (append tokens, stop checks, free the
blocks of finished sequences). A request with n > 1 becomes n sequences; its output is complete when
all of them are. Bad requests raise `InvalidRequest` from `add_request` and leave the engine as it was.
A failure in one request's share of a step (its sampling, stop check or detokenisation) ends that request
alone, with `RequestOutput.error`; a failing forward pass fails the step, as it is no one request's fault.
"""
from __future__ import annotations

import itertools
import logging
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state

from unified.engine.block_manager import BlockManager
from unified.engine.kv_cache import KVCache
from unified.engine.model_runner import ImagesFailed, ModelRunner
from unified.engine.mtp import MTPForward
from unified.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from unified.engine.multimodal import MultimodalPrompt, multimodal_prompt
from unified.engine.sampler import prompt_logprob_entry, sample
from unified.engine.sampling_params import InvalidRequest, SamplingParams
from unified.engine.scheduler import Scheduler
from unified.engine.sequence import Sequence
from unified.engine.speculative import DrafterCommand, cache_layers, speculator_for
from unified.engine.trainer_link import COMMANDS as TRAINER_COMMANDS, TrainerLink
from unified.engine.warm_up import cache_blocks, capture_decode_graphs, warm_up, warm_up_shapes
from unified.engine.weight_update import UpdateWeights, WeightMismatch, copy_weights, stage_weights
from unified.errors import UserError
from unified.kernels import QUANTIZATIONS, cpu_ops
from unified.model.calibration import calibrate_for_serving
from unified.runtime.host_memory import back_with_huge_pages, retain_freed_host_memory
from unified.runtime.memory_report import log_against_plan

log = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)


def _plain_greedy(params: SamplingParams) -> bool:
    """Argmax of the raw logits is all `sample` does for these: no penalties, no logprobs of any kind."""
    return (params.greedy and params.repetition_penalty == 1.0 and not params.presence_penalty
            and not params.frequency_penalty and params.logprobs is None and params.prompt_logprobs is None)


class LLMEngine:
    def __init__(self, model, tokenizer, engine_cfg, device: torch.device, dtype: torch.dtype, accelerator,
                 eos_token_ids: set[int] | None = None, image_processor=None, group=None, draft_model=None):
        """`group`: the ranks that run this engine together (None: the whole world); its first rank drives.
        `draft_model`: engine.speculative.method=draft's model (same vocabulary), run in an engine of its own."""
        self.model, self.tokenizer, self.cfg = model, tokenizer, engine_cfg
        self.image_processor = image_processor  # vision-language models: turns request images into pixels
        self.config = model.config
        self.device, self.dtype = device, dtype
        self.eos_token_ids = set(eos_token_ids or ())
        if device.type == "cpu":
            retain_freed_host_memory()  # steps would otherwise fault their activations in afresh
            cpu_ops.cache_host_allocations()  # those above glibc's 32 MiB heap limit too (builds the kernels now)
        model.weight_quantization = self.served_quantization(engine_cfg)
        model.quantize_head, model.head_rescore = engine_cfg.quantize_lm_head, engine_cfg.quantized_head_rescore
        calibrate_for_serving(model, tokenizer, engine_cfg.quantization_calibration)
        if self.packs_weights:
            model.pack_weights()
        self._weights_on_huge_pages()
        self.runner = ModelRunner(model, device, engine_cfg.image_cache_bytes, accelerator, engine_cfg.image_prefetch,
                                  group)
        self.is_driver = torch.distributed.get_rank() == self.runner.driver
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        num_blocks = cache_blocks(self, accelerator)
        if self.runner.distributed:  # every rank must hold the blocks the driver hands out
            agreed = torch.tensor([num_blocks], device=device)  # NCCL reduces device tensors only
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=group)
            num_blocks = int(agreed.item())
        self.runner.cache = KVCache(self.config, num_blocks, engine_cfg.block_size, dtype, device,
                                    engine_cfg.kv_cache_dtype, self.tp_size, self._cache_layers)
        self.blocks = BlockManager(num_blocks, engine_cfg.block_size, engine_cfg.prefix_caching)
        self.scheduler = Scheduler(self.blocks, engine_cfg.max_num_seqs, engine_cfg.max_num_batched_tokens,
                                   engine_cfg.chunked_prefill)
        context = engine_cfg.max_model_len or self.config.max_position_embeddings
        self.max_model_len = min(context, num_blocks * engine_cfg.block_size)
        if self.max_model_len < context:
            log.warning("the KV cache holds %d tokens, fewer than the %d-token context; sequences stop there",
                        self.max_model_len, context)
        self.speculator = speculator_for(self, draft_model, accelerator)
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.weights_version = 0  # how many times update_weights replaced the weights
        self._pack_pending = False  # the weights changed: pack them again before the next step
        self.link = TrainerLink(self)  # an external RL trainer's weight updates and sleep mode
        if not engine_cfg.enforce_eager:
            capture_decode_graphs(self, accelerator)
        cache = self.runner.cache
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %d bytes/token)", num_blocks,
                 engine_cfg.block_size, num_blocks * engine_cfg.block_size, cache.total_bytes / 2 ** 20,
                 engine_cfg.kv_cache_dtype, cache.bytes_per_token)

    @property
    def packs_weights(self) -> bool:
        """Whether the model's matmuls read copies of the weights made for inference (packed, or quantized)."""
        return self.cfg.packed_weights or self.cfg.quantization is not None

    @property
    def _cache_layers(self) -> list[int]:
        """The layers whose K/V this rank caches: its stage's, and a drafter's after the model's."""
        return [*self.model.stage.layers, *cache_layers(self.cfg.speculative, self.config)]

    @staticmethod
    def served_quantization(cfg) -> str | None:
        """The weight-only copies the linears are served as ("int8", "int4"), None for the weights as loaded; a
        clear error for a setting that cannot run."""
        if cfg.quantized_head_rescore < 0:
            raise UserError(f"engine.quantized_head_rescore={cfg.quantized_head_rescore}: give a count of logits per "
                            f"row (8 by default), or 0 to turn rescoring off")
        if cfg.quantization is None or cfg.quantization in QUANTIZATIONS:
            return cfg.quantization
        if cfg.quantization == "fp8":
            raise UserError("engine.quantization=fp8 is not available for full-precision weights yet: use int8 or "
                            "int4, or load a checkpoint already quantized to it (block-FP8 checkpoints load as they "
                            "are)")
        raise UserError(f"engine.quantization={cfg.quantization!r} is unknown; use int8, int4, or null")

    def warm_up_shapes(self) -> list[tuple[int, int]]:
        """(sequences, prompt tokens) batches covering the step shapes serving sees (warm_up.py)."""
        return warm_up_shapes(self)

    def warm_up(self, progress=None) -> None:
        """Runs every warm-up shape through the real step loop, then forgets their prefixes; `progress(done,
        total)` is called after each shape (warm_up.py)."""
        warm_up(self, progress)

    def stats(self) -> EngineStats:
        size, filled = self.cfg.block_size, {}
        for seq in self.scheduler.running:
            for i, block_id in enumerate(seq.block_table):
                tokens = min(size, max(0, seq.num_computed_tokens - i * size))
                filled[block_id] = max(filled.get(block_id, 0), tokens)
        allocated = len(filled) * size
        blocks = self.blocks
        return EngineStats(
            running_requests=len({s.request_id for s in self.scheduler.running}),
            waiting_requests=len({s.request_id for s in self.scheduler.waiting}),
            used_blocks=blocks.num_used_blocks, total_blocks=blocks.num_blocks,
            fragmentation=1 - sum(filled.values()) / allocated if allocated else 0.0,
            prefix_hit_rate=blocks.hit_tokens / blocks.queried_tokens if blocks.queried_tokens else 0.0,
            preemptions=self.scheduler.num_preemptions, prefix_queried_tokens=blocks.queried_tokens,
            prefix_hit_tokens=blocks.hit_tokens, spec=self.speculator.stats if self.speculator else None)

    def follow(self, ignore_signals: bool = True) -> None:
        """Non-driver ranks: serve the driver's steps until it releases them (`release_followers`, or its
        shutdown). A server's followers ignore the launcher's signals (`ignore_signals`), see below."""
        assert not self.is_driver
        if ignore_signals and threading.current_thread() is threading.main_thread():
            # A launcher signals every rank; followers end when the driver, shutting down, releases them.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
        self.runner.follow(self._follow_command)

    def _follow_command(self, command) -> None:
        if isinstance(command, TRAINER_COMMANDS):
            self.link.follow(command)
            return
        if isinstance(command, (DrafterCommand, MTPForward)):
            self.speculator.drafter.follow(command)
            return
        try:
            staged, error = stage_weights(command.path, self.model, self.dtype), None
        except Exception as err:  # noqa: BLE001 - the driver reports it; this rank must stay in step
            staged, error = None, f"{type(err).__name__}: {err}"
        try:
            self._swap_weights(staged, error)
        except WeightMismatch as err:
            log.warning("weights not updated: %s", err)

    def update_weights(self, path: str, staged: dict[str, torch.Tensor]) -> int:
        """Driver, between steps: replaces the weights with `staged` (from `stage_weights(path, ...)`) on
        every rank; followers stage their own shard of `path`. Returns the new weights version.

        Requests in flight go on with the new weights over K/V computed with the old ones (as weight
        updates in vLLM do); the prefix cache is emptied and those requests publish no more blocks to it,
        so no request admitted after the swap reuses K/V of the old weights. If any rank cannot stage
        its shard, no rank swaps and WeightMismatch says why."""
        self.link.check_weights_present()
        if self.runner.distributed:
            self.runner.command(UpdateWeights(str(path)))
        self._swap_weights(staged, None)
        return self.weights_version

    def _swap_weights(self, staged: dict[str, torch.Tensor] | None, error: str | None) -> None:
        if self.runner.distributed:  # every rank swaps, or none
            errors = [None] * torch.distributed.get_world_size(self.runner.group)
            torch.distributed.all_gather_object(errors, error, group=self.runner.group)
            failed = [f"rank {rank}: {e}" for rank, e in enumerate(errors) if e]
            if failed:
                raise WeightMismatch(f"the served weights were kept: {'; '.join(failed)}")
        copy_weights(self.model, staged)
        self.link.weights_missing = False
        self.weights_changed()

    def repack_weights(self) -> None:
        """Packed copies of the current weights, now (no-op without engine.packed_weights or quantization)."""
        self._pack_pending = self.packs_weights
        self._pack_now()

    def _pack_now(self) -> None:
        if self._pack_pending:
            self.model.pack_weights()
            self._pack_pending = False
            self._weights_on_huge_pages()

    def _weights_on_huge_pages(self) -> None:
        """On the host, the weights and their copies go onto huge pages: decode steps stream them."""
        if self.device.type == "cpu":
            start = time.perf_counter()
            huge = back_with_huge_pages(self.model.inference_tensors())
            log.info("weights on huge pages: %.0f MiB (%.2f s)", huge / 2 ** 20, time.perf_counter() - start)

    def weights_changed(self) -> None:
        """After the weights changed in place (all of them): the packed copies of the old ones go (a receive
        straight into the weights may not tell them they are stale) and new ones come before the next step,
        which the driver takes only after the caller has its answer; no prefix stays cached with the old
        weights."""
        if self.packs_weights:
            self.model.unpack_weights()
            self._pack_pending = True
            if not self.is_driver and not self.link.sleep_level:  # a follower's next step may come at once
                self._pack_now()
        self.blocks.reset_prefix_cache()
        self.runner.encoder_cache.clear()  # the vision tower may have changed too
        for request in self.requests.values():
            for seq in request.seqs:
                seq.publishes_blocks = not seq.block_table
        self.weights_version += 1

    def release_followers(self) -> None:
        """Driver: ends the `follow` of the ranks that follow it (a no-op in one process); they may follow again."""
        if self.is_driver:
            self.runner.stop_followers()

    def shutdown(self) -> None:
        """Driver: releases the ranks that follow it for good."""
        self.release_followers()
        if self.speculator is not None:
            self.speculator.log_progress(final=True)
        log_against_plan("over the run (the plan counts the whole KV cache; a short run may not have committed it)",
                         self.device)

    # Requests ---------------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, images=None) -> str:
        """`images` (file paths, bytes, data URLs or PIL images, or unified.vision.ImageInputs the model's
        processor made of them) go with a prompt that holds the image placeholder once per image."""
        params = params or SamplingParams()
        params.validate()
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty; send at least one token")
        multimodal = None
        if images is not None and (not isinstance(images, list) or images):
            ids, multimodal = self._with_images(ids, images)
        elif self.config.vision is not None and self.config.image_token_id in ids:
            raise InvalidRequest(f"the prompt has {ids.count(self.config.image_token_id)} image placeholder(s) (token "
                                 f"id {self.config.image_token_id}) but no image came with it; send the image with "
                                 f"it, or leave the image marker out of text")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens but the model's context is {self.max_model_len}; "
                                 f"shorten the prompt")
        if not self.cfg.chunked_prefill and len(ids) > self.cfg.max_num_batched_tokens:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens, more than engine.max_num_batched_tokens="
                                 f"{self.cfg.max_num_batched_tokens} with chunked prefill off")
        placeholder = self.config.image_token_id if multimodal is not None else None
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in ids if t != placeholder):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        if any(not (isinstance(t, int) and 0 <= t < vocab) for t in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be token ids in [0, {vocab}), got {params.stop_token_ids}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        base_seed = params.seed if params.seed is not None else random.getrandbits(63)
        request = _Request(request_id, ids, params)
        for i in range(params.n):
            seq = Sequence(request_id, i, ids, params, seed=base_seed + i, multimodal=multimodal)
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request_id

    def _with_images(self, ids: list[int], images) -> tuple[list[int], MultimodalPrompt]:
        if self.config.vision is None or self.image_processor is None:
            raise InvalidRequest("this model takes no image input; send text only, or serve a vision-language model")
        try:
            return multimodal_prompt(ids, images, self.image_processor, self.config)
        except UserError as err:
            raise InvalidRequest(str(err)) from err

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else ():
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def sequences(self, request_id: str) -> list[Sequence]:
        """The n sequences of an unfinished request (read-only: for streaming their tokens as they grow)."""
        return self.requests[request_id].seqs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def release_kv_cache(self) -> int:
        """Frees the KV cache's memory between uses (colocated training takes it meanwhile), forgetting
        every cached prefix; returns the bytes freed. Only while no request is unfinished."""
        if self.requests:
            raise RuntimeError(f"the KV cache is in use by {len(self.requests)} unfinished requests")
        cache = self.runner.cache
        if not cache.allocated:
            return 0
        self.blocks.reset_prefix_cache()
        if self.runner.graphs is not None:  # their memory too; captured again when next needed
            self.runner.graphs.clear()
        cache.release()
        return cache.total_bytes

    def restore_kv_cache(self) -> None:
        """Takes the KV cache's memory back (empty) after `release_kv_cache`."""
        if not self.runner.cache.allocated:
            self.runner.cache.allocate()

    # The loop ---------------------------------------------------------------------------------------

    def step(self, choose=sample) -> list[RequestOutput]:
        """One forward pass; returns the requests that finished in it.

        `choose(logits [S, V], seqs) -> (token ids, logprob entries)` picks the next tokens; the default
        samples, and teacher forcing (scoring given continuations) passes its own. A row's token may be an
        exception instead, when choosing it failed: that request ends with the error, as it does when its
        stop check or detokenisation raises, or the vision tower fails on its images, and the step goes on
        for the others.
        """
        if not self.runner.cache.allocated:
            raise RuntimeError("the KV cache was released: restore_kv_cache() before stepping")
        self._pack_now()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running if choose is sample else [])
        batch = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.drafter.before_forward(batch)
        outputs: dict[str, RequestOutput] = {}
        greedy = choose is sample and all(_plain_greedy(item.seq.params) for item in batch)
        try:
            logits = self.runner.execute(batch, greedy) if batch else None
        except ImagesFailed as failure:  # the step goes on without the requests whose images the tower refuses
            outputs = {request_id: self._fail(request_id, failure.error) for request_id in failure.request_ids}
            batch = [item for item in batch if item.seq.request_id not in failure.request_ids]
            logits = self.runner.execute(batch, greedy) if batch else None
        if not batch:
            return list(outputs.values())
        if self.runner.prefetches:  # while the forward is in flight on an accelerator
            self.runner.prefetch_images(self._upcoming_images(batch))
        sampling = [item for item in batch if item.samples]
        num_rows = sum(1 + len(item.draft) for item in sampling)
        if self.runner.prompt_rows:
            self._score_prompts(logits[num_rows:])
            logits = logits[:num_rows]
        tokens, entries = self._choose_tokens(sampling, logits, greedy, choose)
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens - len(item.draft)  # drafts count once accepted
            item.seq.draft = []
            self.blocks.register_full_blocks(item.seq)
        for item, seq_tokens, seq_entries in zip(sampling, tokens, entries):
            seq, request_id = item.seq, item.seq.request_id
            if request_id in outputs:  # another of its n sequences failed earlier in this step
                continue
            try:
                for token, entry in zip(seq_tokens, seq_entries):
                    if isinstance(token, Exception):
                        raise token
                    seq.append(token)
                    if entry is not None:
                        seq.logprobs.append(entry)
                    self._check_stop(seq, token)
                    if seq.is_finished:
                        break
                if item.draft and not seq.is_finished:  # the accepted drafts' K/V stand; the rest are overwritten
                    seq.num_computed_tokens = seq.num_tokens - 1
                    self.blocks.register_full_blocks(seq)
                    self.blocks.trim(seq)
                if self._finished(request_id):
                    outputs[request_id] = self._pop_output(request_id)
            except Exception as err:  # noqa: BLE001 - this request's own failure: end it, step on for the others
                outputs[request_id] = self._fail(request_id, err)
        if self.speculator is not None:
            self.speculator.drafter.after_step(batch)
            self.speculator.log_progress()
        return list(outputs.values())

    def _choose_tokens(self, sampling: list, logits: torch.Tensor, greedy: bool, choose) -> tuple[list, list]:
        """Per sampling sequence, the tokens it gains this step and their logprob entries: one token, or with a
        speculative draft the accepted drafts and the target's next token. `logits` holds each sequence's rows
        in order (1 + len(draft)); with `greedy` they are the rows' argmax token ids instead."""
        if not any(item.draft for item in sampling):  # one row per sequence
            if greedy:  # the runner chose the tokens (`sample` would take the same argmax)
                return [[t] for t in logits.tolist()], [[None]] * len(sampling)
            tokens, entries = choose(logits, [item.seq for item in sampling]) if sampling else ([], [])
            return [[t] for t in tokens], [[e] for e in entries]
        starts = list(itertools.accumulate((1 + len(item.draft) for item in sampling), initial=0))
        ids = logits.tolist() if greedy else None
        tokens, entries = [None] * len(sampling), [None] * len(sampling)
        plain = [i for i, item in enumerate(sampling) if not item.draft]
        if plain and greedy:
            for i in plain:
                tokens[i], entries[i] = [ids[starts[i]]], [None]
        elif plain:
            rows = logits.index_select(0, torch.tensor([starts[i] for i in plain], device=logits.device))
            for i, token, entry in zip(plain, *choose(rows, [sampling[i].seq for i in plain])):
                tokens[i], entries[i] = [token], [entry]
        for i, item in enumerate(sampling):
            if item.draft:
                rows = slice(starts[i], starts[i + 1])
                try:
                    tokens[i], entries[i] = self.speculator.verify(item.seq, item.draft, None if greedy else logits[rows],
                                                                   ids[rows] if greedy else None)
                except Exception as err:  # noqa: BLE001 - this request's own failure, as `choose` reports it
                    tokens[i], entries[i] = [err], [None]
        return tokens, entries

    def _score_prompts(self, logits: torch.Tensor) -> None:
        """The raw log-probability (and the top k) of each prompt token the step's prompt rows predict."""
        row = 0
        for seq, start, count in self.runner.prompt_rows:
            chunk = logits[row:row + count].float().log_softmax(-1)
            row += count
            targets = seq.token_ids[start + 1:start + 1 + count]
            seq.prompt_logprobs += [prompt_logprob_entry(lp, token, seq.params.prompt_logprobs)
                                    for lp, token in zip(chunk, targets)]

    def _upcoming_images(self, batch) -> list:
        """Images of running and waiting sequences (in the order they run) that the steps after this one need."""
        this_step = {id(item.seq): item.num_new_tokens for item in batch}
        spans = []
        waiting = itertools.islice(self.scheduler.waiting, self.cfg.max_num_seqs)
        for seq in itertools.chain(self.scheduler.running, waiting):
            if seq.multimodal is not None:
                done = seq.num_computed_tokens + this_step.get(id(seq), 0)
                spans += [span for span in seq.multimodal.images if span.end > done]
        return spans

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self.scheduler.finish(seq, "stop")
        elif p.stop and self._stop_string_hit(seq):
            self.scheduler.finish(seq, "stop")
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self.scheduler.finish(seq, "length")

    def _stop_string_hit(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        tail = self.tokenizer.decode(seq.output_token_ids[-(longest + 4):], skip_special_tokens=True)
        return any(s in tail for s in seq.params.stop)

    def _finished(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        return request is not None and all(s.is_finished for s in request.seqs)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        token_ids = seq.output_token_ids
        if seq.finish_reason == "stop" and token_ids and (token_ids[-1] in self.eos_token_ids
                                                          or token_ids[-1] in seq.params.stop_token_ids):
            token_ids = token_ids[:-1]
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""
        for stop in seq.params.stop:
            if stop in text:
                text = text[:text.index(stop)]
        return CompletionOutput(seq.index, text, seq.output_token_ids, seq.finish_reason,
                                seq.logprobs if seq.params.logprobs is not None else None)

    def _pop_output(self, request_id: str) -> RequestOutput:
        request = self.requests[request_id]
        completions = [self._completion(s) for s in request.seqs]  # may raise: the request is still there to fail
        del self.requests[request_id]
        first = request.seqs[0]
        prompt_logprobs = [None, *first.prompt_logprobs] if first.params.prompt_logprobs is not None else None
        return RequestOutput(request_id, request.prompt_token_ids, completions, True,
                             max(s.num_cached_prompt_tokens for s in request.seqs), prompt_logprobs=prompt_logprobs)

    def _fail(self, request_id: str, err: Exception) -> RequestOutput:
        """Ends a request whose own share of a step raised, freeing its blocks as an abort does. Its outputs
        keep their tokens but no text, since detokenising may be what failed. The followers of a
        distributed engine see it as they see any finished request: its blocks are simply not scheduled again."""
        log.error("request %s failed and was ended: %s: %s", request_id, type(err).__name__, err, exc_info=err)
        request = self.requests.pop(request_id)
        for seq in request.seqs:
            self.scheduler.finish(seq, "error")
        return RequestOutput(request_id, request.prompt_token_ids,
                             [CompletionOutput(s.index, "", s.output_token_ids, s.finish_reason,
                                               s.logprobs if s.params.logprobs is not None else None)
                              for s in request.seqs],
                             True, max(s.num_cached_prompt_tokens for s in request.seqs),
                             error=f"{type(err).__name__}: {err}")
