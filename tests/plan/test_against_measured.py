"""The plan against what a fresh process really holds (unified.plan.measured): a tiny fine-tuning run's peak
resident memory within 10% of the plan, as the total and as the rise above the process's baseline; and a KV
budget the planner suggests for a card it said was too small starts the engine, within that card."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from tests.conftest import ROOT, build_tiny_chat_checkpoint
from unified.plan.measured import PREFIX, run_config

WORDS = "river stone garden window letter music seven twelve forty short answer learns every token".split()


def measure(*overrides: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "unified.plan.measured", "device.name=cpu", *overrides],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith(PREFIX))[len(PREFIX):])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_checkpoint):
    """A 2-layer Llama of width 256 with SmolLM2's 49152-token vocabulary: 13M parameters, most in the tied
    embedding, and a loss over 49152 logits per token, so both the training state and the activations count."""
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("wide"), smollm2_checkpoint, hidden_size=256)


def test_tiny_sft_peak_is_the_plan_s(checkpoint, tmp_path):
    rng = random.Random(0)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": rng.choice(WORDS),  # rows full of targets: what the plan counts
                                        "completion": " " + " ".join(rng.choices(WORDS, k=200))}) + "\n"
                            for _ in range(8)))
    got = measure("plan.mode=train", f"model={checkpoint}", f"data={data}", f"output={tmp_path / 'out'}", "steps=2",
                  "train.seq_len=128", "train.micro_batch_size=2", "train.wandb=disabled")
    assert got["optimizer_steps"] == 2
    assert got["predicted"] == pytest.approx(got["peak"], rel=0.1), got
    rise, planned = got["peak"] - got["baseline"], got["predicted"] - got["baseline"]
    assert rise > 200e6  # the run is big enough for the comparison to mean something
    assert planned == pytest.approx(rise, rel=0.1), got


def test_a_kv_budget_the_planner_suggests_starts_within_the_card(checkpoint, tmp_path):
    from dataclasses import replace

    from omegaconf import OmegaConf

    from unified.plan import load_hardware, plan_for

    card = 1_000_000_000
    small = tmp_path / "small.yaml"
    small.write_text(OmegaConf.to_yaml(OmegaConf.structured(replace(load_hardware("cpu"), memory_bytes=card))))
    cfg = run_config([f"model={checkpoint}", f"plan.hardware={small}", "engine.kv_cache_bytes=4000000000"])
    plan = plan_for(cfg)
    assert not plan.requested.fits
    fix = next(f for f in plan.fixes if f.startswith("engine.kv_cache_bytes="))
    assert plan_for(OmegaConf.merge(cfg, OmegaConf.from_dotlist([fix]))).requested.fits
    got = measure(f"model={checkpoint}", fix)
    # What the run added to its baseline fits what the plan left the card besides its reserve (how well
    # configs/hardware/cpu.yaml's reserve matches a process's baseline is measured by bench/plan.py).
    assert got["steps"] >= 2 and got["peak"] - got["baseline"] <= card - plan.hardware.reserve_bytes, got
