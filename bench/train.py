"""Fine-tuning speed and memory: our `recipe=sft` beside a bare PyTorch loop and `transformers` Trainer, one run.

    .venv/bin/python bench/train.py [--model smollm2] [--seq-len 256] [--micro-batch 4] [--warmup 2]
                                    [--steps 8] [--rounds 2] [--memory-steps 2]
    .venv/bin/python bench/train.py --quick   # tiny random model, a smoke test of the whole bench

fp32 on CPU, one rank, on generated chat and prompt/completion lines of random words (written to a temp
folder). Every contestant is its own process, started fresh each round, and trains on the same rows:
- unified: the real `python -m unified recipe=sft` (DeepSpeed, ZeRO stage of configs/train/default.yaml,
  recipe defaults otherwise). Its step times are the moments its metrics.jsonl lines appear, so every
  cost of the loop (logging included) counts.
- bare: our CausalLM from unified.checkpoint.load_model in a plain loop: forward, the head and
  cross-entropy on the target tokens (what the recipe computes), backward, clip, torch AdamW step.
  Same rows, packing, collate and LR schedule, so its losses must match ours: the gap is pure overhead.
- transformers: Trainer on LlamaForCausalLM from the same folder (sdpa), the same packed rows given as
  position_ids that restart per example (transformers builds the per-example mask from them) and labels
  placed so that it scores the same target tokens. It computes logits at every position.
Rounds alternate the contestants (A/B/C/A/B/C) because the host is shared; the first `--warmup` steps
of each run are not timed; tokens/s counts non-padding tokens. A matmul is measured before and after.

Memory: peak RSS (host memory, VmHWM of /proc/<pid>/status, polled from outside) of each rank of
`deepspeed --num_gpus 2 --module unified recipe=sft` under ZeRO-1/2/3 with half the micro-batch, beside
the one-rank runs above and a process that only imports the training stack (the floor every rank pays).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from throughput import matmul_gflops

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORDS = ("the model learns a short answer from each line of text while the loss goes down over many steps and "
         "every token counts once in the mean so packing rows keeps the batch full of useful work for training "
         "numbers like seven twelve forty and names such as river stone garden window letter music").split()
QUICK = dict(seq_len=128, micro_batch=2, warmup=1, steps=3, rounds=1, memory_steps=2)
LABELS = {"unified": "unified recipe=sft (default ZeRO stage)", "bare": "bare PyTorch loop, our CausalLM",
          "transformers": "transformers Trainer (sdpa)"}


# ---------------------------------------------------------------- workload

def write_data(path: Path, count: int, seq_len: int, seed: int = 0) -> Path:
    """Chat and prompt/completion lines of random words, sized to fit a row with room for a second."""
    rng = random.Random(seed)
    words = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    longest = max(8, seq_len // 4)
    with path.open("w") as f:
        for i in range(count):
            question, answer = words(4, longest // 3), words(4, longest)
            if i % 2:
                f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                                 {"role": "assistant", "content": answer}]}) + "\n")
            else:
                f.write(json.dumps({"prompt": question, "completion": " " + answer}) + "\n")
    return path


def tiny_model(path: Path) -> Path:
    """A 2-layer random Llama with the built-in model's tokenizer and chat template (for --quick)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from unified.checkpoint.builtin import resolve_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (resolve_model("smollm2") / name).is_file():
            shutil.copy(resolve_model("smollm2") / name, path / name)
    return path


# ---------------------------------------------------------------- watching a run from outside

