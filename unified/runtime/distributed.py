"""Process groups: torch.distributed, then megatron-core's parallel_state on top.

Ranks come from the environment that `deepspeed`, `torchrun` or a scheduler sets (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Without a launcher we form a world of one in-process, so the same model
code (megatron layers need parallel_state) runs from a plain `python` or a test.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from unified.runtime.layout import Layout, check_layout


def init_single_process_group(backend: str) -> None:
    """A world of this one process, with no launcher."""
    os.environ.setdefault("LOCAL_RANK", "0")  # what a launcher would set; DeepSpeed's engine asks for it
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def init_distributed(accelerator, layout: Layout = Layout()) -> None:
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = accelerator.communication_backend_name()
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            # DeepSpeed's shared-memory all-reduce reads LOCAL_SIZE, which only its own launcher sets.
            os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
            dist.init_process_group(backend=backend)
        else:
            init_single_process_group(backend)
    check_layout(layout, dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        if current_layout() != layout:
            parallel_state.destroy_model_parallel()
        else:
            return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        expert_model_parallel_size=layout.expert,
    )


def shutdown_distributed(wait_for_peers: bool) -> None:
    """Destroys megatron's groups and the default one while the interpreter is still whole. Left to the
    interpreter's teardown, gloo's worker threads can abort the process after the job has finished
    ("terminate called without an active exception"). With `wait_for_peers` (this rank's job ended
    normally) the rank first meets the others at a barrier, so none closes its connections while another
    is still in a collective; a rank that failed does not wait for peers that may never arrive."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        return
    if wait_for_peers and dist.get_world_size() > 1:
        dist.barrier()
        _unlink_deepspeed_shm_buffer(dist.get_rank())  # every peer has mapped it long since
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _unlink_deepspeed_shm_buffer(rank: int) -> None:
    """DeepSpeed's shared-memory all-reduce on CPU (its shm comm op) creates a 66 MiB POSIX shared-memory
    segment per rank, named after the launch's MASTER_ADDR and MASTER_PORT, and never unlinks it: every
    multi-rank CPU run would leave its segments in /dev/shm, holding RAM until the host restarts. The name
    only serves the peers opening it at start-up; unlinking it frees the memory once the last mapping goes."""
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(name)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        pass


def layout_world() -> int:
    """How many ranks this rank's layout spans: the world, or its block of the world when the ranks play
    roles with layouts of their own (unified.runtime.role_layouts)."""
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size()
            * parallel_state.get_pipeline_model_parallel_world_size() * parallel_state.get_data_parallel_world_size())


def current_layout() -> Layout:
    from megatron.core import parallel_state

    return Layout(parallel_state.get_tensor_model_parallel_world_size(),
                  parallel_state.get_pipeline_model_parallel_world_size(),
                  parallel_state.get_expert_model_parallel_world_size())
