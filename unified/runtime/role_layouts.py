"""megatron-core's parallel state for a world whose ranks play different roles, each with its own layout.

`megatron.core.parallel_state.initialize_model_parallel` lays one layout over the whole world. An RLHF
launch with trainer ranks and rollout ranks needs one per role: say data-parallel trainers beside
rollout engines split by tensor parallelism. Here the world is cut into contiguous blocks of ranks, each
with its own layout; megatron's own rank arithmetic (`RankGenerator` with a rank offset) forms each
block's groups, and every rank keeps the groups of its block in parallel_state, where the model, the
engine and DeepSpeed (through its `mpu`) look for them. Inside its block a rank sees exactly what
`initialize_model_parallel` would have given it in a world of the block's size.

torch.distributed requires every rank to create every group, in one order: every rank walks every
block alike.
"""
from __future__ import annotations

import torch.distributed as dist

from unified.runtime.layout import Layout, check_layout

# parallel_state's globals: (group, its global ranks or None), the rank generator, and megatron's token
_DECODER_GROUPS = (
    ("_DATA_PARALLEL_GROUP_WITH_CP", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP", "dp-cp"),
    ("_DATA_PARALLEL_GROUP", "_DATA_PARALLEL_GLOBAL_RANKS", "dp"),
    ("_CONTEXT_PARALLEL_GROUP", "_CONTEXT_PARALLEL_GLOBAL_RANKS", "cp"),
    ("_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GLOBAL_RANKS", "tp-pp"),
    ("_TENSOR_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "tp"),
    ("_PIPELINE_MODEL_PARALLEL_GROUP", "_PIPELINE_GLOBAL_RANKS", "pp"),
    ("_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", None, "tp-dp-cp"),
    ("_TENSOR_AND_DATA_PARALLEL_GROUP", None, "tp-dp"),
    ("_TENSOR_AND_CONTEXT_PARALLEL_GROUP", None, "tp-cp"),
)
_EXPERT_GROUPS = (
    ("_EXPERT_MODEL_PARALLEL_GROUP", "_EXPERT_MODEL_PARALLEL_RANKS", "ep"),
    ("_EXPERT_TENSOR_PARALLEL_GROUP", None, "tp"),
    ("_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", None, "tp-ep"),
    ("_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", None, "tp-ep-pp"),
    ("_EXPERT_DATA_PARALLEL_GROUP", None, "dp"),
)
ORDER = "tp-cp-ep-dp-pp"  # megatron's default


def init_role_layouts(blocks: list[tuple[int, Layout]]) -> int:
    """Sets megatron's parallel state for `blocks`: (number of ranks, layout) of each contiguous block of the
    world, in rank order. Returns the index of this rank's block. Every rank must call it alike."""
    from megatron.core import parallel_state

    world, rank = dist.get_world_size(), dist.get_rank()
    if sum(size for size, _ in blocks) != world:
        raise ValueError(f"the blocks {blocks} do not cover the world of {world} ranks")
    for size, layout in blocks:
        check_layout(layout, size)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    mine, offset = None, 0
    for index, (size, layout) in enumerate(blocks):
        here = offset <= rank < offset + size
        mine = index if here else mine
        for generator, groups in _generators(size, layout, offset):
            for group_name, ranks_name, token in groups:
                for ranks in generator.get_ranks(token):
                    group = dist.new_group(ranks)
                    if here and rank in ranks:
                        setattr(parallel_state, group_name, group)
                        if ranks_name:
                            setattr(parallel_state, ranks_name, ranks)
        for pp_ranks in _generators(size, layout, offset)[0][0].get_ranks("pp"):
            for group_name, ranks_name, ranks in (
                    ("_EMBEDDING_GROUP", "_EMBEDDING_GLOBAL_RANKS", parallel_state.default_embedding_ranks(pp_ranks)),
                    ("_POSITION_EMBEDDING_GROUP", "_POSITION_EMBEDDING_GLOBAL_RANKS",
                     parallel_state.default_position_embedding_ranks(pp_ranks))):
                group = dist.new_group(ranks)
                if here and rank in ranks:
                    setattr(parallel_state, group_name, group)
                    setattr(parallel_state, ranks_name, ranks)
        offset += size
    parallel_state._set_global_memory_buffer()
    return mine


def _generators(size: int, layout: Layout, offset: int):
    """megatron's two rank generators for one block, as initialize_model_parallel builds them."""
    from megatron.core.parallel_state import RankGenerator

    tp, pp, ep = layout.tensor, layout.pipeline, layout.expert
    decoder = RankGenerator(tp=tp, ep=1, dp=size // (tp * pp), pp=pp, cp=1, order=ORDER, rank_offset=offset)
    expert = RankGenerator(tp=tp, ep=ep, dp=size // (tp * ep * pp), pp=pp, cp=1, order=ORDER, rank_offset=offset)
    return [(decoder, _DECODER_GROUPS), (expert, _EXPERT_GROUPS)]
