"""When the run's layout does not fit: the nearest changes that make it fit, as paste-ready overrides.

Every suggestion is checked by planning again with it applied; none is offered that the planner itself calls
infeasible. Tried in this order, each alone: the feasible layouts on the same cards (the best, then the one
fewest changes away), a smaller KV cache dtype, a context the cache holds (engine.max_model_len), a larger
share of free memory for the cache or a smaller explicit budget (engine.kv_cache_bytes, KV_ROOM_USED of the
room the rest of the rank leaves), training's memory savers (ZeRO-3, optimizer offload, activation
checkpointing, one row per micro-batch; then all of them), quantized weights kept as stored, and finally more
cards (the fewest, with the best layout there; training, with every saver on if the settings as they are need
more than MAX_CARDS; for a CPU host, whose processes share its memory, accelerators' cards).
"""
from __future__ import annotations

from omegaconf import OmegaConf

from unified.errors import UserError
from unified.plan.hardware import load_hardware
from unified.plan.planner import MAX_CARDS, default_context, evaluate, search, setting_for
from unified.runtime.layout import Layout

# The KV cache is counted to the byte; what the rest of a rank holds (activations, the allocator's heap) varies
# from one environment to the next by a few percent of it. A suggested explicit budget takes this share of the
# room that is left for the cache, as vLLM's gpu_memory_utilization keeps a tenth of the card in reserve.
KV_ROOM_USED = 0.9
ACCELERATOR = "h200"  # what a host too small is pointed to
TRAINING_SAVERS = ["train.zero_stage=3", "train.offload_optimizer=true", "train.activation_checkpointing=true",
                   "train.micro_batch_size=1"]


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
    for dotlist in _setting_tries(plan):
        if _fits_with(cfg, plan, dotlist):
            fixes.append(" ".join(dotlist))
    if plan.feasible:
        return fixes
    if plan.hardware.kind != "cpu":
        more = _fewest_cards(cfg, plan, plan.hardware, plan.cards)
        if not more and plan.mode == "train":  # with every memory saver on
            more = _fewest_cards(cfg, plan, plan.hardware, plan.cards, TRAINING_SAVERS)
    else:  # more processes on one host share its memory: only accelerators can hold it
        more = _fewest_cards(cfg, plan, load_hardware(ACCELERATOR), 0, [f"plan.hardware={ACCELERATOR}"])
    return fixes + more


def _setting_tries(plan) -> list[list[str]]:
    """Changes of settings, not of layout or cards, to try on the requested layout (none if it cannot run)."""
    requested, engine = plan.requested, plan.setting.engine
    if requested.problems:
        return []
    if plan.mode == "train":
        zero3, offload, checkpointing, one_row = TRAINING_SAVERS
        return [[zero3], [zero3, offload], [checkpointing], [one_row], TRAINING_SAVERS]
    tries = [[f"engine.kv_cache_dtype={kv}"] for kv in ("int8", "int4") if kv != requested.kv_cache_dtype]
    if requested.kv_tokens >= engine.block_size and requested.short == 0:
        tries.append([f"plan.context={requested.kv_tokens}", f"engine.max_model_len={requested.kv_tokens}"])
    if not engine.kv_cache_bytes and not engine.num_blocks:
        tries.append(["engine.kv_cache_memory_fraction=0.9"])
    elif engine.kv_cache_bytes and requested.short:
        tries.append([f"engine.kv_cache_bytes={_kv_budget_that_fits(requested, engine)}"])
    elif engine.kv_cache_bytes:  # it fits the card but holds no whole sequence
        tries.append([f"engine.kv_cache_bytes={_kv_budget_for_one_sequence(requested, plan)}"])
    return tries + [[f"plan.weights={w}"] for w in ("fp8", "int4") if w != plan.setting.weights]


def _fewest_cards(cfg, plan, hardware, known_miss: int, extra: list[str] = ()) -> list[str]:
    """The fewest cards, above `known_miss`, on which a layout fits with `extra` applied, with the best layout
    there: doubling until one fits, then halving the gap (in whole nodes past the first)."""
    changed = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(extra)))
    try:
        setting = setting_for(changed, hardware, default_context(changed, plan.config))
    except UserError:
        return []

    def best(cards: int) -> list:
        return search(plan.config, cards, setting, hardware, plan.requested.kv_cache_dtype)

    cards = max(1, known_miss * 2)
    while not (found := best(cards)):
        known_miss, cards = cards, cards * 2
        if cards > MAX_CARDS:
            return []
    step = hardware.cards_per_node if known_miss >= hardware.cards_per_node else 1
    low, high = known_miss // step, cards // step
    while high - low > 1:
        middle = (low + high) // 2
        if there := best(middle * step):
            high, found = middle, there
        else:
            low = middle
    return [" ".join([*extra, f"plan.cards={high * step}", found[0].overrides])]


def _bytes_per_block(requested, engine) -> int:
    """The fullest rank's KV-cache bytes per block (the engine keeps one block more than the budget holds)."""
    return requested.breakdown["kv_cache"] // (requested.kv_tokens // engine.block_size + 1)


def _kv_budget_that_fits(requested, engine) -> int:
    """An explicit KV-cache budget that leaves the fullest rank within its card: KV_ROOM_USED of the room the
    rest of that rank leaves, whole blocks."""
    per_block = _bytes_per_block(requested, engine)
    room = max(0, engine.kv_cache_bytes - requested.short - per_block)
    budget = int(room * KV_ROOM_USED)
    return budget // per_block * per_block if per_block else budget


def _kv_budget_for_one_sequence(requested, plan) -> int:
    """The smallest explicit KV-cache budget that holds one sequence of the full context."""
    block = plan.setting.engine.block_size
    return -(-plan.context // block) * _bytes_per_block(requested, plan.setting.engine)
