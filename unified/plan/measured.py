"""The plan against the process: resident memory as Linux counts it, and one serving or fine-tuning run measured.

    python -m unified.plan.measured key=value ...   # the run config's keys; plan.mode=serve|train picks the run

runs one case in this (fresh) process and prints one line per rank, `measured: {json}`, with
  baseline   VmRSS once the run's modules are imported and its runtime (process groups) started, right before
             the model is loaded
  peak       VmHWM where the plan puts the peak: serving, after the engine's steps; training, at the optimizer
             step of the last training step (torch's global step hook), which covers every step before it and
             leaves out the final checkpoint save and export; `end` is VmHWM at the very end, those included
  predicted  the plan's bytes for this rank (plan.cards = the world size), with the measured baseline as the
             reserve, and its breakdown; `recorded_reserve` is what configs/hardware/cpu.yaml records
Serving runs the real engine (unified.engine.llm.build_engine) on one step that holds the plan's largest step,
min(max_num_batched_tokens, context) tokens over min(max_num_seqs, tokens) sequences, then decode steps of all of
them. Training runs the real trainer (unified.train.trainer.train, `recipe=sft`'s settings). The run config is
the schema's defaults with the given overrides, which is what recipes/sft.yaml and recipes/serve.yaml compose.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from unified.runtime.memory_report import resident_bytes

PREFIX = "measured: "


def run_config(overrides: list[str]):
    from omegaconf import OmegaConf

    from unified.config.schema import RunConfig

    return OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.from_dotlist(["job=plan", *overrides]))


def _serve(cfg) -> dict:
    import torch
    from transformers import AutoTokenizer  # noqa: F401  (imported before the baseline, as the run imports it)

    from unified.engine.llm import build_engine
    from unified.engine.sampling_params import SamplingParams
    from unified.runtime import start_runtime

    start_runtime(cfg.device, cfg.parallel, cfg.seed)
    baseline = resident_bytes("VmRSS")
    engine = build_engine(cfg.model, cfg.device, cfg.parallel, cfg.engine, cfg.seed)
    if not engine.is_driver:  # another rank of the layout: it runs the driver's steps until released
        engine.follow(ignore_signals=False)
        return {"baseline": baseline, "peak": resident_bytes("VmHWM")}
    e = cfg.engine
    tokens = min(e.max_num_batched_tokens, e.max_model_len or engine.config.max_position_embeddings)
    rows = min(e.max_num_seqs, tokens)
    g = torch.Generator().manual_seed(cfg.seed)
    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for row in range(rows):  # prompt lengths that add up to `tokens`: one step takes them all
        length = tokens // rows + (row < tokens % rows)
        engine.add_request(torch.randint(0, vocab, (length,), generator=g).tolist(), params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    engine.shutdown()
    return {"baseline": baseline, "peak": resident_bytes("VmHWM"), "steps": steps, "rows": rows, "tokens": tokens}


def _train(cfg) -> dict:
    import deepspeed  # noqa: F401  (imported before the baseline, as the run imports it)
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from transformers import AutoTokenizer  # noqa: F401

    from unified.runtime import start_runtime
    from unified.train.trainer import train

    start_runtime(cfg.device, cfg.parallel, cfg.seed)
    baseline = resident_bytes("VmRSS")
    at_steps: list[int] = []

    def after_step(optimizer, *_) -> None:  # ZeRO steps a torch optimizer per parameter group inside its own step
        if type(optimizer).__module__.startswith("torch.optim"):
            at_steps.append(resident_bytes("VmHWM"))

    hook = register_optimizer_step_post_hook(after_step)
    try:
        train(cfg)
    finally:
        hook.remove()
    if not at_steps:
        raise RuntimeError("the trainer ran no optimizer step")
    return {"baseline": baseline, "peak": at_steps[-1], "optimizer_steps": len(at_steps)}


def _predicted(cfg, baseline: int, world: int) -> dict:
    from omegaconf import OmegaConf

    from unified.plan import load_hardware, plan_for

    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"plan.cards={world}"]))
    recorded = load_hardware("cpu")
    plan = plan_for(cfg, replace(recorded, reserve_bytes=baseline))
    return {"predicted": plan.requested.peak, "breakdown": plan.requested.breakdown,
            "recorded_reserve": recorded.reserve_bytes}


def measure(overrides: list[str]) -> dict:
    """Runs the case in this process; the measured and predicted bytes of this rank."""
    import torch

    cfg = run_config(overrides)
    result = _train(cfg) if cfg.plan.mode == "train" else _serve(cfg)
    result["end"] = resident_bytes("VmHWM")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    result["rank"] = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    result.update(_predicted(cfg, result["baseline"], world))
    return result


def main(argv: list[str]) -> None:
    import warnings

    from unified.cli import _split_argv

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _, overrides = _split_argv(argv)  # drops the --local_rank the deepspeed launcher adds
    result = measure(overrides)
    sys.stdout.write(PREFIX + json.dumps(result) + "\n")  # one write: ranks of a launch share its stdout
    sys.stdout.flush()
    from unified.runtime import shutdown_distributed

    shutdown_distributed(wait_for_peers=True)


if __name__ == "__main__":
    main(sys.argv[1:])
