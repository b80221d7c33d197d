"""One rank of a layout built on the meta device: the model's own modules, with shapes and no storage.

`build_rank` builds what the rank at given tensor-, pipeline- and expert-parallel ranks of `layout` would build
in a run (CausalLM, or VisionLanguageModel for a config with a vision tower), in this process and without
that layout's process groups (unified.runtime.placement). It costs no memory, so a rank of a 3T model builds
in seconds; `held_bytes` sums what it holds, to set beside the plan's count (unified.plan.inventory).
"""
from __future__ import annotations

import torch

from unified.model.config import ModelConfig
from unified.runtime.layout import Layout
from unified.runtime.placement import Place, placed_as


def build_rank(config: ModelConfig, layout: Layout, dtype: torch.dtype = torch.bfloat16, tensor_rank: int = 0,
               pipeline_rank: int = 0, expert_rank: int = 0) -> torch.nn.Module:
    from unified.model.multimodal import VisionLanguageModel
    from unified.model.transformer import CausalLM

    model_class = VisionLanguageModel if config.vision is not None else CausalLM
    with placed_as(Place(layout.tensor, tensor_rank), Place(layout.pipeline, pipeline_rank),
                   Place(layout.expert, expert_rank)), torch.device("meta"):
        return model_class(config, dtype)


def held_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters and of its buffers, as built (meta tensors count their shapes)."""
    return {"parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
            "buffers": sum(b.numel() * b.element_size() for b in model.buffers())}


def planned_bytes(config: ModelConfig, layout: Layout, stage: int, dtype: torch.dtype) -> dict[str, int]:
    """The plan's count of the same rank's parameter and buffer bytes (unified.plan.inventory)."""
    from unified.plan.inventory import Stage, rank_tensors

    out = {"parameters": 0, "buffers": 0}
    for t in rank_tensors(config, Stage(layout, stage)):
        out["buffers" if t.buffer else "parameters"] += t.numel * (4 if t.float32 else dtype.itemsize)
    return out


def check_against_plan(config: ModelConfig, layout: Layout, dtype: torch.dtype) -> list[dict]:
    """For the last rank of every pipeline stage: the meta-built bytes beside the plan's."""
    rows = []
    for stage in range(layout.pipeline):
        built = held_bytes(build_rank(config, layout, dtype, layout.tensor - 1, stage, layout.expert - 1))
        rows.append({"stage": stage, "built": built, "planned": planned_bytes(config, layout, stage, dtype)})
    return rows
