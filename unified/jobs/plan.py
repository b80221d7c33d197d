"""recipe=plan: the memory and layout plan for model= on plan.hardware x plan.cards; no weight is read.

Prints the plan (unified/plan/report.py) and, for the requested layout (or the best feasible one), one rank of
every pipeline stage built on the meta device with its bytes beside the plan's. Exits 0 when a layout fits,
2 when none does (with the nearest fixes).
"""
from __future__ import annotations

from pathlib import Path

from unified.errors import UserError
from unified.plan import check_against_plan, plan_for, render, write_plan
from unified.plan.report import gib


def run(cfg) -> None:
    if cfg.output and Path(cfg.output).exists() and not Path(cfg.output).is_dir():
        raise UserError(f"output={cfg.output} is a file; give a folder for plan.json")
    plan = plan_for(cfg)
    print(render(plan))
    shown = plan.requested if not plan.requested.problems or not plan.feasible else plan.feasible[0]
    meta = None
    if not shown.problems:
        meta = check_against_plan(plan.config, shown.layout, plan.setting.dtype)
        print(f"\nmeta-device build of [{shown.layout}], one rank per pipeline stage (parameters + buffers):")
        for row in meta:
            built, planned = row["built"], row["planned"]
            same = "equal" if built == planned else "DIFFERENT"
            print(f"  stage {row['stage']}: built {built['parameters']:,} + {built['buffers']:,} bytes, planned "
                  f"{planned['parameters']:,} + {planned['buffers']:,} ({gib(built['parameters'])} GiB): {same}")
    if cfg.output:
        print(f"\nwrote {write_plan(plan, cfg.output, meta)}")
    if not plan.fits:
        raise SystemExit(2)
