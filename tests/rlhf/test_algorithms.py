"""GRPO and PPO colocated on a tiny random model: the engine samples the trainer's own parameters, its
log-probabilities match the trainer's forward, the gate stops a run whose engine samples something else,
the KV cache is given back while training, and a synthetic reward is learned."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from tests.engine.conftest import make_engine
from unified import kernels
from unified.checkpoint import load_model
from unified.config.schema import LoraConfig, RLHFConfig, TrainConfig
from unified.errors import UserError
from unified.rlhf.algorithms import GRPO, PolicyObjective, Prompt, algorithm, check_rlhf_config, value_head
from unified.rlhf.placement import Colocated
from unified.rlhf.rollout import TokenBatch, completion_forward, completion_logprobs, generate
from unified.train.engine import initialize
from unified.checkpoint.lora import apply_lora

TARGET = 16  # the synthetic task: completion tokens below this id (a tenth of the tiny vocabulary) score


def low_tokens(prompts, completions, completion_ids, **_):
    return [sum(t < TARGET for t in ids) / max(1, len(ids)) for ids in completion_ids]


def _prompts(rng: random.Random, count: int) -> list[Prompt]:
    return [Prompt([rng.randrange(160) for _ in range(6)], "", {}) for _ in range(count)]


def _grpo(tiny_checkpoint, lora: bool = False, lr: float = 3e-3, **options) -> GRPO:
    """A GRPO learner (or, with algorithm="ppo", a PPO one) on a fresh copy of the tiny Llama."""
    loaded = load_model(tiny_checkpoint("llama"))  # a fresh copy: the run trains it
    if lora:
        apply_lora(loaded.model, LoraConfig(rank=4))
    cfg = RLHFConfig(**{"num_generations": 8, "prompts_per_step": 8, "max_tokens": 8, **options})
    check_rlhf_config(cfg)
    train_cfg = TrainConfig(lr=lr, warmup_steps=0, schedule="constant", zero_stage=0)
    critic = value_head(loaded.model) if cfg.algorithm == "ppo" else None
    trainer = initialize(loaded.model, train_cfg, torch.float32, 1, 1000, PolicyObjective(loaded.model, cfg, critic))
    reference = None if lora else load_model(tiny_checkpoint("llama")).model
    engine = make_engine(loaded, num_blocks=128, packed_weights=True)
    return algorithm(cfg.algorithm)(Colocated(engine, loaded.model), trainer, low_tokens, cfg, reference, seed=1)


@pytest.mark.parametrize("options", [{}, {"algorithm": "ppo", "kl_coef": 0.0, "kl_estimator": "k1"}], ids=["grpo", "ppo"])
def test_a_synthetic_reward_is_learned(runtime, tiny_checkpoint, options):
    grpo, rng = _grpo(tiny_checkpoint, **options), random.Random(0)
    started, rewards = time.monotonic(), []
    while len(rewards) < 60 and not (len(rewards) >= 3 and min(rewards[-3:]) > 0.6):
        rewards.append(grpo.step(_prompts(rng, 8))["reward"])
    assert rewards[0] < 0.2, rewards
    assert min(rewards[-3:]) > 0.6, f"rewards {rewards} after {time.monotonic() - started:.0f} s"


@pytest.mark.parametrize("lora", [False, True], ids=["all-weights", "lora"])
def test_the_engine_samples_the_trainers_parameters_and_logprobs_agree(runtime, tiny_checkpoint, lora):
    grpo = _grpo(tiny_checkpoint, lora=lora, lr=1e-2)
    trained = {name: p for name, p in grpo.trainer.module.model.named_parameters()}
    served = dict(grpo.rollouts.engine.model.named_parameters())
    assert served.keys() == trained.keys()
    assert all(served[n].data_ptr() == trained[n].data_ptr() for n in served), "the engine holds copies"
    rng = random.Random(0)
    first = grpo.step(_prompts(rng, 8))
    second = grpo.step(_prompts(rng, 8))  # sampled after an update: packed copies must have followed it
    for metrics in (first, second):
        assert metrics["sampling/sampling_logp_difference/mean"] <= 1e-5, metrics
    rollouts = generate(grpo.rollouts.engine, [p.ids for p in _prompts(rng, 2)], 2, 8, seed=5)
    batch = TokenBatch.of(rollouts)
    with torch.no_grad():
        trainer_logp = completion_logprobs(grpo.model, batch)
    assert ((trainer_logp - batch.sampling_logprobs).abs() * batch.mask).max() <= 1e-5


def test_the_gate_stops_a_run_whose_engine_samples_another_policy(runtime, tiny_checkpoint):
    grpo = _grpo(tiny_checkpoint)
    layer = grpo.model.layers["0"].mlp.down_proj
    assert layer.packed is not None
    # The engine's packed copy, and only it, now holds other weights (yet claims the current version).
    other = kernels.pack_weight(layer.weight.detach() + 0.5)
    layer.packed = dataclasses.replace(other, version=layer.weight._version)
    with pytest.raises(UserError, match=r"differ from the trainer's by .* \(rlhf.max_logprob_diff=0.001\)"):
        grpo.step(_prompts(random.Random(0), 2))


def test_the_kv_cache_is_released_while_training_and_taken_back_for_rollouts(runtime, tiny_checkpoint):
    grpo = _grpo(tiny_checkpoint)
    cache = grpo.rollouts.engine.runner.cache
    metrics = grpo.step(_prompts(random.Random(0), 2))
    assert metrics["memory/kv_cache_released_bytes"] == cache.total_bytes > 0
    assert not cache.allocated
    assert grpo.step(_prompts(random.Random(1), 2))["sampling/sampling_logp_difference/mean"] <= 1e-5


@pytest.mark.parametrize("pack_tokens", [0, 16, 4096], ids=["a-row-each", "some-packed", "all-packed"])
def test_packed_rows_compute_what_each_completion_alone_does(runtime, tiny_checkpoint, pack_tokens):
    """A prompt packed once with its completions gives each completion the log-probabilities, entropies
    and values of a plain causal forward of that prompt and completion alone."""
    grpo = _grpo(tiny_checkpoint, algorithm="ppo", num_generations=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    rollouts = generate(grpo.rollouts.engine, prompts, 3, 6, seed=3)
    batch = TokenBatch.of(rollouts, pack_tokens=pack_tokens)
    assert [len(r.completion_ids) for r in rollouts] == [6] * 6
    assert batch.input_ids.shape[0] == {0: 6, 16: 5, 4096: 2}[pack_tokens]  # 16: two of the first prompt's share a row
    head = torch.nn.Linear(grpo.model.config.hidden_size, 1)
    with torch.no_grad():
        out = completion_forward(grpo.model, batch, head, entropy=True)
        for b, r in enumerate(rollouts):
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            states = grpo.model(ids, torch.arange(ids.shape[1]))[0, len(r.prompt_ids) - 1:-1]
            log_probs = grpo.model.logits(states).float().log_softmax(-1)
            n = len(r.completion_ids)
            want = log_probs.gather(-1, torch.tensor(r.completion_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(out.logp[b, :n], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.entropy[b, :n], -(log_probs.exp() * log_probs).sum(-1), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(out.values[b, :n], head(states).squeeze(-1), atol=1e-5, rtol=1e-5)
            assert not out.logp[b, n:].any() and batch.mask[b].sum() == n
    first = batch.first(4)  # whole rows: all of the first prompt's completions when packed
    assert first.size == {0: 4, 16: 4, 4096: 6}[pack_tokens]
    torch.testing.assert_close(completion_logprobs(grpo.model, first), out.logp[:first.size])


def test_ppo_values_start_at_zero_and_learn(runtime, tiny_checkpoint):
    # no KL penalty: the returns are the rewards alone, so they do not grow as the policy drifts
    ppo = _grpo(tiny_checkpoint, algorithm="ppo", num_generations=2, kl_coef=0.0, kl_estimator="k1", vf_coef=1.0)
    prompts = _prompts(random.Random(0), 8)
    first = ppo.step(prompts)
    assert first["values/mean"] == 0.0 and first["value_loss"] > 0
    later = [ppo.step(prompts) for _ in range(7)]
    assert later[-1]["values/mean"] != 0.0

    # The rewards grow as the policy learns, and the loss of any value estimate with them; so the loss is
    # judged against what predicting zero would cost, which grows with the returns' second moment.
    def unexplained(m: dict) -> float:
        return m["value_loss"] / (m["reward"] ** 2 + m["reward_std"] ** 2)

    ratios = [unexplained(m) for m in [first, *later]]
    assert sum(ratios[-3:]) / 3 < 0.8 * ratios[0], ratios


@pytest.mark.parametrize("options,words", [({"num_generations": 1}, "at least 2"),
                                           ({"algorithm": "reinforce"}, "grpo or ppo"),
                                           ({"algorithm": "ppo", "lam": 1.5}, "within"),
                                           ({"kl_estimator": "k2"}, "k1 or k3"),
                                           ({"loss_level": "batch"}, "token or sequence"),
                                           ({"tis_cap": 0.0}, "positive")])
def test_bad_options_are_refused_before_anything_runs(options, words):
    with pytest.raises(UserError, match=words):
        check_rlhf_config(RLHFConfig(**options))
