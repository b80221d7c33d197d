"""Resource planning: the bytes each rank holds for a model, layout and hardware, before anything is read.

`plan_for(cfg, hardware)` -> `Plan` (per-rank `breakdown`, `fits`, feasible layouts ranked, fixes); the
pieces: inventory (a rank's tensors), weight_bytes (storage formats and the engine's copies), rank_memory (KV
cache, activations, training state per rank), throughput (the ranking model), planner (the search), fixes,
report, meta_build (the same rank built on the meta device), hardware (configs/hardware/*.yaml).
"""
from unified.plan.hardware import HardwareConfig, load_hardware
from unified.plan.meta_build import build_rank, check_against_plan, held_bytes, planned_bytes
from unified.plan.planner import LayoutPlan, Plan, evaluate, plan_for
from unified.plan.report import plan_json, render, write_plan

__all__ = ["HardwareConfig", "LayoutPlan", "Plan", "build_rank", "check_against_plan", "evaluate", "held_bytes",
           "load_hardware", "plan_for", "plan_json", "planned_bytes", "render", "write_plan"]
