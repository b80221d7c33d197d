"""The planner against measured memory: each case's peak resident memory predicted and measured, as the total and
as the rise above the process's baseline before the model is loaded, one run.

    .venv/bin/python bench/plan.py [--only serve,train,moe] [--steps 3] [--seq-len 256] [--micro-batch 2]

Every case is a fresh process (two, launched by `deepspeed --num_gpus 2`, for two ranks) running
`python -m unified.plan.measured <overrides>` (see that module): it records its baseline (VmRSS once the run's
modules are imported and its runtime started, right before the model is loaded), runs the real engine or the
real trainer, reads its peak (VmHWM where the plan puts the peak) and plans the same run for its own rank with
the measured baseline as the reserve, so that total and rise both compare. Cases:
- serving SmolLM2 (the built-in `smollm2`, fp32) with a 256 MiB KV budget: packed weights (the default), plain
  weights, int8 weights; one step of 2048 tokens over 64 sequences (the plan's largest step), then decodes;
- fine-tuning SmolLM2 (`recipe=sft` settings; generated lines that fill every row with targets, the case the
  plan counts) on 1 and 2 ranks under ZeRO 0, 2 and 3;
- serving a small DeepSeek-V3-shaped MoE (MLA, routed and shared experts, built here with random weights and
  SmolLM2's tokenizer) under expert parallel 2 (the trainer has no expert parallelism).
With `--allocator both`, fine-tuning also runs with MALLOC_MMAP_THRESHOLD_=131072, where glibc returns every freed
block over 128 KiB at once, so that the peak is the live tensors' (the plan's count) whatever the order of frees
(the trainer itself hands freed host memory back at the end of backward and before the optimizer's update,
unified/train/engine.py; the engine fixes its own threshold at start). The last column compares
configs/hardware/cpu.yaml's recorded reserve with the measured baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from train import WORDS

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PREFIX = "measured: "
KV_BUDGET = 256 * 2 ** 20
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT),
       "PATH": f"{BIN}:{os.environ['PATH']}"}
# glibc keeps freed blocks under its mmap threshold, which rises with the blocks freed (up to 32 MiB), in the
# heap; fixed at 128 KiB every larger block goes back to the system when freed: the live tensors alone.
RETURNED = {"MALLOC_MMAP_THRESHOLD_": "131072"}
MOE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=4, n_routed_experts=16, moe_intermediate_size=256, q_lora_rank=64, kv_lora_rank=32,
           qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)


def write_long_lines(path: Path, count: int, seq_len: int, seed: int = 0) -> Path:
    """Prompt/completion lines longer than a row (truncated to it): every row full, every token but the first a
    target, the case the plan counts (it cannot know how full the rows of other data will be)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            words = " ".join(rng.choice(WORDS) for _ in range(seq_len))
            f.write(json.dumps({"prompt": rng.choice(WORDS), "completion": " " + words}) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(ranks: int, overrides: list[str]) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", "unified.plan.measured", *overrides]
    return [str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()), "--module",
            "unified.plan.measured", *overrides]


def measure(ranks: int, overrides: list[str], cwd: Path, env: dict) -> list[dict]:
    """Each rank's `measured:` line."""
    run = subprocess.run(command(ranks, overrides), cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, **ENV, **env}, timeout=3600)
    decoder, lines, at = json.JSONDecoder(), [], run.stdout.find(PREFIX)
    while at >= 0:  # ranks share the launcher's stdout: their lines may run together
        result, end = decoder.raw_decode(run.stdout, at + len(PREFIX))
        lines.append(result)
        at = run.stdout.find(PREFIX, end)
    if run.returncode or len(lines) != ranks:
        raise RuntimeError(f"{' '.join(overrides)} exited with {run.returncode}:\n{run.stdout[-2000:]}\n"
                           f"{run.stderr[-3000:]}")
    return sorted(lines, key=lambda r: r["rank"])


def build_moe(path: Path) -> Path:
    """The small MoE checkpoint, built in a process of its own (tests/conftest.py's builder sets test-only
    environment at import) with SmolLM2's tokenizer beside it."""
    sys.path.insert(0, str(ROOT))
    from unified.checkpoint.builtin import resolve_model

    code = ("import shutil, sys; from pathlib import Path; from tests.conftest import build_tiny_hf_model\n"
            "path, tokenizer = Path(sys.argv[1]), Path(sys.argv[2])\n"
            f"build_tiny_hf_model('deepseek_v3', **{MOE!r}).save_pretrained(path)\n"
            "for name in ('tokenizer.json', 'tokenizer_config.json'): shutil.copy(tokenizer / name, path / name)\n")
    subprocess.run([sys.executable, "-c", code, str(path), str(resolve_model("smollm2"))], cwd=ROOT,
                   env={**os.environ, **ENV}, check=True)
    return path


