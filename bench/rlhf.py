"""GRPO speed: our `recipe=grpo` against TRL's GRPOTrainer, seconds per step and rollout tokens/s, one run.

    bench/setup_trl.sh                 # once: bench/.venv-trl, TRL beside torch/transformers/peft pinned to ours
    .venv/bin/python bench/rlhf.py [--steps 3] [--rounds 3] [--max-tokens 48] [--prompts-per-step 4]
                                   [--num-generations 4]
    .venv/bin/python bench/rlhf.py --quick   # tiny random model, a smoke test of both sides

Same work on both sides: SmolLM2-135M-Instruct (fp32, CPU), LoRA rank 16 / alpha 32 on the seven Llama
projections, the same reasoning-gym prompts (our default task, written once to a JSONL file that both read)
scored by our default reward, P prompts x G completions per step at temperature 1, one optimizer update per
batch, constant learning rate, no KL term. Ours is the real CLI (`unified recipe=grpo data=...`); TRL samples
with `transformers` generate (no vLLM) and runs in bench/.venv-trl (bench/peers/trl_grpo.py).
Every completion is --max-tokens long on both sides: the recipe has no ignore-EOS option, so both read a copy
of the checkpoint (weights linked) whose EOS is a special token the model does not produce.
Each run is its own process; runs alternate (ours, TRL, ours, TRL, ...) because the host is shared, a matmul is
measured before and after, and the first step of every run is warm-up. A step lasts from one metrics.jsonl
line to the next (both sides log every step there under our names), so every cost of the loop counts.
Medians over the timed steps of all rounds. With one update per batch and no KL term TRL computes neither
the old nor the reference log-probabilities; ours takes the old ones from the update's own forward (the
consistency gate reads them) and runs the reference on a share of the completions, for the reported KL.
Ours packs each prompt once with its completions for the trainer's forward (rlhf.pack_tokens), and its
rollouts run on packed weight copies with the adapters folded in, refreshed after each update (sync).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from throughput import matmul_gflops
from train import tiny_model

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TRL_PYTHON = ROOT / "bench" / ".venv-trl" / "bin" / "python"
TRL_WORKER = ROOT / "bench" / "peers" / "trl_grpo.py"
STANDIN_EOS = "<empty_output>"  # a SmolLM2 special token that chat completions never contain
LR, LORA_RANK, LORA_ALPHA = 5e-5, 16, 32  # recipes/grpo.yaml and configs/train/lora.yaml
QUICK = dict(steps=2, rounds=1, max_tokens=8, prompts_per_step=2, num_generations=2)
SYSTEMS = ("ours", "trl")
LABELS = {"ours": "unified recipe=grpo", "trl": "TRL GRPOTrainer (transformers generate)"}


# ---------------------------------------------------------------- the workload

def fixed_length_model(source: Path, dest: Path) -> Path:
    """`source` with a stand-in EOS, so that every completion runs to max tokens (weights linked, not copied)."""
    from transformers import AutoTokenizer

    dest.mkdir(parents=True)
    for file in source.iterdir():
        if file.name not in ("config.json", "generation_config.json", "tokenizer_config.json"):
            (dest / file.name).symlink_to(file)
    eos_id = AutoTokenizer.from_pretrained(source).convert_tokens_to_ids(STANDIN_EOS)
    for name, key, value in (("config.json", "eos_token_id", eos_id),
                             ("generation_config.json", "eos_token_id", eos_id),
                             ("tokenizer_config.json", "eos_token", STANDIN_EOS)):
        config = json.loads((source / name).read_text())
        config[key] = value
        (dest / name).write_text(json.dumps(config, indent=2))
    return dest


def write_prompts(path: Path, count: int, seed: int = 0) -> Path:
    """`count` prompts of our default reasoning-gym task, as `data=` lines ({"messages", "entry"})."""
    from unified.config.schema import RLHFConfig
    from unified.rlhf.tasks import task_prompts

    defaults = RLHFConfig()
    records = task_prompts(defaults.task, count, seed, dict(defaults.task_options))
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---------------------------------------------------------------- the contestants

def ours_command(args, model: Path, data: Path, output: Path) -> list[str]:
    return [str(BIN / "unified"), "recipe=grpo", f"model={model}", f"data={data}", f"output={output}",
            f"steps={args.steps}", f"rlhf.max_tokens={args.max_tokens}",
            f"rlhf.prompts_per_step={args.prompts_per_step}", f"rlhf.num_generations={args.num_generations}",
            "rlhf.temperature=1.0", "rlhf.updates_per_batch=1", "rlhf.kl_coef=0.0", "rlhf.eval_every=0",
            f"train.lr={LR}", f"train.lora.rank={LORA_RANK}", f"train.lora.alpha={LORA_ALPHA}"]


def trl_command(args, model: Path, data: Path, output: Path) -> list[str]:
    if not TRL_PYTHON.is_file():
        sys.exit(f"{TRL_PYTHON} is missing: run bench/setup_trl.sh first")
    return [str(TRL_PYTHON), str(TRL_WORKER), "--model", str(model), "--data", str(data), "--output", str(output),
            "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
            "--num-generations", str(args.num_generations), "--max-tokens", str(args.max_tokens), "--lr", str(LR),
            "--lora-rank", str(LORA_RANK), "--lora-alpha", str(LORA_ALPHA)]


def watch(command: list[str], log: Path, metrics: Path) -> list[dict]:
    """Runs `command` to the end; each step's metrics line, with `ended`: when the line appeared."""
    records, seen = [], b""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "DS_ACCELERATOR": "cpu"}
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT, env=env)
        while True:
            running, now = proc.poll() is None, time.perf_counter()
            text = metrics.read_bytes() if metrics.is_file() else b""
            text = text[:text.rfind(b"\n") + 1]  # whole lines only
            records += [{**json.loads(line), "ended": now} for line in text[len(seen):].splitlines()]
            seen = text
            if not running:
                break
            time.sleep(0.05)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command[:3])} ... exited with {proc.returncode}:\n" + log.read_text()[-3000:])
    return [r for r in records if "timing/rollout_s" in r]


