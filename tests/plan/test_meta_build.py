"""One rank of a 64+ card layout built on the meta device holds, to the byte, what the plan counts."""
from __future__ import annotations

import pytest
import torch

from unified.checkpoint.shipped import model_config_of
from unified.plan.inventory import Stage, rank_tensors
from unified.plan.meta_build import build_rank, held_bytes, planned_bytes
from unified.runtime.layout import Layout, layout_problems

CASES = [  # (model, layout, cards)
    ("deepseek-v3", Layout(tensor=8, pipeline=1, expert=8), 64),
    ("deepseek-v3", Layout(tensor=4, pipeline=4, expert=4), 64),
    ("kimi-k2", Layout(tensor=8, pipeline=2, expert=4), 64),
    ("unified-3t-vl", Layout(tensor=1, pipeline=8, expert=8), 64),
    ("unified-3t-vl", Layout(tensor=8, pipeline=4, expert=16), 512),
]


@pytest.mark.parametrize("name,layout,cards", CASES)
def test_meta_build_bytes_equal_the_plan(name, layout, cards):
    config = model_config_of(name)
    assert layout_problems(layout, cards, config) == []
    for stage in range(layout.pipeline):
        model = build_rank(config, layout, torch.bfloat16, tensor_rank=layout.tensor - 1, pipeline_rank=stage,
                           expert_rank=layout.expert - 1)
        assert all(p.is_meta for p in model.parameters())
        assert held_bytes(model) == planned_bytes(config, layout, stage, torch.bfloat16), (name, layout, stage)
        built = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
        assert built == {t.name: t.shape for t in rank_tensors(config, Stage(layout, stage))}


def test_a_rank_holds_its_share():
    config = model_config_of("kimi-k2")
    whole = held_bytes(build_rank(config, Layout()))["parameters"]
    rank = held_bytes(build_rank(config, Layout(tensor=1, pipeline=1, expert=8)))["parameters"]
    experts = sum(t.numel for t in rank_tensors(config, Stage(Layout())) if t.name.endswith(("gate_up", "down")))
    assert whole - rank == experts * 7 // 8 * 2  # bf16: 7/8 of the routed experts live on the other ranks


def test_the_build_leaves_this_process_s_groups_alone(runtime):
    from megatron.core import parallel_state

    build_rank(model_config_of("deepseek-v3"), Layout(tensor=8, expert=8))
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_expert_model_parallel_world_size() == 1
