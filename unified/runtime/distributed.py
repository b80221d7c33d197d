"""Process groups: torch.distributed, then megatron-core's parallel_state on top.

Ranks come from the environment that `deepspeed`, `torchrun` or a scheduler sets (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Without a launcher we form a world of one in-process, so the same model
code (megatron layers need parallel_state) runs from a plain `python` or a test.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from unified.errors import UserError


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1


def init_distributed(accelerator, layout: Layout = Layout()) -> None:
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = accelerator.communication_backend_name()
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            # DeepSpeed's shared-memory all-reduce reads LOCAL_SIZE, which only its own launcher sets.
            os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    model_parallel = layout.tensor * layout.pipeline
    if world % model_parallel:
        raise UserError(f"world size {world} is not a multiple of tensor x pipeline parallel "
                         f"= {layout.tensor} x {layout.pipeline}; change the parallel layout or the number of processes")
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() != layout.tensor
                or parallel_state.get_pipeline_model_parallel_world_size() != layout.pipeline):
            parallel_state.destroy_model_parallel()
        else:
            return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        expert_model_parallel_size=layout.expert,
    )
