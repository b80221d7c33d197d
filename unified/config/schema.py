"""Typed schemas for every run. Hydra validates the composed config against them at start-up, so a
wrong key or type fails with a message naming it.

Top-level plain values (`model=`, `data=`, `input=`, `output=`, `prompt=`, `host=`, `port=`,
`steps=`) are the command-line contract shared by all recipes; component groups (`device`,
`parallel`, ...) are named so they never collide with them. Secrets are never fields here: code that
needs one reads it from the environment variable a field names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING


@dataclass
class DeviceConfig:
    name: str = "auto"  # auto | cpu | cuda | musa
    dtype: str = "auto"  # auto (fp32 on cpu, bf16 on accelerators) | float32 | bfloat16 | float16


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per KV-cache block
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (prefill chunks + decodes)
    chunked_prefill: bool = True
    prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (model dtype) | int8 | int4
    kv_cache_bytes: Optional[int] = None  # explicit budget; None: a fraction of free memory
    kv_cache_memory_fraction: float = 0.5  # of the memory free after weights and a warm-up pass
    num_blocks: Optional[int] = None  # fixes the cache size in blocks, overriding both budgets
    max_model_len: Optional[int] = None  # None: the model's context length
    packed_weights: bool = True  # CPU: keep MKL-packed weight copies (faster batched matmuls, more memory)


@dataclass
class ServeConfig:
    model_name: Optional[str] = None  # the name clients send as `model`; None: the model folder's name
    api_key_env: str = "UNIFIED_API_KEY"  # environment variable holding the bearer token; unset: no auth
    max_body_bytes: int = 1_048_576
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 512  # when a chat request gives none (capped by the context left)
    max_n: int = 8
    max_messages: int = 256
    warm_up: bool = True  # run representative batch shapes before reporting ready
    retry_after_s: int = 5  # Retry-After sent with 503 while starting
    shutdown_timeout_s: float = 10.0  # in-flight requests get this long after SIGTERM, then are cancelled


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    system_prompt: Optional[str] = None


@dataclass
class ParityCheckConfig:
    min_cosine: float = 0.99999
    max_abs_diff: float = 1e-3
    num_tokens: int = 64  # random tokens compared when the model has no tokenizer


@dataclass
class RunConfig:
    job: str = MISSING  # which job the recipe runs
    model: str = "smollm2"  # a checkpoint folder or a built-in model name
    data: Optional[str] = None
    input: Optional[str] = None
    output: Optional[str] = None
    prompt: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    steps: Optional[int] = None
    seed: int = 0
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    check: ParityCheckConfig = field(default_factory=ParityCheckConfig)


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    store.store(group="device", name="device_schema", node=DeviceConfig)
    store.store(group="parallel", name="parallel_schema", node=ParallelConfig)
    store.store(group="engine", name="engine_schema", node=EngineConfig)
    store.store(group="serve", name="serve_schema", node=ServeConfig)
