"""Bytes one rank of one layout holds, component by component, for serving or for training.

`serve_breakdowns` and `train_breakdown` combine the parts (inventory and weight formats, the engine's KV cache,
activations, training state) into per-rank dicts of bytes; the planner compares their sums with the card.
Serving sizes the KV cache as the engine does (unified/engine/warm_up.py `cache_blocks`): engine.num_blocks,
else engine.kv_cache_bytes, else engine.kv_cache_memory_fraction of the memory left after everything else;
every pipeline stage keeps the smallest stage's block count (the ranks agree on it), plus one scratch block.
The engine's cache keeps every block of a sequence, sliding window or not, so windows do not cap it.
With engine.speculative.method=mtp (a checkpoint with an MTP layer; no pipeline parallel) the MTP layer's weights
and its one more cache layer are counted too.
Every rank of a run also loads the checkpoint's tokenizer (the engine's and the trainer's first step after
the imports), which `tokenizer_bytes` counts.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from unified.engine.kv_cache import CacheShape, kv_bits_of
from unified.model.config import ModelConfig
from unified.model.transformer import stage_layers
from unified.plan.activations import Shards, serve_step_bytes, train_step_bytes
from unified.plan.inventory import EMBEDDING, RankTensor, Stage, mtp_tensors, rank_tensors
from unified.plan.training import training_state_bytes
from unified.plan.weight_bytes import engine_copy_bytes, weight_bytes
from unified.runtime.layout import Layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Resident bytes per vocabulary entry of a loaded `transformers` fast tokenizer (the Rust vocabulary and merges and
# their Python views): SmolLM2's 49,152-entry tokenizer (a 3.5 MB tokenizer.json) adds 58.9 MB to a fresh
# process's VmRSS (AutoTokenizer.from_pretrained after importing torch, transformers and our engine).
TOKENIZER_BYTES_PER_ENTRY = 1200


def tokenizer_bytes(config: ModelConfig) -> int:
    return config.vocab_size * TOKENIZER_BYTES_PER_ENTRY


@dataclass(frozen=True)
class Setting:
    """Everything besides the layout that decides a rank's bytes."""

    mode: str  # serve | train
    dtype: torch.dtype
    weights: str  # weight format (weight_bytes.WEIGHT_FORMATS)
    context: int  # tokens per sequence (serve) or per row (train)
    budget: int  # bytes a rank may hold
    reserve: int  # the framework's own bytes per rank
    cpu: bool  # ranks are processes on a host (CPU kernels, packed copies in float32)
    expert_load: float
    engine: object  # EngineConfig
    train: object  # TrainConfig
    head_chunk: int = 0  # CPU: vocabulary rows per chunk of a packed tied head
    panel: int = 1  # CPU: the output features a packed float32 copy rounds up to


@functools.lru_cache(maxsize=4096)
def _stage_tensors(config_key: int, layout: Layout, stage: int) -> tuple[RankTensor, ...]:
    return tuple(rank_tensors(_CONFIGS[config_key], Stage(layout, stage)))


_CONFIGS: dict[int, ModelConfig] = {}


def stage_tensors(config: ModelConfig, layout: Layout, stage: int) -> tuple[RankTensor, ...]:
    """rank_tensors, remembered per layout and stage (a search asks for the same ones many times)."""
    _CONFIGS.setdefault(id(config), config)
    return _stage_tensors(id(config), layout, stage)


def kv_bytes_per_token(config: ModelConfig, layout: Layout, stage: int, dtype: torch.dtype, kv_dtype: str,
                       extra_layers: int = 0) -> int:
    """`extra_layers`: cache layers a drafter adds (speculative.cache_layers: MTP's layer)."""
    layers = len(stage_layers(config.num_layers, layout.pipeline, stage)) + extra_layers
    return CacheShape.of(config, layout.tensor).bytes_per_token(layers, dtype, kv_bits_of(kv_dtype))


def _key_centres(config: ModelConfig, layout: Layout, stage: int, kv_dtype: str) -> int:
    """int4 GQA caches keep a float32 key centre [heads, dim] per layer (unified/engine/kv_cache.py)."""
    shape = CacheShape.of(config, layout.tensor)
    if not shape.zero_point(0, kv_bits_of(kv_dtype)):
        return 0
    return len(stage_layers(config.num_layers, layout.pipeline, stage)) * shape.heads * shape.dim * 4


def _weights(config: ModelConfig, tensors: tuple[RankTensor, ...], s: Setting, stage_is_last: bool) -> dict[str, int]:
    d = s.dtype.itemsize
    parts = weight_bytes(list(tensors), d, s.weights, s.engine.quantize_lm_head if s.mode == "serve" else False)
    if s.mode == "serve" and s.weights == "auto":
        tied = next((t.shape for t in tensors if t.kind == EMBEDDING), None) \
            if config.tie_word_embeddings and stage_is_last else None
        quantization = s.engine.quantization if s.engine.quantization in ("int8", "int4") else None
        parts["engine_copies"] = engine_copy_bytes(list(tensors), s.cpu and s.dtype == torch.float32,
                                                   s.engine.packed_weights or s.engine.quantization is not None,
                                                   quantization, s.engine.quantize_lm_head, tied, s.head_chunk,
                                                   s.panel)
    return parts


