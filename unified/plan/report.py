"""The plan as people read it (a table of feasible layouts, or what is missing and how to fix it) and as
programs read it (plan.json)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from unified.plan.planner import LayoutPlan, Plan


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f}"


def _row(p: LayoutPlan, mode: str) -> str:
    parts = p.breakdown
    weight_keys = ("weights", "weight_scales", "engine_copies", "parameters")
    weights = sum(v for k, v in parts.items() if k in weight_keys)
    state = sum(v for k, v in parts.items()  # gradients, optimizer state and DeepSpeed's buffers (training.py)
                if k not in (*weight_keys, "reserve", "tokenizer", "buffers", "activations", "kv_cache"))
    middle = f"{gib(parts.get('kv_cache', 0)):>8}" if mode == "serve" else f"{gib(state):>8}"
    return (f"{p.layout.tensor:>3} {p.layout.pipeline:>3} {p.layout.expert:>3} {p.kv_cache_dtype:>5} "
            f"{gib(weights):>9} {middle} {gib(parts.get('activations', 0)):>8} {gib(p.peak):>8} "
            f"{gib(p.budget - p.peak):>8} {p.sequences:>5} {p.tokens_per_s:>10.1f}")


def render(plan: Plan) -> str:
    hw, s = plan.hardware, plan.setting
    family = plan.config.family + (f" + {plan.config.vision.kind} vision tower" if plan.config.vision else "")
    lines = [f"plan: model={plan.model} ({family}, {total_parameters(plan):,} parameters) on "
             f"{plan.cards} x {hw.name} ({gib(s.budget)} GiB per rank), {plan.mode}, context {plan.context} "
             f"tokens, {str(s.dtype).removeprefix('torch.')} compute, weights {s.weights}"]
    if plan.context > plan.config.max_position_embeddings:
        lines.append(f"note: a context of {plan.context:,} tokens is beyond this model's "
                     f"{plan.config.max_position_embeddings:,} (max_position_embeddings in its config)")
    middle = "KV GiB" if plan.mode == "serve" else "state GiB"
    seqs = "seqs" if plan.mode == "serve" else "rows"
    header = (f" tp  pp  ep    kv  weights {middle:>8}   act GiB  per rank  headroom {seqs:>5} {'tokens/s':>10}")
    req = plan.requested
    lines.append("\nthe requested layout: " + req.overrides)
    if req.problems:
        lines.append("  cannot run: " + "; ".join(req.problems))
    else:
        lines.append(header)
        lines.append(_row(req, plan.mode))
        lines.append("  per rank: " + ", ".join(f"{k} {gib(v)} GiB" for k, v in req.breakdown.items())
                     + (("; on the host: " + ", ".join(f"{k} {gib(v)} GiB" for k, v in req.host.items()))
                        if req.host else ""))
        if not req.fits:
            lines.append(f"  does not fit: {_missing(plan, req)}")
    if plan.feasible:
        lines.append(f"\nfeasible layouts on {plan.cards} cards, fastest first (decode tokens/s at the context, "
                     f"unified/plan/throughput.py):" if plan.mode == "serve" else
                     f"\nfeasible layouts on {plan.cards} cards, fastest first (training tokens/s):")
        lines.append(header)
        lines += [_row(p, plan.mode) for p in plan.feasible]
    elif not plan.fits:
        lines.append(f"\nno layout fits on {plan.cards} x {hw.name}.")
    if plan.fixes:
        lines.append("\nnearest fixes (each checked by the planner), paste as overrides:")
        if hw.kind == "cpu" and any(fix.startswith("plan.hardware=") for fix in plan.fixes):
            lines.append("  (no layout of this machine holds it: on accelerators)")
        lines += [f"  {fix}" for fix in plan.fixes]
    return "\n".join(lines)


def _missing(plan: Plan, p: LayoutPlan) -> str:
    if p.short:
        return f"the fullest rank needs {gib(p.peak)} GiB, {p.short:,} bytes ({gib(p.short)} GiB) more than its card"
    engine = plan.setting.engine
    if engine.num_blocks:
        budget = f"engine.num_blocks={engine.num_blocks}"
    elif engine.kv_cache_bytes:
        budget = f"engine.kv_cache_bytes={engine.kv_cache_bytes}"
    else:
        budget = f"engine.kv_cache_memory_fraction={engine.kv_cache_memory_fraction} of what is free"
    return f"the KV cache holds {p.kv_tokens} tokens, less than one sequence of {plan.context} ({budget})"


def total_parameters(plan: Plan) -> int:
    from unified.plan.inventory import Stage, rank_tensors
    from unified.runtime.layout import Layout

    return sum(t.numel for t in rank_tensors(plan.config, Stage(Layout())) if not t.buffer)


def plan_json(plan: Plan, meta_check: list[dict] | None = None) -> dict:
    def layout_dict(p: LayoutPlan) -> dict:
        return {"layout": asdict(p.layout), "kv_cache_dtype": p.kv_cache_dtype, "overrides": p.overrides,
                "fits": p.fits, "problems": p.problems, "per_rank_bytes": p.ranks, "host_bytes": p.host,
                "peak_bytes": p.peak, "budget_bytes": p.budget, "short_bytes": p.short, "kv_tokens": p.kv_tokens,
                "sequences": p.sequences, "tokens_per_s": p.tokens_per_s}

    return {"model": plan.model, "family": plan.config.family, "parameters": total_parameters(plan),
            "hardware": asdict(plan.hardware), "cards": plan.cards, "mode": plan.mode, "context": plan.context,
            "dtype": str(plan.setting.dtype).removeprefix("torch."), "weights": plan.setting.weights,
            "fits": plan.fits, "requested": layout_dict(plan.requested),
            "feasible": [layout_dict(p) for p in plan.feasible], "fixes": plan.fixes,
            "meta_build": meta_check}


def write_plan(plan: Plan, output: str, meta_check: list[dict] | None = None) -> Path:
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "plan.json"
    path.write_text(json.dumps(plan_json(plan, meta_check), indent=2))
    return path