def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _rank_processes(root: int) -> dict[int, int]:
    """pid -> rank of the training processes under `root`: itself, or a launcher's `-m unified` children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    ranks, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if pid == root and "--worker" in argv:
            ranks[pid] = 0
        elif any(a == "-m" and b == "unified" for a, b in zip(argv, argv[1:])):
            ranks[pid] = next((int(a.split("=")[1]) for a in argv if a.startswith("--local_rank=")), 0)
    return ranks


@dataclass
class Watched:
    step_ends: list[float] = field(default_factory=list)  # when each metrics.jsonl line appeared
    peak_kb: dict[int, int] = field(default_factory=dict)  # rank -> VmHWM at the end of the run
    trained_kb: dict[int, int] = field(default_factory=dict)  # rank -> VmHWM when the last step's line appeared


def watch(command: list[str], log: Path, metrics: Path | None = None, steps: int = 0, env: dict | None = None,
          timeout: float = 1800) -> Watched:
    """Runs `command` to the end, polling its ranks' peak memory and (if given) the metrics file's lines."""
    seen, ranks, found_at = Watched(), {}, 0.0
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            now = time.perf_counter()
            if now - found_at > 1.0:  # walking /proc costs more than reading a few files: once a second
                ranks, found_at = _rank_processes(proc.pid), now
            if metrics is not None and metrics.is_file():
                lines = metrics.read_bytes().count(b"\n")
                seen.step_ends += [now] * (lines - len(seen.step_ends))
            for pid, rank in ranks.items():
                seen.peak_kb[rank] = max(seen.peak_kb.get(rank, 0), _status_kb(pid, "VmHWM"))
                if steps and len(seen.step_ends) >= steps and rank not in seen.trained_kb:
                    seen.trained_kb[rank] = seen.peak_kb[rank]  # before the final save and export
            if time.monotonic() > deadline:
                proc.kill()
            time.sleep(0.05)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command[:6])} ... exited with {proc.returncode}:\n"
                           + log.read_text()[-3000:])
    return seen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the contestants

@dataclass
class Run:
    tokens_per_s: float
    losses: list[float]
    step_s: float  # median timed step
    peak_mb: float  # VmHWM of the process
    trained_mb: float | None = None  # VmHWM when the last step's metrics line appeared


def throughput(step_ends: list[float], tokens: list[int], warmup: int) -> tuple[float, float]:
    """Tokens/s and median step seconds over the steps after `warmup` (from step end times; warmup >= 1)."""
    durations = [b - a for a, b in zip(step_ends[warmup - 1:], step_ends[warmup:])]
    return sum(tokens[warmup:]) / (step_ends[-1] - step_ends[warmup - 1]), statistics.median(durations)


def run_ours(args, model: Path, data: Path, folder: Path, extra: tuple[str, ...] = (),
             launcher: list[str] | None = None, env: dict | None = None) -> tuple[Watched, list[dict]]:
    output = folder / "out"
    command = [*(launcher or [sys.executable, "-m"]), "unified", "recipe=sft", f"model={model}", f"data={data}",
               f"output={output}", f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
               f"steps={args.warmup + args.steps}", *extra]
    seen = watch(command, folder / "log.txt", output / "metrics.jsonl", args.warmup + args.steps, env)
    return seen, [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def ours(args, model: Path, data: Path, folder: Path) -> Run:
    seen, records = run_ours(args, model, data, folder)
    rate, step_s = throughput(seen.step_ends, [r["tokens"] for r in records], args.warmup)
    return Run(rate, [r["loss"] for r in records], step_s, seen.peak_kb[0] / 1024, seen.trained_kb[0] / 1024)


def worker(kind: str, args, model: Path, data: Path, folder: Path) -> Run:
    result = folder / "result.json"
    command = [sys.executable, __file__, "--worker", kind, "--result", str(result), "--model-path", str(model),
               "--data", str(data), "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
               "--warmup", str(args.warmup), "--steps", str(args.steps)]
    seen = watch(command, folder / "log.txt")
    out = json.loads(result.read_text())
    rate, step_s = throughput(out["step_ends"], out["tokens"], args.warmup)
    return Run(rate, out["losses"], step_s, seen.peak_kb[0] / 1024)


def _workload(args):
    """What the recipe would train on: its examples, row stream and pad id, with its defaults."""
    from transformers import AutoTokenizer

    from unified.config.schema import RunConfig, TrainConfig
    from unified.train.data import load_examples
    from unified.train.packing import RowStream

    tc, seed = TrainConfig(seq_len=args.seq_len, micro_batch_size=args.micro_batch), RunConfig.seed
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    examples = load_examples(args.data, tokenizer, tc.seq_len)
    stream = RowStream(examples, tc.seq_len, tc.packing, tc.shuffle, seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return tc, examples, stream, pad_id


def bare_loop(args) -> dict:
    import torch
    import torch.nn.functional as F

    from unified.checkpoint import load_model
    from unified.model.forward_context import forward_context
    from unified.runtime import init_distributed, select_accelerator
    from unified.train.data import IGNORE
    from unified.train.engine import lr_factor
    from unified.train.packing import PackedAttention, collate

    init_distributed(select_accelerator("cpu"))  # megatron's layers need parallel_state, even on one rank
    tc, examples, stream, pad_id = _workload(args)
    torch.manual_seed(0)
    model = load_model(args.model_path).model
    model.train()
    total = args.warmup + args.steps
    optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() >= 2]},
                                   {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=tc.lr, weight_decay=tc.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, tc))
    out = {"step_ends": [], "tokens": [], "losses": []}
    for step in range(total):
        batch = collate(examples, stream.rows(step * tc.micro_batch_size, tc.micro_batch_size), pad_id)
        with forward_context(PackedAttention(batch.segments)):
            hidden = model(batch.input_ids, batch.positions)  # [B, L, H]
        keep = batch.targets != IGNORE
        loss = F.cross_entropy(model.vocab_parallel_logits(hidden[keep]).float(), batch.targets[keep])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        out["losses"].append(loss.item())
        out["step_ends"].append(time.perf_counter())
        out["tokens"].append(batch.num_tokens)
    return out


def hf_trainer(args) -> dict:
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from unified.train.data import IGNORE
    from unified.train.packing import collate

    tc, examples, stream, pad_id = _workload(args)
    total = args.warmup + args.steps
    rows = stream.rows(0, total * tc.micro_batch_size)

    class Rows(torch.utils.data.IterableDataset):  # iterable: Trainer keeps the order instead of shuffling
        def __iter__(self):
            return iter(rows)

    def collator(batch_rows):
        batch = collate(examples, batch_rows, pad_id)
        # transformers shifts labels by one itself; ours are already the next token's label.
        labels = torch.cat([torch.full_like(batch.targets[:, :1], IGNORE), batch.targets[:, :-1]], dim=1)
        return {"input_ids": batch.input_ids, "position_ids": batch.positions, "labels": labels, "use_cache": False}

    out = {"step_ends": [], "losses": [],
           "tokens": [sum(len(examples[i].input_ids) for row in rows[s:s + tc.micro_batch_size] for i in row)
                      for s in range(0, len(rows), tc.micro_batch_size)]}

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            out["step_ends"].append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "loss" in logs:
                out["losses"].append(logs["loss"])

    model = LlamaForCausalLM.from_pretrained(args.model_path, dtype=torch.float32, attn_implementation="sdpa")
    settings = TrainingArguments(
        output_dir=str(Path(args.result).parent / "hf"), per_device_train_batch_size=tc.micro_batch_size,
        max_steps=total, learning_rate=tc.lr, lr_scheduler_type="cosine", warmup_steps=tc.warmup_steps,
        weight_decay=tc.weight_decay, max_grad_norm=tc.max_grad_norm, optim="adamw_torch", use_cpu=True,
        logging_strategy="steps", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, remove_unused_columns=False, seed=0)
    Trainer(model=model, args=settings, train_dataset=Rows(), data_collator=collator, callbacks=[Clock()]).train()
    return out


# ---------------------------------------------------------------- the run

def import_floor() -> None:
    import deepspeed  # noqa: F401
    import megatron.core  # noqa: F401
    import transformers  # noqa: F401

    import unified.train.engine  # noqa: F401
    import unified.train.trainer  # noqa: F401


def training(args, model: Path, data: Path, tmp: Path) -> dict[str, list[Run]]:
    """Rounds of the three contestants, alternating."""
    contestants = {"unified": ours, "bare": lambda *a: worker("bare", *a), "transformers": lambda *a: worker("hf", *a)}
    runs: dict[str, list[Run]] = {key: [] for key in contestants}
    for r in range(args.rounds):
        for key, run in contestants.items():
            folder = tmp / f"{key}-{r}"
            folder.mkdir()
            runs[key].append(run(args, model, data, folder))
            print(f"round {r + 1} {key}: {runs[key][-1].tokens_per_s:.0f} tok/s", file=sys.stderr, flush=True)
    return runs


def zero_memory(args, model: Path, data: Path, folder: Path, stage: int) -> Watched:
    """Two ranks of the recipe under ZeRO `stage`, each with half the micro-batch (the same global batch)."""
    short = argparse.Namespace(**{**vars(args), "micro_batch": max(1, args.micro_batch // 2),
                                  "warmup": 0, "steps": args.memory_steps})
    launcher = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "--module"]
    seen, _ = run_ours(short, model, data, folder, (f"train.zero_stage={stage}",), launcher,
                       {"OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{os.environ['PATH']}"})
    return seen


def memory(args, runs: dict[str, list[Run]], model: Path, data: Path, tmp: Path) -> tuple[list[tuple], float]:
    """Rows of (what, ranks, micro-batch, MB through the last step, MB whole run) and the import floor in MB."""
    (tmp / "floor").mkdir()
    floor = watch([sys.executable, __file__, "--worker", "floor"], tmp / "floor" / "log.txt").peak_kb[0] / 1024
    rows = [(LABELS[key], 1, args.micro_batch,
             "" if done[0].trained_mb is None else f"{max(r.trained_mb for r in done):.0f}",
             f"{max(r.peak_mb for r in done):.0f}") for key, done in runs.items()]
    for stage in (1, 2, 3):
        (tmp / f"zero{stage}").mkdir()
        seen = zero_memory(args, model, data, tmp / f"zero{stage}", stage)
        per_rank = lambda kb: " / ".join(f"{kb[r] / 1024:.0f}" for r in sorted(kb))  # noqa: E731
        rows.append((f"unified ZeRO-{stage}", 2, max(1, args.micro_batch // 2), per_rank(seen.trained_kb),
                     per_rank(seen.peak_kb)))
        print(f"ZeRO-{stage}: {rows[-1][3]} MB", file=sys.stderr, flush=True)
    return rows, floor


def report(args, name: str, params: int, runs: dict[str, list[Run]], rows: list[tuple], floor: float,
           gflops: tuple[float, float]) -> None:
    import torch

    from unified.config.schema import TrainConfig

    print(f"\nmodel {name} ({params / 1e6:.1f}M parameters), fp32, CPU, {torch.get_num_threads()} threads; "
          f"seq_len {args.seq_len}, micro-batch {args.micro_batch}, {args.warmup} warm-up + {args.steps} timed "
          f"steps, {args.rounds} round(s)")
    print(f"host: matmul {gflops[0]:.0f} GFLOP/s before, {gflops[1]:.0f} after; the recipe's default ZeRO stage: "
          f"{TrainConfig.zero_stage} (None: 0 on one rank, 1 on several)")
    print(f"\n{'training, 1 rank':<40}{'tok/s':>8}{'step s':>8}{'loss 1st':>10}{'loss last':>10}   rounds (tok/s)")
    for key, done in runs.items():
        rate = statistics.median(r.tokens_per_s for r in done)
        print(f"{LABELS[key]:<40}{rate:>8.0f}{statistics.median(r.step_s for r in done):>8.2f}"
              f"{done[0].losses[0]:>10.4f}{done[0].losses[-1]:>10.4f}   "
              f"{', '.join(f'{r.tokens_per_s:.0f}' for r in done)}")
    overhead = [b.tokens_per_s / a.tokens_per_s - 1 for a, b in zip(runs["unified"], runs["bare"])]
    print(f"our overhead against the bare loop (bare tok/s / ours - 1), paired rounds: "
          f"{', '.join(f'{o:+.1%}' for o in overhead)}; median {statistics.median(overhead):+.1%} (target <= 10%)")
    print(f"unified / transformers Trainer, paired rounds: "
          f"{', '.join(f'{a.tokens_per_s / c.tokens_per_s:.2f}' for a, c in zip(runs['unified'], runs['transformers']))}")
    drift = max(abs(a - b) / abs(b) for a, b in zip(runs["unified"][0].losses, runs["bare"][0].losses))
    print(f"unified and bare losses agree step by step to {drift:.1e} (relative): the same work")

    print(f"\n{'peak host memory (RSS), MB per rank':<40}{'ranks':>6}{'micro':>7}{'to last step':>16}{'whole run':>16}")
    for label, ranks, micro, trained, peak in rows:
        print(f"{label:<40}{ranks:>6}{micro:>7}{trained:>16}{peak:>16}")
    print(f"(CPU, so memory is host RSS: each rank's VmHWM, read when its last metrics line appears and at exit, "
          f"which adds the final checkpoint save and export; a process that only imports the training stack "
          f"peaks at {floor:.0f} MB)")


def count_parameters(model: Path) -> int:
    import math

    from safetensors import safe_open

    total = 0
    for file in model.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a checkpoint folder or a built-in model name")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="steps run before timing starts")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--memory-steps", type=int, default=2, help="steps of each two-rank ZeRO run")
    parser.add_argument("--quick", action="store_true", help="tiny random model and short runs: a smoke test")
    for hidden in ("--worker", "--result", "--model-path", "--data"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the first step's start is not observed)")
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("DS_ACCELERATOR", "cpu")):
        os.environ.setdefault(key, value)
    if args.worker == "floor":
        import_floor()
    elif args.worker:
        Path(args.result).write_text(json.dumps({"bare": bare_loop, "hf": hf_trainer}[args.worker](args)))
    else:
        if args.quick:
            vars(args).update(QUICK)
        gflops_before = matmul_gflops()
        with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
            tmp = Path(tmp)
            if args.quick:
                model, name = tiny_model(tmp / "model"), "tiny random Llama"
            else:
                from unified.checkpoint.builtin import resolve_model

                model, name = resolve_model(args.model), args.model
            rows_needed = (args.warmup + args.steps) * args.micro_batch
            data = write_data(tmp / "train.jsonl", max(64, 3 * rows_needed), args.seq_len)
            runs = training(args, model, data, tmp)
            rows, floor = memory(args, runs, model, data, tmp)
            params = count_parameters(model)
        report(args, name, params, runs, rows, floor, (gflops_before, matmul_gflops()))


if __name__ == "__main__":
    main()
