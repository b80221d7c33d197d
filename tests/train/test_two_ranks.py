"""Training on two CPU ranks (gloo) follows the one-rank loss curve: data parallel under ZeRO-1, -2 and
-3 (through both launchers), and tensor parallel (also with sequence parallel and recomputation), whose
export gathers the slices into one checkpoint."""
from __future__ import annotations

import pytest

from tests.conftest import build_tiny_chat_checkpoint, run_cli
from tests.parallel.test_two_ranks import launch
from tests.train.test_trainer import write_addition_data
from unified.train.progress import read_steps

STEPS = 20
TRAIN = ("train.lr=3e-3", "train.warmup_steps=2", "train.seq_len=64", "train.wandb=disabled", f"steps={STEPS}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_addition_data(tmp_path_factory.mktemp("data") / "train.jsonl", count=96)


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory, smollm2_checkpoint):
    """Initialised as for pre-training (std 0.02): a well-conditioned start, where float rounding differences
    between layouts stay at rounding size over 20 steps (wide random weights amplify them)."""
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("chat"), smollm2_checkpoint, init_std=0.02)


@pytest.fixture(scope="module")
def one_rank(chat_checkpoint, data, tmp_path_factory):
    output = tmp_path_factory.mktemp("one-rank")
    result = run_cli("recipe=sft", f"model={chat_checkpoint}", f"data={data}", f"output={output}",
                     "train.micro_batch_size=2", *TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    return output


@pytest.mark.parametrize("launcher, options", [
    ("deepspeed", ("train.zero_stage=1", "train.micro_batch_size=1")),  # DP=2: each rank gets half the rows
    ("torchrun", ("train.zero_stage=2", "train.micro_batch_size=1")),
    ("deepspeed", ("train.zero_stage=3", "train.micro_batch_size=1")),
    ("deepspeed", ("parallel=tp2", "train.micro_batch_size=2")),  # TP=2: both ranks see every row
    ("deepspeed", ("parallel=tp2", "train.micro_batch_size=2", "train.sequence_parallel=true",
                   "train.activation_checkpointing=true")),
])
def test_two_ranks_follow_the_one_rank_loss_curve(chat_checkpoint, data, one_rank, tmp_path, launcher, options):
    output = tmp_path / "out"
    launch(launcher, "recipe=sft", f"model={chat_checkpoint}", f"data={data}", f"output={output}", *TRAIN,
           *options)
    want, got = read_steps(one_rank / "metrics.jsonl"), read_steps(output / "metrics.jsonl")
    assert len(got) == len(want) == STEPS
    assert want[-1].loss < 0.9 * want[0].loss  # it learns, so the comparison means something
    for a, b in zip(want, got):
        assert b.loss == pytest.approx(a.loss, rel=1e-5), f"step {a.step}"
        # One rank runs without ZeRO: its norm sums per-tensor squares, ZeRO's sums flat partitions (~1e-5 apart).
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4), f"step {a.step}"
        assert b.tokens == a.tokens

    import torch
    from safetensors.torch import load_file

    ours, theirs = load_file(output / "model.safetensors"), load_file(one_rank / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5, msg=name)
