"""`recipe=sft` end to end on one rank: a servable output, reports, exact resume after kill -9, and a
crash during a save that costs nothing but the unfinished save."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli
from unified.config.schema import LoraConfig
from unified.train.progress import read_steps

TRAIN = ("train.lr=3e-3", "train.warmup_steps=2", "train.seq_len=96", "train.micro_batch_size=2")


def write_addition_data(path: Path, count: int = 48, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(count):
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            if i % 2:
                f.write(json.dumps({"messages": [{"role": "user", "content": f"{a} plus {b}?"},
                                                 {"role": "assistant", "content": str(a + b)}]}) + "\n")
            else:
                f.write(json.dumps({"prompt": f"{a} + {b} =", "completion": f" {a + b}"}) + "\n")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_addition_data(tmp_path_factory.mktemp("data") / "train.jsonl")


def _sft_args(model: Path, data: Path, output: Path, steps: int, *extra: str) -> list[str]:
    return ["recipe=sft", f"model={model}", f"data={data}", f"output={output}", f"steps={steps}", *TRAIN, *extra]


def test_sft_writes_a_servable_model_and_its_reports(runtime, tiny_chat_checkpoint, data, tmp_path):
    from unified.checkpoint import load_model
    from unified.engine.llm import LLM
    from unified.engine.sampling_params import SamplingParams

    output = tmp_path / "out"
    result = run_cli(*_sft_args(tiny_chat_checkpoint, data, output, 8, "train.save_every=4", "train.wandb=offline"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"serve it with: unified recipe=serve model={output}" in result.stdout
    history = read_steps(output / "metrics.jsonl")
    assert [r.step for r in history] == list(range(1, 9))
    assert history[-1].loss < history[0].loss
    assert all(r.tokens > 0 and r.grad_norm is not None for r in history)
    assert (output / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (output / "checkpoints" / "latest").read_text() == "step-0000008"
    assert sorted(p.name for p in (output / "checkpoints").glob("step-*")) == ["step-0000004", "step-0000008"]
    assert list((output / "wandb").glob("offline-run-*")), "wandb kept no offline run"

    trained, base = load_model(output).model, load_model(tiny_chat_checkpoint).model
    changed = [n for (n, p), (_, q) in zip(trained.named_parameters(), base.named_parameters()) if not p.equal(q)]
    assert len(changed) == len(list(base.parameters()))
    with LLM(str(output), device="cpu", num_blocks=64) as llm:
        out = llm.chat([{"role": "user", "content": "3 plus 4?"}], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) >= 1


def _train_in_background(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "unified", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_resume_after_kill_9_continues_the_same_loss_curve(tiny_chat_checkpoint, data, tmp_path):
    steps = ("train.save_every=5", "train.wandb=disabled")
    reference = tmp_path / "reference"
    assert run_cli(*_sft_args(tiny_chat_checkpoint, data, reference, 20, *steps)).returncode == 0

    killed = tmp_path / "killed"
    args = _sft_args(tiny_chat_checkpoint, data, killed, 20, *steps)
    proc = _train_in_background(args)
    latest = killed / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not (latest.is_file() and latest.read_text() >= "step-0000010"):
        assert proc.poll() is None, f"training ended before it could be killed: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(read_steps(killed / "metrics.jsonl")) < 20

    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = read_steps(reference / "metrics.jsonl"), read_steps(killed / "metrics.jsonl")
    assert [r.step for r in got] == list(range(1, 21))
    for a, b in zip(want, got):
        assert b.loss == pytest.approx(a.loss, rel=1e-6), f"step {a.step}"
        assert b.lr == pytest.approx(a.lr, rel=1e-12)


def test_a_crash_during_a_save_leaves_the_last_good_checkpoint(tiny_chat_checkpoint, data, tmp_path):
    output = tmp_path / "out"
    args = _sft_args(tiny_chat_checkpoint, data, output, 4, "train.wandb=disabled")
    assert run_cli(*args).returncode == 0
    checkpoints = output / "checkpoints"
    # What a crash in the middle of saving step 6 leaves behind: a partial tag folder, a half-written
    # pointer file, a metrics line cut short.
    (checkpoints / "step-0000006").mkdir()
    (checkpoints / "step-0000006" / "mp_rank_00_model_states.pt").write_bytes(b"\x00" * 10)
    (checkpoints / "latest.tmp").write_text("step-00")
    with (output / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')
    result = run_cli(*_sft_args(tiny_chat_checkpoint, data, output, 6, "train.wandb=disabled"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "from step 4" in result.stdout + result.stderr
    assert [r.step for r in read_steps(output / "metrics.jsonl")] == list(range(1, 7))
    assert (checkpoints / "latest").read_text() == "step-0000006"


@pytest.mark.parametrize("override, message", [
    ({"zero_stage": 5}, "train.zero_stage=5 is not a ZeRO stage"),
    ({"schedule": "exponential"}, "train.schedule='exponential' is unknown"),
    ({"offload_params": True, "zero_stage": 1}, "train.offload_params needs train.zero_stage=3"),
    ({"offload_optimizer": True, "zero_stage": 0}, "train.offload_optimizer needs train.zero_stage 1, 2 or 3"),
    ({"wandb": "loud"}, "train.wandb='loud' is unknown"),
    ({"micro_batch_size": 0}, "train.micro_batch_size=0 must be at least 1"),
    ({"trainable": "lm"}, "train.trainable='lm' is unknown"),
    ({"trainable": "projector", "lora": LoraConfig(rank=4)}, "train.trainable=projector and LoRA"),
    ({"lr": -1e-3}, "train.lr=-0.001 must be at least 0"),
    ({"lr": float("nan")}, "train.lr=nan must be at least 0"),
    ({"min_lr_ratio": 5.0}, "train.min_lr_ratio=5.0 must be between 0 and 1"),
    ({"warmup_steps": -5}, "train.warmup_steps=-5 must be at least 0"),
    ({"lora": LoraConfig(rank=-2)}, "train.lora.rank=-2 must be at least 0"),
    ({"lora": LoraConfig(rank=4, alpha=0.0)}, "train.lora.alpha=0.0: LoRA scales"),
])
def test_bad_training_options_get_clear_errors(override, message):
    from unified.config.schema import TrainConfig
    from unified.errors import UserError
    from unified.train.engine import check_train_config

    with pytest.raises(UserError, match=re.escape(message)):
        check_train_config(TrainConfig(**override))


def test_bad_runs_fail_before_loading_with_clear_errors(tiny_chat_checkpoint, data, tmp_path):
    result = run_cli("recipe=sft", f"model={tiny_chat_checkpoint}", f"output={tmp_path}")
    assert result.returncode == 2 and "error: training needs data" in result.stderr
    result = run_cli(*_sft_args(tiny_chat_checkpoint, data, tmp_path, 0))
    assert result.returncode == 2 and "error: steps=0 must be at least 1" in result.stderr
    result = run_cli(*_sft_args(tiny_chat_checkpoint, data, tmp_path, 1), "train.seq_len=0")  # before the probe
    assert result.returncode == 2 and "error: train.seq_len=0 must be at least 1" in result.stderr
    assert "Traceback" not in result.stderr
