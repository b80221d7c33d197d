"""A launch on several ranks takes the very step one colocated rank takes: rlhf.mode=separate on two CPU ranks
(one trainer, one rollout rank) and on three (by default two data-parallel trainer ranks, each on half of the
prompt groups, and one rollout rank), with the weights moving to the rollout rank by broadcast after each
update, and colocated on two ranks (each samples and trains on half of the prompt groups). A rollout engine split
by tensor parallelism gets its parts of the trained weights (resharded) and samples the trained policy."""
from __future__ import annotations

import json

from safetensors.torch import load_file

from tests.conftest import run_cli
from tests.parallel.test_two_ranks import launch

ADAPTER = "adapter/adapter_model.safetensors"


def test_several_ranks_take_the_same_first_step_as_one(tiny_chat_checkpoint, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Count to {n}."}) for n in range(4)))
    common = (f"model={tiny_chat_checkpoint}", f"data={data}", "rlhf.reward=tests.rlhf.rewards_for_tests:even_tokens",
              "steps=1", "rlhf.prompts_per_step=2", "rlhf.max_tokens=8", "train.lr=1e-2", "train.wandb=disabled")
    colocated = tmp_path / "colocated"
    result = run_cli("recipe=grpo", *common, f"output={colocated}")
    assert result.returncode == 0, result.stderr[-3000:]
    want = load_file(colocated / ADAPTER)
    assert max(want[k].abs().max().item() for k in want if "lora_B" in k) > 0  # the step did change the adapters
    first = json.loads((colocated / "metrics.jsonl").read_text().splitlines()[-1])
    for mode, ranks in (("separate", 2), ("separate", 3), ("colocated", 2)):
        separate = tmp_path / f"{mode}-{ranks}"
        launch("deepspeed", "recipe=grpo", *common, f"output={separate}", f"rlhf.mode={mode}", ranks=ranks)
        got = load_file(separate / ADAPTER)
        assert want.keys() == got.keys()
        assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-5, ranks
        step = json.loads((separate / "metrics.jsonl").read_text().splitlines()[-1])
        assert step["sampling/sampling_logp_difference/mean"] <= 1e-5
        assert step["reward_std"] > 0 and (mode == "colocated" or step["sync/bytes"] > 0)
        for name in ("reward", "kl", "entropy", "completions/mean_length"):  # of the whole batch, pooled
            assert abs(step[name] - first[name]) <= 1e-5, (ranks, name, step[name], first[name])


def test_a_tensor_parallel_rollout_engine_samples_the_trained_policy(tiny_chat_checkpoint, tmp_path):
    """One trainer rank, one rollout engine on two ranks (tensor parallel 2): after the first update the
    engine's log-probabilities of its samples equal the trainer's forward, so the resharded adapters arrived."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Count to {n}."}) for n in range(4)))
    output = tmp_path / "out"
    launch("deepspeed", "recipe=grpo", f"model={tiny_chat_checkpoint}", f"data={data}",
           "rlhf.reward=tests.rlhf.rewards_for_tests:even_tokens", "steps=2", "rlhf.prompts_per_step=2",
           "rlhf.max_tokens=8", "train.lr=1e-2", "train.wandb=disabled", f"output={output}", "rlhf.mode=separate",
           "rlhf.rollout_ranks=2", "rlhf.rollout_parallel.tensor=2", ranks=3)
    steps = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[1]["kl"] > 1e-2  # the policy of the second rollouts moved away from the reference
    assert all(s["sampling/sampling_logp_difference/mean"] <= 1e-5 for s in steps), steps
    assert steps[1]["sync/bytes"] > 0
