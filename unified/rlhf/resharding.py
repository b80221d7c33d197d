"""The trained weights, from the first trainer rank to rollout engines that hold them in another layout.

The trainer ranks hold whole parameters (data parallel); a rollout engine split by tensor, pipeline or
expert parallelism holds parts of them, fused as our model fuses them. The sender lays its weights out
under HF names (the LoRA matrices under peft's), whole, as a checkpoint holds them, and sends them in
flat buckets; each rollout rank takes its own part of every tensor the way the loader reads a checkpoint
(unified.checkpoint.weight_stream for weights, unified.checkpoint.lora for adapters), so neither side
needs to know the other's layout. The list of names, shapes and dtypes goes first, every sync, so a
receiver never has to guess what follows.
"""
from __future__ import annotations

import torch
from torch import nn

from unified.checkpoint.loader import hf_tensors
from unified.checkpoint.lora import adapter_tensors, write_adapter_tensor
from unified.checkpoint.weight_stream import WeightStream


@torch.no_grad()
def reshard_to_rollouts(model: nn.Module, lora: bool, src: int, group, bucket_bytes: int, device: torch.device,
                        receives: bool) -> int:
    """On the sender `src` and every rollout rank (`receives`) of `group`: the adapters under LoRA, else every
    weight. Returns the bytes sent."""
    sends = torch.distributed.get_rank() == src
    tensors = dict(adapter_tensors(model) if lora else hf_tensors(model)) if sends else {}
    box = [[(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]]
    torch.distributed.broadcast_object_list(box, src=src, group=group)
    manifest = box[0]
    stream = WeightStream(model) if receives and not lora else None
    sent = 0
    for bucket in _buckets(manifest, bucket_bytes):
        dtype, numel = bucket[0][2], sum(_numel(shape) for _, shape, _ in bucket)
        flat = (torch.cat([tensors[name].reshape(-1) for name, _, _ in bucket]) if sends
                else torch.empty(numel, dtype=dtype, device=device))
        torch.distributed.broadcast(flat, src, group=group)
        sent += flat.numel() * flat.element_size()
        if not receives:
            continue
        offset = 0
        for name, shape, _ in bucket:
            whole = flat[offset:offset + _numel(shape)].view(shape)
            offset += _numel(shape)
            if lora:
                write_adapter_tensor(model, name, whole)
            else:
                stream.write(name, whole)
    return sent


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _buckets(manifest: list[tuple], bucket_bytes: int) -> list[list[tuple]]:
    """Consecutive tensors of one dtype, up to `bucket_bytes` each (a larger tensor alone)."""
    buckets: list[list[tuple]] = []
    size = 0
    for entry in manifest:
        nbytes = _numel(entry[1]) * entry[2].itemsize
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][0][2] != entry[2]:
            buckets.append([])
            size = 0
        buckets[-1].append(entry)
        size += nbytes
    return buckets
