"""The paged KV cache and the attention context the model runner sets for each forward pass.

Per layer: K and V caches [num_blocks, block_size, kv_heads, head_dim] for GQA, or one latent cache
[num_blocks, block_size, 1, kv_lora_rank + rope_dim] for MLA. Quantised caches store int8 values plus
one fp32 scale per token per head, or int4 values packed two per byte plus an fp16 scale per 32
channels (unified/kernels/kv_quant.py). int4 GQA keys also keep an fp16 zero per 32 channels and are centred on
a per-layer constant, the mean of the first keys the layer writes: any constant is exact for attention,
and this one removes the large per-channel offset that would otherwise take most of the int4 range.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from unified import kernels
from unified.errors import UserError
from unified.model.config import ModelConfig
from unified.runtime.host_memory import prefault_in_background

KV_BITS = {"auto": None, "int8": 8, "int4": 4}


def kv_bits_of(kv_cache_dtype: str) -> int | None:
    if kv_cache_dtype not in KV_BITS:
        raise UserError(f"engine.kv_cache_dtype={kv_cache_dtype!r} is not supported; choose {', '.join(KV_BITS)}")
    return KV_BITS[kv_cache_dtype]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. Attention reads whole blocks, past a sequence's last token too: those
    slots are masked, but a masked NaN still poisons the sum (0 * NaN), so no slot may hold garbage. On
    CPU the zeros come from calloc (numpy), whose fresh pages are committed only when first written, as
    torch.empty's would be; torch.zeros would touch, and so commit, the whole budget at start."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    align = 64
    raw = torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize + align, dtype=np.uint8))
    start = -raw.data_ptr() % align
    return raw[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


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
            return num_layers * self.entries * self.heads * self.dim * dtype.itemsize
        per_head = 0
        for entry in range(self.entries):
            trailing, scale_dtype = kernels.scale_layout(self.dim, bits, self.zero_point(entry, bits))
            per_head += kernels.packed_dim(self.dim, bits) + scale_dtype.itemsize * math.prod(trailing)
        return num_layers * self.heads * per_head

    def zero_point(self, entry: int, bits: int | None) -> bool:
        """int4 GQA keys (entry 0 of 2) are centred and asymmetric; see unified/kernels/kv_quant.py."""
        return bits == 4 and self.entries == 2 and entry == 0


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str = "auto", tp_size: int = 1, layers=None):
        """`layers`: the global indices of the layers this rank runs (a pipeline stage's, and an MTP layer's
        after the model's own, see unified/model/mtp.py); None: all of the model's."""
        layers = set(range(config.num_layers) if layers is None else layers)
        num_layers = max(config.num_layers, max(layers, default=-1) + 1)
        self.bits = kv_bits_of(kv_cache_dtype)
        self.shape = CacheShape.of(config, tp_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        # One block more than the block manager hands out: decode graphs' padding rows write and read it
        self.scratch_block = num_blocks
        self._layout = (num_layers, layers, (num_blocks + 1, block_size), dtype, device)
        # int4 GQA keys: each layer's centre [heads, dim] fp32, written in place (captured decode graphs read
        # it where it lies), and whether the layer has set it yet
        self.key_centres: list[torch.Tensor | None] = [None] * num_layers
        self.key_centred = [False] * num_layers
        self.generation = 0  # counts allocations: whatever holds the cache tensors' addresses checks it
        self.bytes_per_token = self.shape.bytes_per_token(len(layers), dtype, self.bits)
        self.prefaulting: threading.Thread | None = None  # a CPU cache's pages being committed (allocate)
        self.allocate()

    def allocate(self) -> None:
        """(Re)creates the zeroed cache tensors; their contents are gone."""
        num_layers, layers, blocks, dtype, device = self._layout
        storage_dtype = dtype if self.bits is None else (torch.int8 if self.bits == 8 else torch.uint8)
        shape = (*blocks, self.shape.heads, kernels.packed_dim(self.shape.dim, self.bits))
        self.values = [[zeroed(shape, storage_dtype, device) for _ in range(self.shape.entries)]
                       if i in layers else None for i in range(num_layers)]
        self.scales = [[self._scales(shape[:3], e, device) for e in range(self.shape.entries)] if i in layers else None
                       for i in range(num_layers)]
        centred = self.shape.zero_point(0, self.bits)
        self.key_centres = [torch.zeros(self.shape.heads, self.shape.dim, device=device) if centred and i in layers
                            else None for i in range(num_layers)]
        self.reset_key_centres()
        self.generation += 1
        if device.type == "cpu":  # the pages are committed meanwhile, not by the first steps' writes
            self.prefaulting = prefault_in_background(
                [t for layer in self.values + self.scales if layer for t in layer if t is not None])

    def wait_prefaulted(self) -> None:
        """Returns once the background commit of a CPU cache's pages (`prefault_in_background`) is done."""
        if self.prefaulting is not None:
            self.prefaulting.join()
            self.prefaulting = None

    def release(self) -> None:
        """Frees the cache tensors (for a training phase, say) until `allocate` makes them again."""
        self.values = self.scales = None
        self.key_centres = [None] * len(self.key_centres)

    @property
    def allocated(self) -> bool:
        return self.values is not None

    def _scales(self, shape: tuple[int, ...], entry: int, device: torch.device) -> torch.Tensor | None:
        if self.bits is None:
            return None
        trailing, dtype = kernels.scale_layout(self.shape.dim, self.bits, self.shape.zero_point(entry, self.bits))
        return zeroed(shape + trailing, dtype, device)

    def reset_key_centres(self) -> None:
        """Lets the next keys written set each layer's int4 centre; only while no cached keys are in use."""
        self.key_centred = [False] * len(self.key_centred)

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
    # Steps of one-token decodes whose metadata lives on the device alone (replayed decode graphs, see
    # decode_graphs.py): [S] int32 or int64 context lengths, which attention reads instead of the lists
    decode_lens: torch.Tensor | None = None


class PagedAttentionContext:
    """Forward context: writes each layer's new K/V into the cache, then attends over the pages."""

    def __init__(self, cache: KVCache, meta: StepMetadata):
        self.cache, self.meta = cache, meta
        self._plans: dict[int | None, kernels.AttentionPlan] = {}  # by sliding window: the same for every layer

    def _plan(self, sliding_window: int | None) -> kernels.AttentionPlan:
        if sliding_window not in self._plans:
            self._plans[sliding_window] = kernels.plan_paged_attention(
                self.meta.block_tables, self.meta.query_start, self.meta.context_lens, self.cache.block_size,
                sliding_window)
        return self._plans[sliding_window]

    def _paged(self, layer: int, q: torch.Tensor, scale: float, sliding_window: int | None,
               v_dim: int | None) -> torch.Tensor:
        values, scales = self.cache.values[layer], self.cache.scales[layer]
        v_cache = values[1] if len(values) == 2 else None
        v_scale = scales[1] if len(scales) == 2 else None
        if self.meta.decode_lens is not None:
            return kernels.paged_decode(q, values[0], v_cache, self.meta.block_tables, self.meta.decode_lens, scale,
                                        sliding_window=sliding_window, k_scale=scales[0], v_scale=v_scale,
                                        kv_bits=self.cache.bits, v_head_dim=v_dim)
        return kernels.paged_attention(q, values[0], v_cache, self.meta.block_tables, self.meta.query_start,
                                       self.meta.context_lens, scale, sliding_window=sliding_window,
                                       k_scale=scales[0], v_scale=v_scale, kv_bits=self.cache.bits, v_head_dim=v_dim,
                                       plan=None if torch.compiler.is_compiling() else self._plan(sliding_window))

    def attend(self, layer, q, k, v, scale, sliding_window):
        values, scales, cache = self.cache.values[layer], self.cache.scales[layer], self.cache
        centre = cache.key_centres[layer]
        # A decode never sets the centre: its sequence's prefill did, and a captured decode graph must not
        if centre is not None and not cache.key_centred[layer] and self.meta.decode_lens is None:
            centre.copy_(k[0].float().mean(0))
            cache.key_centred[layer] = True
        kernels.write_kv(values[0], scales[0], k, self.meta.slots, self.cache.bits, centre)
        kernels.write_kv(values[1], scales[1], v, self.meta.slots, self.cache.bits)
        return self._paged(layer, q[0], scale, sliding_window, None).unsqueeze(0)

    def attend_latent(self, layer, q, kv, v_dim, scale):
        kernels.write_kv(self.cache.values[layer][0], self.cache.scales[layer][0], kv[0], self.meta.slots,
                         self.cache.bits)
        return self._paged(layer, q[0], scale, None, v_dim).unsqueeze(0)
