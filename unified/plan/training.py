"""Gradients, optimizer state and DeepSpeed's buffers per rank under ZeRO 0/1/2/3 and offload, as
unified/train/engine.py configures DeepSpeed 0.19 (AdamW: two float32 moments per trainable parameter; float32
on CPU, bf16 on accelerators; DeepSpeed's default bucket sizes), read from its code and checked against measured
peaks by bench/plan.py.

A step has two fullest moments, and the plan takes the larger: the start of backward, when every activation is
alive (unified/plan/activations.py) and no gradient yet (DeepSpeed sets them to None after each step; with
gradient accumulation the earlier micro-batches' gradients are alive), and the end of backward through the
optimizer step, when the activations are gone and the gradients and the step's buffers are alive. Per rank, with
P parameters on the rank (its tensor-parallel shard), T of them trainable, d bytes per value of the compute
dtype, N data-parallel ranks and R = DeepSpeed's reduce/all-reduce bucket, min(5e8, T) elements:
  always       parameters P d (ZeRO-3: P d / N; offload_params: on the host); optimizer state: stage 0 in float32
               torch's AdamW, 8 T; otherwise DeepSpeed's ZeRO (or, stage 0 in bf16, its bf16) optimizer: moments
               8 T / N and a float32 master copy of the partition 4 T / N (every stage clones it, even from float32
               weights: ZeRO-3's no-copy branch compares a torch.device with a device name and never matches), in
               bf16 also float32 gradient partitions 4 T / N; offload_optimizer: these on the host. ZeRO-3 also
               keeps its float32 gradient partition 4 T / N and its reduce bucket R d for good.
  backward     the activations; ZeRO-3's gathered parameters: every layer whose next use is within
               stage3_max_reuse_distance (1e9) fetched elements stays gathered from forward to backward, which
               is all of a model under 5e8 parameters (min(P, 5e8 + 2 largest layers) d).
  step         torch's AdamW (on CPU one tensor at a time) holds two temporaries the size of the tensor it steps
               at once, the square root of the second moment and its quotient: a parameter's at stage 0, the
               whole flat float32 partition's, 2 x 4 T / N, under ZeRO. Stage 0: the gradients T d and the
               update's temporaries, with N > 1 also the flat all-reduce bucket R d. ZeRO flattens the partition's
               gradients into a new float32 tensor, 4 T / N (stages 1/2 in bf16 keep theirs, counted above), and
               frees the per-parameter ones before the update: stage 2, the reduce bucket R d (gradients are
               copied into it as backward makes them), the flat gradients and the temporaries; stage 1, the
               larger of the reduce (the gradients T d, the bucket R d and the partition's gradients T d / N) and
               that update; ZeRO-3, its flat gradients and the temporaries besides what it always keeps.
The ZeRO paper counts 2 + 2 + 12 bytes per parameter in mixed precision; DeepSpeed's own buffers add the rest.
These are the live tensors. On CPU glibc would keep more resident: freed blocks under its mmap threshold (which
rises with the blocks freed, up to 32 MiB) stay in its heap, so the activations freed in backward would stay
while ZeRO's large buffers (mappings of their own) are made; the trainer hands them back at the end of backward
and before the update (unified/train/engine.py `backward_and_step`), and bench/plan.py measures the difference.
"""
from __future__ import annotations

REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size and allgather_bucket_size (elements)
MAX_REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's default stage3_max_reuse_distance (elements)


def training_state_bytes(params: int, trainable: int, largest_unit: int, dtype_bytes: int, stage: int, dp: int,
                         offload_optimizer: bool, offload_params: bool, largest_tensor: int = 0,
                         accumulation: int = 1) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(always, at the start of backward besides the activations, at the optimizer step) device bytes, and the
    host bytes offload keeps, of parameters, gradients, optimizer state and DeepSpeed's buffers."""
    always: dict[str, int] = {}
    backward: dict[str, int] = {}
    step: dict[str, int] = {}
    host: dict[str, int] = {}
    d, t, n = dtype_bytes, trainable, dp
    bucket = min(REDUCE_BUCKET, t) * d
    (host if offload_params else always)["parameters"] = params * d // n if stage == 3 else params * d
    zero = stage >= 1 or d != 4  # DeepSpeed's bf16 optimizer partitions as ZeRO-1 does, even at stage 0
    moments = 8 * t // n if zero else 8 * t
    master = 4 * t // n if zero else 0
    fp32_grads = 4 * t // n if zero and d != 4 else 0
    optimizer = host if offload_optimizer else always
    optimizer["optimizer"] = moments + master + fp32_grads
    flat = 4 * t // n
    update: dict[str, int] = {}
    if not offload_optimizer:
        if stage == 3 or (zero and d == 4):  # (stages 1/2 in bf16: the optimizer's float32 gradients above)
            update["float32_gradients"] = flat
        update["optimizer_workspace"] = 2 * flat if zero else 2 * 4 * largest_tensor
    if stage == 3:
        always["gradients"] = 4 * t // n
        always["reduce_bucket"] = bucket
        backward["zero3_gathered"] = min(params, MAX_REUSE_DISTANCE // 2 + 2 * largest_unit) * d
        step |= update
    elif stage == 2:
        step |= {"reduce_bucket": bucket, **update}
    elif stage == 1:
        reduce = {"gradients": t * d, "reduce_bucket": bucket, "gradient_partition": t * d // n}
        step |= max(reduce, {"reduce_bucket": bucket, **update}, key=lambda moment: sum(moment.values()))
    else:
        step |= {"gradients": t * d, **update}
        if n > 1:
            step["reduce_bucket"] = bucket
    if accumulation > 1 and stage < 3:  # the earlier micro-batches' gradients wait through backward (ZeRO-3: always)
        backward["gradients"] = t * d // n if stage == 2 else t * d
    return always, backward, step, host