def run(system: str, args, model: Path, data: Path, folder: Path) -> list[dict]:
    """The timed steps of one run (all but the first): its metrics, and `step_s`."""
    folder.mkdir(parents=True)
    command = (ours_command if system == "ours" else trl_command)(args, model, data, folder / "out")
    records = watch(command, folder / "log.txt", folder / "out" / "metrics.jsonl")
    if len(records) != args.steps:
        raise RuntimeError(f"{system}: {len(records)} metrics lines for {args.steps} steps:\n"
                           + (folder / "log.txt").read_text()[-3000:])
    return [{**r, "step_s": r["ended"] - before["ended"]} for before, r in zip(records, records[1:])]


# ---------------------------------------------------------------- the report

def medians(steps: list[dict], completions: int) -> dict[str, float]:
    """Medians over timed steps; rollout tokens/s from the median rollout time, so that the two agree."""
    keys = ("step_s", "timing/rollout_s", "completions/mean_length", "timing/train_s", "timing/sync_s")
    out = {k: statistics.median(s[k] for s in steps) for k in keys if k in steps[0]}
    out["rollout_tok_s"] = out["completions/mean_length"] * completions / out["timing/rollout_s"]
    out["rest_s"] = statistics.median(s["step_s"] - s["timing/rollout_s"] for s in steps)
    return out


def table(ours: dict[str, float], trl: dict[str, float]) -> str:
    rows = ["| | s/step | rollout s | rollout tok/s | rest of step s | completion tokens |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, m in ((LABELS["ours"], ours), (LABELS["trl"], trl)):
        rows.append(f"| {label} | {m['step_s']:.2f} | {m['timing/rollout_s']:.2f} "
                    f"| {m['rollout_tok_s']:.0f} | {m['rest_s']:.2f} | {m['completions/mean_length']:.1f} |")
    rows.append(f"| ours faster by | {trl['step_s'] / ours['step_s']:.2f}x | "
                f"{trl['timing/rollout_s'] / ours['timing/rollout_s']:.2f}x | "
                f"{ours['rollout_tok_s'] / trl['rollout_tok_s']:.2f}x | {trl['rest_s'] / ours['rest_s']:.2f}x | |")
    return "\n".join(rows)


def report(args, name: str, steps: dict[str, list[dict]], gflops: tuple[float, float]) -> None:
    completions = args.prompts_per_step * args.num_generations
    ours, trl = medians(steps["ours"], completions), medians(steps["trl"], completions)
    print(f"\nGRPO on {name}, {args.prompts_per_step} prompts x {args.num_generations} completions x "
          f"{args.max_tokens} tokens per step, fp32 CPU; medians of {len(steps['ours'])} (ours) and "
          f"{len(steps['trl'])} (TRL) timed steps over {args.rounds} round(s); {date.today()}\n")
    print(table(ours, trl))
    print(f"\nours per step: train {ours['timing/train_s']:.2f} s (old and reference log-probabilities, one update), "
          f"sync {ours['timing/sync_s'] * 1e3:.2f} ms (timing/sync_s: refreshing derived weight copies)")
    print(f"matmul GFLOP/s before / after: {gflops[0]:.0f} / {gflops[1]:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="steps per run, the first of them untimed")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each system, alternating")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per completion")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--quick", action="store_true", help="tiny random model, tiny steps: a smoke test")
    args = parser.parse_args()
    if args.quick:
        vars(args).update(QUICK)
    if args.steps < 2 or args.num_generations < 2:
        parser.error("--steps and --num-generations must be at least 2 (the first step is warm-up)")
    gflops_before = matmul_gflops()
    with tempfile.TemporaryDirectory(prefix="bench-rlhf-") as tmp:
        tmp = Path(tmp)
        if args.quick:
            source, name = tiny_model(tmp / "tiny"), "a tiny random Llama"
        else:
            from unified.checkpoint.builtin import resolve_model

            source, name = resolve_model("smollm2"), "SmolLM2-135M-Instruct"
        model = fixed_length_model(source, tmp / "model")
        data = write_prompts(tmp / "prompts.jsonl", args.steps * args.prompts_per_step)
        steps = {system: [] for system in SYSTEMS}
        for round_ in range(args.rounds):
            for system in SYSTEMS:
                started = time.perf_counter()
                timed = run(system, args, model, data, tmp / f"{system}-{round_}")
                steps[system] += timed
                print(f"round {round_ + 1}: {system} {time.perf_counter() - started:.0f} s in all, timed steps "
                      + ", ".join(f"{s['step_s']:.1f}" for s in timed) + " s", flush=True)
    report(args, name, steps, (gflops_before, matmul_gflops()))


if __name__ == "__main__":
    main()
