"""`unified recipe=<name> key=value ...`: the one entry point (also `python -m unified`).

A recipe is a primary Hydra config in `recipes/`; it composes component groups from `configs/`.
We translate `recipe=<name>` into Hydra's `--config-name` and drop the `--local_rank=N` argument
that the `deepspeed` launcher inserts (ranks come from the environment).
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
CONFIGS = ROOT / "configs"
DEFAULT_RECIPE = "demo"
JOBS = {
    "demo": "unified.jobs.demo",
    "check_parity": "unified.jobs.check_parity",
    "batch": "unified.jobs.batch",
    "serve": "unified.jobs.serve",
    "rollout": "unified.jobs.serve",
    "train": "unified.jobs.train",
    "grpo": "unified.jobs.rlhf",
    "ppo": "unified.jobs.rlhf",
    "online": "unified.jobs.online",
    "vision_demo": "unified.jobs.vision_demo",
    "quantize": "unified.jobs.quantize",
    "plan": "unified.jobs.plan",
    "convert": "unified.jobs.convert",
}


def _split_argv(argv: list[str]) -> tuple[str, list[str]]:
    recipe, rest, skip = DEFAULT_RECIPE, [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            continue
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        elif arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return recipe, rest


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_job(cfg) -> None:
    import importlib

    from unified.errors import UserError

    if cfg.job not in JOBS:
        _fail(f"job={cfg.job!r} is unknown; jobs: {', '.join(JOBS)}")
    ended_normally = False
    try:
        from unified.kernels import set_backend

        set_backend(cfg.kernels.backend)
        job = importlib.import_module(JOBS[cfg.job])
        from unified.plan.probe import probe

        probe(cfg)  # before any weight is read: stops a run that cannot fit
        job.run(cfg)
        ended_normally = True
    except UserError as err:
        _fail(str(err))
    except SystemExit as stop:  # ranks that follow a driver end with SystemExit(0) once it releases them
        ended_normally = stop.code in (0, None)
        raise
    finally:
        from unified.runtime import shutdown_distributed

        shutdown_distributed(wait_for_peers=ended_normally)


def main(argv: list[str] | None = None) -> None:
    # megatron-core warns at import that it falls back from CUDA-only libraries; that is expected here.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    import hydra
    from omegaconf import OmegaConf

    from unified.checkpoint.builtin import cache_dir
    from unified.config import register_schemas

    recipe, overrides = _split_argv(sys.argv[1:] if argv is None else argv)
    available = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    if recipe not in available:
        _fail(f"recipe={recipe!r} is not in {RECIPES}; recipes: {', '.join(available)}")
    register_schemas()
    if not OmegaConf.has_resolver("unified_cache"):
        OmegaConf.register_new_resolver("unified_cache", lambda: str(cache_dir()))
    app = hydra.main(config_path=str(RECIPES), config_name=recipe, version_base="1.3")(run_job)
    sys.argv = [sys.argv[0], f"hydra.searchpath=[file://{CONFIGS}]", f"hydra.job.name={recipe}", *overrides]
    app()


if __name__ == "__main__":
    main()
