"""When the run's layout does not fit: the nearest changes that make it fit, as paste-ready overrides.

Every suggestion is checked by planning again with it applied; none is offered that the planner itself calls
infeasible. Tried in this order, each alone: the feasible layouts on the same cards (the best, then the one
fewest changes away), a smaller KV cache dtype, a context the cache holds (engine.max_model_len), a larger
share of free memory for the cache or a smaller explicit budget (engine.kv_cache_bytes, KV_ROOM_USED of the
room the rest of the rank leaves), training's memory savers (ZeRO-3, optimizer offload, activation
checkpointing, one row per micro-batch), quantized weights kept as stored, and finally more cards (the fewest, doubling, with the best layout there; for a CPU host, whose
processes share its memory, accelerators' cards).
"""
from __future__ import annotations

from omegaconf import OmegaConf

from unified.errors import UserError
from unified.plan.hardware import load_hardware
from unified.plan.planner import default_context, evaluate, search, setting_for
from unified.runtime.layout import Layout

MAX_CARDS = 16384
# The KV cache is counted to the byte; what the rest of a rank holds (activations, the allocator's heap) varies
# from one environment to the next by a few percent of it. A suggested explicit budget takes this share of the
# room that is left for the cache, as vLLM's gpu_memory_utilization keeps a tenth of the card in reserve.
KV_ROOM_USED = 0.9
ACCELERATOR = "h200"  # what a host too small is pointed to


def _changes(layout_plan, requested) -> int:
    a, b = layout_plan.layout, requested.layout
    return ((a.tensor != b.tensor) + (a.pipeline != b.pipeline) + (a.expert != b.expert)
            + (layout_plan.kv_cache_dtype != requested.kv_cache_dtype))


def _fits_with(cfg, plan, dotlist: list[str]) -> bool:
    """Whether the requested layout fits with `dotlist` applied to the run config (False where the change
    cannot apply to this model at all, such as int4 weights no group size divides)."""
    changed = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist))
    p = changed.parallel
    try:
        s = setting_for(changed, plan.hardware, default_context(changed, plan.config))
        kv = "-" if s.mode == "train" else changed.engine.kv_cache_dtype
        return evaluate(plan.config, Layout(p.tensor, p.pipeline, p.expert), kv, changed.plan.cards, s,
                        plan.hardware).fits
    except UserError:
        return False


def nearest_fixes(cfg, plan) -> list[str]:
    fixes: list[str] = []
    requested = plan.requested
    other_layouts = [p for p in plan.feasible if p.layout != requested.layout]  # same layout: the KV tries below
    if other_layouts:
        best = other_layouts[0]
        fixes.append(best.overrides)
        nearest = min(other_layouts, key=lambda p: (_changes(p, requested), -p.tokens_per_s))
        if nearest is not best:
            fixes.append(nearest.overrides)
    tries: list[list[str]] = []
    if plan.mode == "serve":
        tries += [[f"engine.kv_cache_dtype={kv}"] for kv in ("int8", "int4") if kv != requested.kv_cache_dtype]
        if requested.kv_tokens >= plan.setting.engine.block_size and requested.short == 0:
            tries.append([f"plan.context={requested.kv_tokens}", f"engine.max_model_len={requested.kv_tokens}"])
        if not plan.setting.engine.kv_cache_bytes and not plan.setting.engine.num_blocks:
            tries.append(["engine.kv_cache_memory_fraction=0.9"])
        elif plan.setting.engine.kv_cache_bytes and requested.short:
            tries.append([f"engine.kv_cache_bytes={_kv_budget_that_fits(requested, plan.setting.engine)}"])
        tries += [[f"plan.weights={w}"] for w in ("fp8", "int4") if w != plan.setting.weights]
    else:
        tries += [["train.zero_stage=3"], ["train.zero_stage=3", "train.offload_optimizer=true"],
                  ["train.activation_checkpointing=true"], ["train.micro_batch_size=1"]]
    for dotlist in tries:
        if not requested.problems and _fits_with(cfg, plan, dotlist):
            fixes.append(" ".join(dotlist))
    if not plan.feasible and plan.hardware.kind != "cpu":
        fixes += _fewest_cards(plan, plan.hardware, plan.setting, plan.cards * 2)
    elif not plan.feasible:  # more processes on one host share its memory: only accelerators can hold it
        accelerator = load_hardware(ACCELERATOR)
        setting = setting_for(cfg, accelerator, plan.context)
        fixes += [f"plan.hardware={ACCELERATOR} {fix} (no layout of this machine holds it; on accelerators)"
                  for fix in _fewest_cards(plan, accelerator, setting, 1)]
    return fixes


def _fewest_cards(plan, hardware, setting, cards: int) -> list[str]:
    """The fewest cards (doubling from `cards`) on which a layout fits, with the best layout there."""
    while cards <= MAX_CARDS:
        found = search(plan.config, cards, setting, hardware, plan.requested.kv_cache_dtype)
        if found:
            return [f"plan.cards={cards} {found[0].overrides}"]
        cards *= 2
    return []


def _kv_budget_that_fits(requested, engine) -> int:
    """An explicit KV-cache budget that leaves the fullest rank within its card: KV_ROOM_USED of the room the
    rest of that rank leaves, whole blocks (the engine keeps one block more than the budget holds)."""
    blocks = requested.kv_tokens // engine.block_size
    per_block = requested.breakdown["kv_cache"] // (blocks + 1) if blocks else 0
    room = max(0, engine.kv_cache_bytes - requested.short - per_block)
    budget = int(room * KV_ROOM_USED)
    return budget // per_block * per_block if per_block else budget
