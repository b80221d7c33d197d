"""Before an engine serves: how many KV-cache blocks it gets, its decode graphs on an accelerator, and a warm-up
over the step shapes it will see."""
from __future__ import annotations

import logging
import os

import torch

from unified.engine.decode_graphs import DecodeGraphs, unsupported_reason
from unified.engine.kv_cache import CacheShape, kv_bits_of
from unified.engine.sampling_params import SamplingParams
from unified.engine.traced_steps import TracedDecodeSteps, untraceable_reason
from unified.errors import UserError
from unified.runtime.memory_report import log_against_plan

log = logging.getLogger(__name__)


def cache_blocks(engine, accelerator) -> int:
    """engine.num_blocks, or as many blocks as engine.kv_cache_bytes hold, or else as the memory left after a
    forward at the step's token budget holds (engine.kv_cache_memory_fraction of it, shared by a host's ranks)."""
    cfg = engine.cfg
    if cfg.num_blocks:
        return cfg.num_blocks
    per_token = CacheShape.of(engine.config, engine.tp_size).bytes_per_token(
        len(engine._cache_layers), engine.dtype, kv_bits_of(cfg.kv_cache_dtype))
    if cfg.kv_cache_bytes:
        budget = cfg.kv_cache_bytes
    else:
        _largest_forward(engine)
        budget = int(accelerator.available_memory() * cfg.kv_cache_memory_fraction)
        if engine.device.type == "cpu":  # the ranks on this host share its memory (LOCAL_SIZE: see runtime)
            budget //= int(os.environ.get("LOCAL_SIZE", "1"))
    blocks = budget // (per_token * cfg.block_size)
    if blocks < 1:
        raise UserError(f"a KV-cache budget of {budget} bytes holds no {cfg.block_size}-token block "
                        f"({per_token} bytes per token); raise engine.kv_cache_bytes or engine.kv_cache_memory_fraction")
    return blocks


@torch.inference_mode()
def _largest_forward(engine) -> None:
    """One forward at the step's token budget, so the memory left afterwards is what the cache may use."""
    cfg = engine.cfg
    tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len or engine.config.max_position_embeddings)
    ids = torch.zeros(1, tokens, dtype=torch.long, device=engine.device)
    engine.model.logits(engine.model(ids, torch.arange(tokens, device=engine.device))[:, -1])


def capture_decode_graphs(engine, accelerator) -> None:
    """Captures the engine's pure-decode steps as graphs (decode_graphs.py), where they can be; on CPU, its small
    ones as TorchScript traces (traced_steps.py), each recorded once its size has run a few steps."""
    runner, on_cpu = engine.runner, engine.device.type == "cpu"
    reason = unsupported_reason(engine.model, runner.cache, engine.device, accelerator, runner.distributed)
    if on_cpu and not reason:
        reason = untraceable_reason(engine.model)
    if runner.keeps_hidden:
        reason = "engine.speculative.method=mtp drafts from every step's hidden states"
    if reason:
        log.info("decode steps run eagerly: %s", reason)
        return
    if on_cpu:
        runner.graphs = TracedDecodeSteps(engine.model, runner.cache, engine.cfg.max_num_seqs, engine.max_model_len,
                                          engine.device)
        return
    runner.graphs = DecodeGraphs(engine.model, runner.cache, engine.cfg.max_num_seqs, engine.max_model_len,
                                 engine.device, accelerator)
    runner.graphs.capture_all()


def warm_up_shapes(engine) -> list[tuple[int, int]]:
    """(sequences, prompt tokens) batches covering the step shapes serving sees: long and short prefills, then
    decode batches from one sequence to the step's limit, as far as the cache holds them."""
    cfg, longest = engine.cfg, engine.max_model_len - 2
    prefills = [(1, min(n, longest)) for n in (16, 256, cfg.max_num_batched_tokens)]
    decodes = [(n, min(16, longest)) for n in (1, 8, cfg.max_num_seqs)]
    return [(s, n) for s, n in dict.fromkeys(prefills + decodes)
            if n > 0 and s * -(-(n + 2) // cfg.block_size) <= engine.blocks.num_blocks]


@torch.inference_mode()
def warm_up(engine, progress=None) -> None:
    """Runs every warm-up shape through the engine's real step loop, then forgets their prefixes.
    `progress(done, total)` is called after each shape."""
    shapes = warm_up_shapes(engine)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    vocab = engine.config.vocab_size
    for done, (num_seqs, num_tokens) in enumerate(shapes, start=1):
        ids = [engine.add_request([(31 * t + 131 * s + 7 * done) % vocab for t in range(num_tokens)], params,
                                  f"warm-up-{done}-{s}") for s in range(num_seqs)]
        while any(i in engine.requests for i in ids):
            engine.step()
        if progress:
            progress(done, len(shapes))
    engine.blocks.reset_prefix_cache()
    engine.runner.cache.reset_key_centres()  # centre int4 keys on real traffic, not the synthetic warm-up
    engine.runner.cache.wait_prefaulted()  # no steady-state step competes with it
    log_against_plan("after warm-up", engine.device)
