"""`recipe=grpo` from the command line: a short run on the tiny chat model writes its metrics and a servable
model; a bad run stops before anything loads, with a message saying what is wrong."""
from __future__ import annotations

import json
import re

import pytest

from tests.conftest import run_cli

TRL_NAMES = {"reward", "reward_std", "kl", "entropy", "clip_ratio", "completions/mean_length",
             "completions/clipped_ratio", "sampling/sampling_logp_difference/mean",
             "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/mean", "timing/rollout_s",
             "timing/train_s", "timing/sync_s", "rollout_tok_s", "train_tok_s"}
SHORT = ("steps=2", "rlhf.prompts_per_step=2", "rlhf.max_tokens=8", "rlhf.eval_prompts=4", "rlhf.eval_every=2")


def test_grpo_on_the_shipped_task_writes_metrics_and_a_servable_model(tiny_chat_checkpoint, tmp_path):
    output = tmp_path / "out"
    result = run_cli("recipe=grpo", f"model={tiny_chat_checkpoint}", f"output={output}", *SHORT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert set(lines[0]) == {"step", "eval/reward", "eval/reward_sampled", "eval/reward_sampled_stderr"}  # before training
    assert lines[0]["step"] == 0
    assert [line["step"] for line in lines[1:]] == [1, 2] and "eval/reward" in lines[-1]
    assert TRL_NAMES <= set(lines[1]), TRL_NAMES - set(lines[1])
    assert all(line["sampling/sampling_logp_difference/mean"] <= 1e-5 for line in lines[1:])
    assert (output / "config.json").is_file() and (output / "adapter" / "adapter_config.json").is_file()
    assert "serve it with: unified recipe=serve model=" in result.stdout


@pytest.mark.parametrize("options,words", [
    (("rlhf.reward=nowhere.at_all:f",), "cannot import 'nowhere.at_all'"),
    (("rlhf.num_generations=1",), "needs at least 2"),
    (("rlhf.mode=separate",), "needs at least one trainer rank and one rollout rank"),
])
def test_bad_grpo_runs_stop_before_loading(tiny_chat_checkpoint, tmp_path, options, words):
    result = run_cli("recipe=grpo", f"model={tiny_chat_checkpoint}", f"output={tmp_path}", *options)
    assert result.returncode == 2 and words in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("options,words", [
    (("rlhf.task=no_such_task",), "rlhf.task='no_such_task'"),
    (("parallel.tensor=2",), "without tensor, pipeline or expert parallelism"),
    (("data=/nonexistent/prompts.jsonl",), "/nonexistent/prompts.jsonl"),
    (("rlhf.reward_model=/nonexistent/rm",), "rlhf.reward_model='/nonexistent/rm' is not a checkpoint folder"),
    (("rlhf.algorithm=reinforce",), "grpo or ppo"),
    (("rlhf.mode=sideways",), "colocated or separate"),

    (("rlhf.algorithm=ppo", "rlhf.lam=1.5"), "within [0, 1]"),
])
def test_bad_runs_are_named_before_anything_loads(tmp_path, options, words):
    from omegaconf import OmegaConf

    from unified.config.schema import RunConfig
    from unified.errors import UserError
    from unified.rlhf.run import _check_run, _prompt_records

    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"job": "grpo", "output": str(tmp_path)},
                          OmegaConf.from_dotlist(list(options)))
    with pytest.raises(UserError, match=re.escape(words)):
        _check_run(cfg)
        _prompt_records(cfg)


@pytest.mark.parametrize("options,words", [
    (("rlhf.prompts_per_step=2",), "rlhf.prompts_per_step=2 leaves some of the 4 trainer ranks"),
    (("train.zero_stage=3",), "runs ZeRO-3 colocated only for now"),
    (("rlhf.rollout_parallel.tensor=8",), "needs 8 ranks per rollout engine, which the 4 rollout ranks"),
    (("rlhf.rollout_ranks=3", "rlhf.rollout_parallel.tensor=2"), "which the 3 rollout ranks do not divide"),
])
def test_impossible_separate_layouts_are_named(tmp_path, monkeypatch, options, words):
    from omegaconf import OmegaConf

    from unified.config.schema import RunConfig
    from unified.errors import UserError
    from unified.rlhf.run import _check_run

    monkeypatch.setenv("WORLD_SIZE", "8")  # a launch of 8 ranks: 4 trainer and 4 rollout ranks by default
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"job": "grpo", "output": str(tmp_path)},
                          OmegaConf.from_dotlist(["rlhf.mode=separate", *options]))
    with pytest.raises(UserError, match=re.escape(words)):
        _check_run(cfg)


def test_ppo_saves_its_value_head_beside_a_servable_model(tiny_chat_checkpoint, tmp_path):
    from safetensors.torch import load_file

    output = tmp_path / "out"
    result = run_cli("recipe=ppo", f"model={tiny_chat_checkpoint}", f"output={output}", *SHORT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 2 PPO steps" in result.stdout
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert {"value_loss", "values/mean"} <= set(lines[1]) and TRL_NAMES <= set(lines[1])
    head = load_file(output / "value_head.safetensors")
    assert head["weight"].shape == (1, 64) and head["bias"].shape == (1,)
    assert (output / "config.json").is_file() and (output / "adapter" / "adapter_config.json").is_file()


def test_ppo_under_zero3_gathers_the_weights_for_rollouts_and_reports_it(tiny_chat_checkpoint, tmp_path):
    """ZeRO-3 partitions the parameters: rollouts, the packed copies and the no-grad forwards get them whole,
    and the second rollouts sample the updated policy (the engine's log-probabilities equal the trainer's)."""
    from safetensors.torch import load_file

    output, data = tmp_path / "out", tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Count to {n}."}) for n in range(4)))
    result = run_cli("recipe=ppo", f"model={tiny_chat_checkpoint}", f"output={output}", "train.zero_stage=3",
                     f"data={data}", "rlhf.reward=tests.rlhf.rewards_for_tests:even_tokens",
                     "steps=2", "rlhf.prompts_per_step=2", "rlhf.max_tokens=8", "rlhf.eval_prompts=0",
                     "train.lr=1e-2", "train.wandb=disabled")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["sampling/sampling_logp_difference/mean"] <= 1e-5 and s["zero3/gathered_bytes"] > 0 for s in steps)
    assert steps[1]["kl"] > 1e-3 and "grad_norm" in steps[1]
    head = load_file(output / "value_head.safetensors")
    assert all(t.numel() > 0 for t in head.values()) and any(t.abs().sum() > 0 for t in head.values())


def test_a_run_started_again_continues_from_its_checkpoint(tiny_chat_checkpoint, tmp_path):
    """Prompts and a reward of the user's; stopped after 2 steps and started again for 4, the run takes
    the steps an uninterrupted run takes."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Say {word}.", "word": word}) for word in ("yes", "no", "maybe")))
    common = (f"model={tiny_chat_checkpoint}", f"data={data}", "rlhf.reward=tests.rlhf.rewards_for_tests:says_the_word",
              "rlhf.prompts_per_step=2", "rlhf.max_tokens=8", "train.lr=1e-2")
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert run_cli("recipe=grpo", *common, f"output={whole}", "steps=4").returncode == 0
    assert run_cli("recipe=grpo", *common, f"output={halves}", "steps=2").returncode == 0
    again = run_cli("recipe=grpo", *common, f"output={halves}", "steps=4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing from the checkpoint of step 2" in again.stdout + again.stderr
    want, got = ([json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
                 for folder in (whole, halves))
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3, 4]  # no held-out set without a task
    for a, b in zip(want, got):
        for key in ("reward", "loss", "kl", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