def cases(args, tmp: Path) -> list[tuple[str, int, list[str], dict]]:
    serve = ["model=smollm2", "device.name=cpu", f"engine.kv_cache_bytes={KV_BUDGET}"]
    out: list[tuple[str, int, list[str], dict]] = []
    if "moe" in args.only:
        moe = build_moe(tmp / "moe")
        out.append(("serve small MoE, EP=2", 2, [f"model={moe}", "device.name=cpu", "parallel.expert=2",
                                                 f"engine.kv_cache_bytes={KV_BUDGET // 4}"], {}))
    if "serve" in args.only:
        out += [("serve smollm2, packed weights", 1, serve, {}),
                ("serve smollm2, plain weights", 1, [*serve, "engine.packed_weights=false"], {}),
                ("serve smollm2, int8 weights", 1, [*serve, "engine.quantization=int8"], {})]
    if "train" in args.only:
        data = write_long_lines(tmp / "train.jsonl", 64, args.seq_len)
        allocators = [("", {})] + ([(", mmap>=128K", RETURNED)] if args.allocator == "both" else [])
        for ranks in (1, 2):
            for stage in (0, 2, 3):
                for label, env in allocators:
                    micro = args.micro_batch if ranks == 1 else max(1, args.micro_batch // 2)
                    out.append((f"sft smollm2, ZeRO-{stage}{label}", ranks, [
                        "plan.mode=train", "model=smollm2", "device.name=cpu", f"data={data}",
                        f"output={tmp / f'sft-{ranks}-{stage}{bool(env)}'}", f"steps={args.steps}",
                        f"train.seq_len={args.seq_len}", f"train.micro_batch_size={micro}",
                        f"train.zero_stage={stage}", "train.wandb=disabled"], env))
    return out


def mb(n: float) -> str:
    return f"{n / 1e6:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="serve,train,moe", help="comma-separated: serve, train, moe")
    parser.add_argument("--steps", type=int, default=3, help="training steps per fine-tuning case")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2, help="rows per step on one rank (two ranks: half)")
    parser.add_argument("--allocator", choices=("both", "default"), default="default",
                        help="fine-tuning also with glibc's mmap threshold fixed at 128 KiB (freed blocks returned)")
    args = parser.parse_args()
    args.only = args.only.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        for name, ranks, overrides, env in cases(args, Path(tmp)):
            print(f"{name}, {ranks} rank(s) ...", file=sys.stderr, flush=True)
            for r in measure(ranks, overrides, Path(tmp), env):
                rows.append((name, ranks, r, overrides, env))
    print(f"\n{'case':<36}{'ranks':>6}{'rank':>5}{'total MB: predicted':>21}{'measured':>9}{'ratio':>7}"
          f"{'rise MB: predicted':>20}{'measured':>9}{'ratio':>7}{'baseline':>10}{'recorded':>10}")
    for name, ranks, r, _, _ in rows:
        rise_p, rise_m = r["predicted"] - r["baseline"], r["peak"] - r["baseline"]
        print(f"{name:<36}{ranks:>6}{r['rank']:>5}{mb(r['predicted']):>21}{mb(r['peak']):>9}"
              f"{r['predicted'] / r['peak']:>7.3f}{mb(rise_p):>20}{mb(rise_m):>9}{rise_p / rise_m:>7.3f}"
              f"{mb(r['baseline']):>10}{mb(r['recorded_reserve']):>10}")
    print("\nratio = predicted / measured; rise = above the baseline; baseline = VmRSS before the model is loaded; "
          "recorded = configs/hardware/cpu.yaml's reserve_bytes")
    print("\nbreakdowns (MB, the plan's components for rank 0 of each case) and whole-run peaks (save/export "
          "included):")
    for name, ranks, r, _, _ in rows:
        if r["rank"] == 0:
            parts = ", ".join(f"{k} {mb(v)}" for k, v in r["breakdown"].items() if v)
            print(f"  {name} x{ranks}: {parts}; whole run {mb(r['end'])}")
    print("\ncommands (from the repository root):")
    seen = set()
    for name, ranks, _, overrides, env in rows:
        if (name, ranks) not in seen:
            seen.add((name, ranks))
            line = "".join(f"{k}={v} " for k, v in env.items()) + " ".join(command(ranks, overrides))
            print("  " + line.replace(str(BIN) + "/", ".venv/bin/").replace(sys.executable, ".venv/bin/python"))


if __name__ == "__main__":
    main()
