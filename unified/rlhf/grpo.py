"""One GRPO step, colocated: rollouts from the engine on the policy's own modules, rewards, group
advantages, the consistency gate, then `updates_per_batch` optimizer updates through DeepSpeed.

The old log-probabilities are the trainer's forward before the first update (the policy that sampled,
as the trainer computes it); the gate compares them with what the engine reported for the same tokens
and stops the run past `rlhf.max_logprob_diff`. Under LoRA the reference is the base model with the
adapters switched off, so no second copy of the weights exists; when all weights train it is a second,
frozen instance of the starting weights. After the update the engine's prefix cache is emptied (its K/V came from
the old policy) and its derived weight copies (packed CPU weights) are refreshed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from unified.errors import UserError
from unified.rlhf.advantages import group_advantages
from unified.rlhf.losses import KL_ESTIMATORS, LOSS_LEVELS, PolicyLossStats, masked_mean, policy_loss
from unified.rlhf.rewards import RewardFn, score
from unified.rlhf.rollout import Rollout, TokenBatch, completion_logprobs, generate
from unified.checkpoint.lora import adapters_disabled, has_adapters


def check_rlhf_config(cfg) -> None:
    """Every option a user can get wrong, before anything is loaded or generated."""
    if cfg.num_generations < 2:
        raise UserError(f"rlhf.num_generations={cfg.num_generations}: GRPO compares completions within a group, "
                        f"so it needs at least 2")
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise UserError(f"rlhf.kl_estimator={cfg.kl_estimator!r} is unknown; choose {' or '.join(KL_ESTIMATORS)}")
    if cfg.loss_level not in LOSS_LEVELS:
        raise UserError(f"rlhf.loss_level={cfg.loss_level!r} is unknown; choose {' or '.join(LOSS_LEVELS)}")
    for name in ("prompts_per_step", "max_tokens", "updates_per_batch"):
        if getattr(cfg, name) < 1:
            raise UserError(f"rlhf.{name}={getattr(cfg, name)} must be at least 1")
    if cfg.tis_cap is not None and cfg.tis_cap <= 0:
        raise UserError(f"rlhf.tis_cap={cfg.tis_cap} must be positive (or null: off)")


def _frozen(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


class PolicyObjective(nn.Module):
    """The policy loss inside one module forward, so that DeepSpeed (ZeRO-3 included) sees what it reads."""

    def __init__(self, model: nn.Module, cfg):
        super().__init__()
        self.model, self.cfg = model, cfg

    def forward(self, input_ids, completion_start, mask, old_logp, advantages, ref_logp,
                sampling_logp) -> tuple[torch.Tensor, PolicyLossStats]:
        cfg = self.cfg
        logp = completion_logprobs(self.model, TokenBatch(input_ids, completion_start, mask, sampling_logp))
        loss, stats = policy_loss(logp, old_logp, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                  ref_logp=ref_logp, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                                  level=cfg.loss_level, sampling_logp=sampling_logp, tis_cap=cfg.tis_cap)
        return loss, stats


@dataclass
class Prompt:
    ids: list[int]
    text: str | list[dict]  # what the reward function sees: the prompt's text or messages
    fields: dict  # the task's own fields (the answer, say), passed to the reward function


def score_rollouts(reward: RewardFn, prompts: list[Prompt], rollouts: list[Rollout]) -> list[float]:
    """The checked rewards of rollouts: each sees its prompt's text and task fields, and its completion ids."""
    fields = {key: [prompts[r.group].fields[key] for r in rollouts] for key in prompts[0].fields}
    fields["completion_ids"] = [r.completion_ids for r in rollouts]
    return score(reward, [prompts[r.group].text for r in rollouts], [r.text for r in rollouts], fields)


