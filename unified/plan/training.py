"""Gradients and optimizer state per rank under DeepSpeed ZeRO 0/1/2/3 and offload, as unified/train/engine.py
configures it: AdamW (two float32 moments per trainable parameter), float32 on CPU and bf16 on accelerators.

Per rank, with P parameters on the rank (its tensor-parallel shard), T of them trainable, d bytes per value of the
compute dtype and N data-parallel ranks:
  parameters    P d; ZeRO-3: P d / N, plus the gathered working set (below); offload_params: on the host
  gradients     stage 0/1: T d; stage 2/3: T d / N
  optimizer     moments 8 T; float32 at stage 0: torch's AdamW alone, unpartitioned. Otherwise DeepSpeed's ZeRO
                optimizer (stage >= 1) or its bf16 optimizer (stage 0 in bf16, partitioned as ZeRO-1) holds
                the moments 8 T / N, a float32 master copy 4 T / N and, in bf16, float32 gradient partitions
                4 T / N; offload_optimizer: all of this on the host
  buckets       stage 1/2: the gradient reduce bucket, reduce_bucket_size (5e8) elements at most, of which only
                the part gradients fill is ever touched: min(5e8, T) d
  ZeRO-3 set    the gathered parameters of the largest layer (decoder layer, embedding or head) and of the
                one prefetched after it: 2 x largest x d
This is DeepSpeed's accounting as we read its code (the ZeRO paper counts 2 + 2 + 12 bytes per parameter),
not a measurement;
bench/plan.py (the lead's) checks it against measured peaks.
"""
from __future__ import annotations

REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)


def training_state_bytes(params: int, trainable: int, largest_unit: int, dtype_bytes: int, stage: int, dp: int,
                         offload_optimizer: bool, offload_params: bool) -> tuple[dict[str, int], dict[str, int]]:
    """(on the device, on the host) bytes of parameters, gradients, optimizer state and ZeRO's buffers."""
    device: dict[str, int] = {}
    host: dict[str, int] = {}
    d = dtype_bytes
    params_bytes = params * d // dp if stage == 3 else params * d
    (host if offload_params else device)["parameters"] = params_bytes
    if stage == 3:
        device["zero3_gathered"] = 2 * largest_unit * d
    device["gradients"] = trainable * d // dp if stage >= 2 else trainable * d
    partitioned = stage >= 1 or d != 4  # DeepSpeed's bf16 optimizer partitions as ZeRO-1 does, even at stage 0
    moments = 8 * trainable // dp if partitioned else 8 * trainable
    master = 4 * trainable // dp if partitioned else 0
    fp32_grads = 4 * trainable // dp if partitioned and d != 4 else 0
    (host if offload_optimizer else device)["optimizer"] = moments + master + fp32_grads
    if stage in (1, 2):
        device["reduce_bucket"] = min(REDUCE_BUCKET, trainable) * d
    return device, host