def serve_breakdowns(config: ModelConfig, layout: Layout, kv_dtype: str, s: Setting) -> tuple[list[dict], int]:
    """Per pipeline stage, the bytes of one of its ranks; and the KV cache's blocks (the same on every stage)."""
    e, d = s.engine, s.dtype.itemsize
    tokens = min(e.max_num_batched_tokens, s.context)
    rows = min(e.max_num_seqs, tokens)
    shards = Shards(layout.tensor, layout.expert)
    mtp = layout.pipeline == 1 and _drafts_with_mtp(config, e)
    stages = []
    for stage in range(layout.pipeline):
        tensors = stage_tensors(config, layout, stage)
        last = stage == layout.pipeline - 1
        parts = {"reserve": s.reserve, "tokenizer": tokenizer_bytes(config), **_weights(config, tensors, s, last)}
        if mtp:
            parts["mtp_layer"] = weight_bytes(mtp_tensors(config, layout), d)["weights"]
        layers = stage_layers(config.num_layers, layout.pipeline, stage)
        parts["activations"] = serve_step_bytes(config, layers, tokens, rows, shards, d, s.expert_load, last,
                                                e.image_cache_bytes if stage == 0 else 0)
        stages.append(parts)
    per_token = [kv_bytes_per_token(config, layout, st, s.dtype, kv_dtype, int(mtp)) for st in range(layout.pipeline)]
    if e.num_blocks:
        blocks = e.num_blocks
    else:
        budgets = [e.kv_cache_bytes] * layout.pipeline if e.kv_cache_bytes else \
            [int(max(0, s.budget - sum(parts.values())) * e.kv_cache_memory_fraction) for parts in stages]
        blocks = min(b // (p * e.block_size) for b, p in zip(budgets, per_token))
    for stage, parts in enumerate(stages):
        parts["kv_cache"] = (blocks + 1) * e.block_size * per_token[stage] + _key_centres(config, layout, stage,
                                                                                           kv_dtype)
    return stages, blocks


def _drafts_with_mtp(config: ModelConfig, e) -> bool:
    spec = getattr(e, "speculative", None)
    return spec is not None and spec.method == "mtp" and config.num_mtp_layers > 0


def train_breakdown(config: ModelConfig, layout: Layout, cards: int, s: Setting) -> tuple[dict, dict]:
    """(device, host) bytes of one rank (training runs without pipeline or expert parallelism)."""
    from unified.train.engine import resolve_zero_stage

    t, d = s.train, s.dtype.itemsize
    tensors = stage_tensors(config, layout, 0)
    params = sum(x.numel for x in tensors if not x.buffer)
    trainable = _trainable(config, tensors, t)
    dp = layout.data(cards)
    stage = resolve_zero_stage(t, dp)
    always, backward, step, host = training_state_bytes(
        params, trainable, _largest_unit(tensors), d, stage, dp, t.offload_optimizer, t.offload_params,
        min(trainable, max((x.numel for x in tensors if not x.buffer), default=0)), t.gradient_accumulation_steps)
    buffers = sum(x.numel * (4 if x.float32 else d) for x in tensors if x.buffer)
    backward["activations"] = train_step_bytes(config, range(config.num_layers), t.micro_batch_size, s.context,
                                               Shards(layout.tensor, 1), d, s.expert_load, True,
                                               t.activation_checkpointing, t.sequence_parallel and layout.tensor > 1,
                                               t.packing)
    fullest = max(backward, step, key=lambda moment: sum(moment.values()))  # (training.py: a step's two moments)
    return {"reserve": s.reserve, "tokenizer": tokenizer_bytes(config), **always, "buffers": buffers, **fullest}, host


def _trainable(config: ModelConfig, tensors: tuple[RankTensor, ...], t) -> int:
    """Trainable parameters on the rank: all, the vision tower (+ projector), the projector, or LoRA adapters of
    rank r on every 2-D decoder projection (stacked experts too with train.lora.experts): r (rows + columns) each."""
    if t.lora.rank > 0:
        total = 0
        for x in tensors:
            if x.kind == "projection":
                *lead, rows, cols = x.shape
                if lead and not t.lora.experts:
                    continue
                total += (lead[0] if lead else 1) * t.lora.rank * (rows + cols)
        return total
    if t.trainable == "vision":
        return sum(x.numel for x in tensors if x.name.startswith("vision.") and not x.buffer)
    if t.trainable == "projector":
        return sum(x.numel for x in tensors if x.name.startswith("vision.projector.") and not x.buffer)
    return sum(x.numel for x in tensors if not x.buffer)


def _largest_unit(tensors: tuple[RankTensor, ...]) -> int:
    """Parameters of the largest module ZeRO-3 gathers at once: a decoder layer, or a top-level tensor."""
    units: dict[str, int] = {}
    for x in tensors:
        if x.buffer:
            continue
        parts = x.name.split(".")
        key = ".".join(parts[:2]) if parts[0] in ("layers", "vision") else x.name
        units[key] = units.get(key, 0) + x.numel
    return max(units.values(), default=0)