class GRPO:
    def __init__(self, engine, trainer, reward: RewardFn, cfg, reference: nn.Module | None = None, seed: int = 0):
        """`engine`: the LLMEngine over the policy's modules; `trainer`: the DeepSpeed engine around a
        PolicyObjective of the same model. Under LoRA the reference is the base model (adapters off);
        when every weight trains, `reference` must be the model as it starts (loaded a second time: it is
        frozen here)."""
        self.engine, self.trainer, self.reward, self.cfg = engine, trainer, reward, cfg
        self.model = trainer.module.model
        self.lora = has_adapters(self.model)
        if not self.lora and reference is None:
            raise ValueError("training every weight needs a reference model: the policy as it starts")
        self.reference = None if self.lora else _frozen(reference)
        self.seed = seed
        self.steps = 0

    def reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        if self.reference is not None:
            return completion_logprobs(self.reference, batch)
        with adapters_disabled(self.model):
            return completion_logprobs(self.model, batch)

    def refresh_derived_copies(self) -> None:
        """The engine's packed copies of weights that just changed (none change under LoRA: the base is frozen)."""
        if not self.lora and self.engine.cfg.packed_weights:
            self.model.pack_weights()

    def step(self, prompts: list[Prompt]) -> dict[str, float]:
        cfg, model, G = self.cfg, self.model, self.cfg.num_generations
        started = time.perf_counter()
        rollouts = generate(self.engine, [p.ids for p in prompts], G, cfg.max_tokens, cfg.temperature,
                            seed=self.seed + self.steps * len(prompts) * G)
        rollout_s = time.perf_counter() - started
        device = next(model.parameters()).device
        rewards = torch.tensor(score_rollouts(self.reward, prompts, rollouts))
        advantages = group_advantages(rewards, G, cfg.scale_rewards).to(device)
        batch = TokenBatch.of(rollouts, device)
        train_started = time.perf_counter()
        with torch.no_grad():
            old_logp = completion_logprobs(model, batch)
            ref_logp = self.reference_logprobs(batch)
        gap = (old_logp - batch.sampling_logprobs).abs() * batch.mask
        gap_mean = float(gap.sum() / batch.mask.sum().clamp(min=1))
        if gap_mean > cfg.max_logprob_diff:
            raise UserError(f"the engine's log-probabilities differ from the trainer's by {gap_mean:.3g} on average "
                            f"(rlhf.max_logprob_diff={cfg.max_logprob_diff}): the rollouts did not come from the "
                            f"policy being trained")
        for _ in range(cfg.updates_per_batch):
            loss, stats = self.trainer(batch.input_ids, batch.completion_start, batch.mask, old_logp,
                                       advantages, ref_logp, batch.sampling_logprobs)
            self.trainer.backward(loss)
            self.trainer.step()
        train_s = time.perf_counter() - train_started
        sync_started = time.perf_counter()
        self.refresh_derived_copies()
        self.engine.blocks.reset_prefix_cache()  # its K/V came from the policy before this update
        sync_s = time.perf_counter() - sync_started
        self.steps += 1
        lengths = batch.mask.sum(dim=1)
        tokens = float(lengths.sum())
        surprisal = -masked_mean(old_logp, batch.mask)  # estimates the entropy from the sampled tokens (T = 1)
        return {"reward": float(rewards.mean()), "reward_std": float(rewards.std()), "loss": float(loss.detach()),
                "kl": stats.kl, "clip_ratio": stats.clip_ratio, "entropy": float(surprisal),
                "completions/mean_length": float(lengths.mean()),
                "completions/clipped_ratio": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
                "sampling/sampling_logp_difference/mean": gap_mean,
                "sampling/sampling_logp_difference/max": float(gap.max()),
                "sampling/importance_sampling_ratio/mean": stats.importance_ratio,
                "timing/rollout_s": rollout_s, "timing/train_s": train_s, "timing/sync_s": sync_s,
                "rollout_tok_s": tokens / rollout_s, "train_tok_s": tokens * cfg.updates_per_batch / train_s}
