"""The paged KV cache and the attention context the model runner sets for each forward pass.

Per layer: K and V caches [num_blocks, block_size, kv_heads, head_dim] for GQA, or one latent cache
[num_blocks, block_size, 1, kv_lora_rank + rope_dim] for MLA. Quantised caches store int8 values (or
int4 packed two per byte) plus one fp32 scale per token per head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from unified.errors import UserError
from unified.model.config import ModelConfig

KV_BITS = {"auto": None, "int8": 8, "int4": 4}


def kv_bits_of(kv_cache_dtype: str) -> int | None:
    if kv_cache_dtype not in KV_BITS:
        raise UserError(f"engine.kv_cache_dtype={kv_cache_dtype!r} is not supported; choose {', '.join(KV_BITS)}")
    return KV_BITS[kv_cache_dtype]


@dataclass(frozen=True)
class CacheShape:
    """What one token occupies in one layer: `entries` tensors (K and V, or one latent) of heads x dim."""

    entries: int
    heads: int
    dim: int

    @staticmethod
    def of(config: ModelConfig, tp_size: int = 1) -> "CacheShape":
        if config.mla is not None:
            return CacheShape(1, 1, config.mla.kv_lora_rank + config.mla.qk_rope_head_dim)
        return CacheShape(2, max(config.num_kv_heads // tp_size, 1), config.head_dim)

    def bytes_per_token(self, num_layers: int, dtype: torch.dtype, bits: int | None) -> int:
        if bits is None:
            per_head = self.dim * dtype.itemsize
        else:
            per_head = kernels.packed_dim(self.dim, bits) + 4  # values + fp32 scale
        return num_layers * self.entries * self.heads * per_head


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str = "auto", tp_size: int = 1, layers=None):
        """`layers`: the global indices of the layers this rank runs (a pipeline stage's); None: all."""
        layers = set(range(config.num_layers) if layers is None else layers)
        self.bits = kv_bits_of(kv_cache_dtype)
        self.shape = CacheShape.of(config, tp_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        storage_dtype = dtype if self.bits is None else (torch.int8 if self.bits == 8 else torch.uint8)
        dim = kernels.packed_dim(self.shape.dim, self.bits)
        shape = (num_blocks, block_size, self.shape.heads, dim)
        # torch.empty: pages are committed as they are written, and every slot is written before it is read.
        self.values = [[torch.empty(shape, dtype=storage_dtype, device=device) for _ in range(self.shape.entries)]
                       if i in layers else None for i in range(config.num_layers)]
        self.scales = [[torch.empty(shape[:3], dtype=torch.float32, device=device) if self.bits else None
                        for _ in range(self.shape.entries)] if i in layers else None for i in range(config.num_layers)]
        self.bytes_per_token = self.shape.bytes_per_token(len(layers), dtype, self.bits)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_blocks * self.block_size


@dataclass
class StepMetadata:
    """Where this step's tokens go and what each sequence attends to; built by the model runner."""

    slots: torch.Tensor  # [T] flat cache slot of each new token
    block_tables: torch.Tensor  # [S, max_blocks]
    query_start: list[int]  # [S + 1]
    context_lens: list[int]  # [S]


class PagedAttentionContext:
    """Forward context: writes each layer's new K/V into the cache, then attends over the pages."""

    def __init__(self, cache: KVCache, meta: StepMetadata):
        self.cache, self.meta = cache, meta

    def _paged(self, layer: int, q: torch.Tensor, scale: float, sliding_window: int | None,
               v_dim: int | None) -> torch.Tensor:
        values, scales = self.cache.values[layer], self.cache.scales[layer]
        v_cache = values[1] if len(values) == 2 else None
        v_scale = scales[1] if len(scales) == 2 else None
        return kernels.paged_attention(q, values[0], v_cache, self.meta.block_tables, self.meta.query_start,
                                       self.meta.context_lens, scale, sliding_window=sliding_window,
                                       k_scale=scales[0], v_scale=v_scale, kv_bits=self.cache.bits, v_head_dim=v_dim)

    def attend(self, layer, q, k, v, scale, sliding_window):
        values, scales = self.cache.values[layer], self.cache.scales[layer]
        kernels.write_kv(values[0], scales[0], k[0], self.meta.slots, self.cache.bits)
        kernels.write_kv(values[1], scales[1], v[0], self.meta.slots, self.cache.bits)
        return self._paged(layer, q[0], scale, sliding_window, None).unsqueeze(0)

    def attend_latent(self, layer, q, kv, v_dim, scale):
        kernels.write_kv(self.cache.values[layer][0], self.cache.scales[layer][0], kv[0], self.meta.slots,
                         self.cache.bits)
        return self._paged(layer, q[0], scale, None, v_dim).unsqueeze(0)
