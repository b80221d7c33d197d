"""One GRPO or PPO step, colocated: rollouts from the engine on the policy's own modules, rewards,
advantages, the consistency gate, then `updates_per_batch` optimizer updates through DeepSpeed.

The old log-probabilities are the trainer's forward before the first update (the policy that sampled,
as the trainer computes it): for GRPO the first update's own forward, detached, so no pass is spent on
them; PPO needs its values before the advantages, so it runs a forward first. The gate compares them
with what the engine reported for the same tokens and stops the run past `rlhf.max_logprob_diff`, before
the first optimizer step. At `kl_coef` 0 the KL is only reported, from the reference on a share of the
completions (`rlhf.kl_report_fraction`). Under LoRA the reference is the base model with the
adapters switched off, so no second copy of the weights exists; when all weights train it is a second,
frozen instance of the starting weights. During the updates the engine's KV cache is released (training
takes the memory); after them the engine's derived weight copies (packed CPU weights) are refreshed and
its prefix cache starts empty (its K/V came from the old policy).

GRPO scores each completion against its group (the prompt's other completions). PPO learns a value head
(a scalar linear on the policy's last hidden state, trained with it) and estimates token advantages with
GAE; as in TRL and OpenRLHF, its KL penalty is part of the per-token reward rather than of the loss.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from unified.checkpoint.lora import adapters_disabled, has_adapters
from unified.errors import UserError
from unified.rlhf.advantages import gae, group_advantages, last_token_rewards
from unified.rlhf.losses import (KL_ESTIMATORS, LOSS_LEVELS, PolicyLossStats, kl_estimate, masked_mean, policy_loss,
                                 value_loss)
from unified.rlhf.rewards import RewardFn, score
from unified.rlhf.rollout import CompletionForward, Rollout, TokenBatch, completion_forward, completion_logprobs
from unified.train.engine import backward_and_step, grad_norm

ALGORITHMS = ("grpo", "ppo")


def check_rlhf_config(cfg) -> None:
    """Every option a user can get wrong, before anything is loaded or generated."""
    if cfg.algorithm not in ALGORITHMS:
        raise UserError(f"rlhf.algorithm={cfg.algorithm!r} is unknown; choose {' or '.join(ALGORITHMS)}")
    if cfg.algorithm == "grpo" and cfg.num_generations < 2:
        raise UserError(f"rlhf.num_generations={cfg.num_generations}: GRPO compares completions within a group, "
                        f"so it needs at least 2")
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise UserError(f"rlhf.kl_estimator={cfg.kl_estimator!r} is unknown; choose {' or '.join(KL_ESTIMATORS)}")
    if cfg.loss_level not in LOSS_LEVELS:
        raise UserError(f"rlhf.loss_level={cfg.loss_level!r} is unknown; choose {' or '.join(LOSS_LEVELS)}")
    for name in ("num_generations", "prompts_per_step", "max_tokens", "updates_per_batch"):
        if getattr(cfg, name) < 1:
            raise UserError(f"rlhf.{name}={getattr(cfg, name)} must be at least 1")
    if cfg.pack_tokens < 0:
        raise UserError(f"rlhf.pack_tokens={cfg.pack_tokens} must be 0 (no packing) or a number of tokens")
    if cfg.tis_cap is not None and cfg.tis_cap <= 0:
        raise UserError(f"rlhf.tis_cap={cfg.tis_cap} must be positive (or null: off)")
    for name in ("gamma", "lam", "kl_report_fraction"):
        if not 0 <= getattr(cfg, name) <= 1:
            raise UserError(f"rlhf.{name}={getattr(cfg, name)} must be within [0, 1]")


def _frozen(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def value_head(model: nn.Module) -> nn.Linear:
    """PPO's critic on the shared model: a scalar linear on the last hidden state, starting at 0."""
    weight = next(model.parameters())
    head = nn.Linear(model.config.hidden_size, 1, device=weight.device, dtype=weight.dtype)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class PolicyObjective(nn.Module):
    """The loss inside one module forward, so that DeepSpeed (ZeRO-3 included) sees what it reads: the
    clipped policy loss, with PPO's value loss when the objective holds a value head."""

    def __init__(self, model: nn.Module, cfg, value_head: nn.Linear | None = None):
        super().__init__()
        self.model, self.cfg, self.value_head = model, cfg, value_head

    def forward(self, batch: TokenBatch, old_logp=None, advantages=None, ref_logp=None, old_values=None, returns=None,
                weights: tuple[float, float] | None = None, *, score_only: bool = False,
                entropy: bool = False) -> tuple[torch.Tensor, PolicyLossStats, CompletionForward] | CompletionForward:
        """`old_logp` None: this forward is the policy that sampled (a batch's first update), so its own
        log-probabilities, detached, are the old ones. `weights` scale the policy and value losses (a
        data-parallel trainer rank's share of the batch, see `share_weights`). Returns the loss, its
        statistics, and this forward's log-probabilities and entropies (detached).

        `score_only`: the completions' log-probabilities (entropies if asked, values with a value head) and
        no loss; the learner's no-grad forwards come this way too, so that under ZeRO-3 DeepSpeed gathers
        what they read (the tied head's embedding included) as it does for the training forward."""
        if score_only:
            return completion_forward(self.model, batch, self.value_head, entropy=entropy)
        cfg, mask = self.cfg, batch.mask
        out = completion_forward(self.model, batch, self.value_head, entropy=old_logp is None)
        if old_logp is None:
            old_logp = out.logp.detach()
        kl_in_loss = cfg.kl_coef if self.value_head is None else 0.0  # PPO puts it in the reward
        loss, stats = policy_loss(out.logp, old_logp, advantages, mask, clip_low=cfg.clip_low,
                                  clip_high=cfg.clip_high, ref_logp=ref_logp, kl_coef=kl_in_loss,
                                  kl_estimator=cfg.kl_estimator, level=cfg.loss_level, sampling_logp=batch.sampling_logprobs,
                                  tis_cap=cfg.tis_cap)
        if weights is not None:
            loss = loss * weights[0]
        if self.value_head is not None:
            critic = value_loss(out.values, old_values, returns, mask, cfg.value_clip)
            stats.value_loss = float(critic.detach())
            loss = loss + cfg.vf_coef * (critic if weights is None else critic * weights[1])
        return loss, stats, CompletionForward(out.logp.detach(), out.entropy, None)


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


def share_weights(share, mine: list[Rollout], everyone: list[Rollout], level: str) -> tuple[float, float] | None:
    """What one of `share.count` data-parallel trainer ranks scales its policy and value losses by, so that
    its losses (means over its own completions `mine`) average over the ranks to the losses of the whole
    batch `everyone`: the ranks' averaged gradients are then the whole batch's. None with one trainer."""
    if share.count == 1:
        return None
    tokens = sum(len(r.completion_ids) for r in mine) / max(1, sum(len(r.completion_ids) for r in everyone))
    policy = tokens if level == "token" else len(mine) / len(everyone)
    return share.count * policy, share.count * tokens


def rollout_seed(seed: int, step: int, prompts: int, num_generations: int) -> int:
    """The first sampling seed of a step's rollouts (prompt i's group starts at this + i x num_generations)."""
    return seed + step * prompts * num_generations


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B] per completion or [B, T] per token
    returns: torch.Tensor | None = None  # PPO: the value head's targets [B, T]


class GRPO:
    name = "grpo"

    def __init__(self, rollouts, trainer, reward: RewardFn, cfg, reference: nn.Module | None = None, seed: int = 0,
                 max_grad_norm: float = 0.0):
        """`rollouts`: where completions come from (unified.rlhf.placement: Colocated or Separate);
        `trainer`: the DeepSpeed engine around a PolicyObjective of the policy. Under LoRA the reference is
        the base model (adapters off); when every weight trains, `reference` must be the model as it starts
        (loaded a second time: it is frozen here)."""
        self.rollouts, self.trainer, self.reward, self.cfg = rollouts, trainer, reward, cfg
        self.model = trainer.module.model
        self.value_head = trainer.module.value_head
        self.lora = has_adapters(self.model)
        if not self.lora and reference is None:
            raise ValueError("training every weight needs a reference model: the policy as it starts")
        self.reference = None if self.lora else _frozen(reference)
        self.seed, self.max_grad_norm = seed, max_grad_norm  # train.max_grad_norm, as fine-tuning clips
        self.steps = 0
        self.share = rollouts.share  # which completions this trainer rank trains on

    def reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        if self.reference is not None:
            device = next(self.reference.parameters()).device  # the host, with rlhf.reference_on_host
            return completion_logprobs(self.reference, batch.to(device)).to(batch.mask.device)
        with adapters_disabled(self.model):
            return self.trainer(batch, score_only=True).logp

    def advantages(self, rewards: torch.Tensor, batch: TokenBatch, old, ref_logp: torch.Tensor) -> Advantages:
        return Advantages(group_advantages(rewards, self.cfg.num_generations, self.cfg.scale_rewards))

    def _gate(self, trainer_logp: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
        """|trainer - engine| log-probability of each sampled token; stops the run past rlhf.max_logprob_diff
        (on every trainer rank alike: the largest of their means decides)."""
        gap = (trainer_logp - batch.sampling_logprobs).abs() * batch.mask
        gap_mean, = self.share.pooled([float(gap.sum() / batch.mask.sum().clamp(min=1))], "max")
        if gap_mean > self.cfg.max_logprob_diff:
            raise UserError(f"the engine's log-probabilities differ from the trainer's by {gap_mean:.3g} on average "
                            f"(rlhf.max_logprob_diff={self.cfg.max_logprob_diff}): the rollouts did not come from "
                            f"the policy being trained")
        return gap

    def step(self, prompts: list[Prompt]) -> dict[str, float]:
        cfg, model, G = self.cfg, self.model, self.cfg.num_generations
        device = next(model.parameters()).device
        started = time.perf_counter()
        rollouts = self.rollouts.generate([p.ids for p in prompts], G, cfg.max_tokens, cfg.temperature,
                                          rollout_seed(self.seed, self.steps, len(prompts), G))
        released = self.rollouts.release()
        rollout_s = time.perf_counter() - started
        all_rewards = torch.tensor(score_rollouts(self.reward, prompts, rollouts), device=device)
        everyone, rollouts = rollouts, [r for r in rollouts if self.share.holds(r.group)]  # whole groups
        rewards = all_rewards[[i for i, r in enumerate(everyone) if self.share.holds(r.group)]]
        weights = share_weights(self.share, rollouts, everyone, cfg.loss_level)
        batch = TokenBatch.of(rollouts, device, cfg.pack_tokens)
        train_started = time.perf_counter()
        kl_trains = cfg.kl_coef > 0  # else the reference only serves the reported KL: a share of the rows will do
        kl_rows = len(rollouts) if kl_trains else max(1, round(len(rollouts) * cfg.kl_report_fraction))
        with torch.no_grad():
            # GRPO's advantages need no forward: the first update's own forward is the policy that sampled
            old = self.trainer(batch, score_only=True, entropy=True) if self.value_head is not None else None
            ref_logp = self.reference_logprobs(batch.first(kl_rows)) if kl_trains or cfg.kl_report_fraction > 0 else None
        estimate = self.advantages(rewards, batch, old, ref_logp)
        old_logp = None if old is None else old.logp
        for update in range(cfg.updates_per_batch):
            loss, stats, now = self.trainer(batch, old_logp, estimate.advantages, ref_logp if kl_trains else None,
                                            None if old is None else old.values, estimate.returns, weights)
            if update == 0:
                old_logp, entropy = (now.logp, now.entropy) if old is None else (old.logp, old.entropy)
                gap = self._gate(old_logp, batch)  # before the first optimizer step
            backward_and_step(self.trainer, loss, self.max_grad_norm)
        if ref_logp is not None and not kl_trains:
            kl_rows = ref_logp.shape[0]
            stats.kl = float(masked_mean(kl_estimate(old_logp[:kl_rows], ref_logp, cfg.kl_estimator),
                                         batch.mask[:kl_rows]))
        train_s = time.perf_counter() - train_started
        sync_started = time.perf_counter()
        synced = self.rollouts.weights_changed()
        sync_s = time.perf_counter() - sync_started
        self.steps += 1
        lengths = torch.tensor([float(len(r.completion_ids)) for r in everyone])
        tokens = float(lengths.sum())
        # what each trainer rank measured on its own share, averaged over them (the largest gap: the largest)
        own = {"loss": float(loss.detach()), "kl": stats.kl, "clip_ratio": stats.clip_ratio,
               "entropy": float(masked_mean(entropy, batch.mask)),
               "sampling/sampling_logp_difference/mean": float(gap.sum() / batch.mask.sum().clamp(min=1)),
               "sampling/importance_sampling_ratio/mean": stats.importance_ratio}
        if stats.value_loss is not None:
            own.update({"value_loss": stats.value_loss, "values/mean": float(masked_mean(old.values, batch.mask))})
        own = dict(zip(own, self.share.pooled(list(own.values()))))
        gap_max, = self.share.pooled([float(gap.max())], "max")
        metrics = {"reward": float(all_rewards.mean()),
                   "reward_std": float(all_rewards.std()) if len(all_rewards) > 1 else 0.0, **own,
                   "completions/mean_length": float(lengths.mean()),
                   "completions/clipped_ratio": sum(r.finish_reason == "length" for r in everyone) / len(everyone),
                   "sampling/sampling_logp_difference/max": gap_max,
                   "timing/rollout_s": rollout_s, "timing/train_s": train_s, "timing/sync_s": sync_s,
                   "rollout_tok_s": tokens / rollout_s, "train_tok_s": tokens * cfg.updates_per_batch / train_s,
                   "memory/kv_cache_released_bytes": released}
        norm = grad_norm(self.trainer)
        if norm is not None:
            metrics["grad_norm"] = norm  # of the last update, before clipping
        metrics.update(synced)
        return metrics


class PPO(GRPO):
    name = "ppo"

    def advantages(self, rewards: torch.Tensor, batch: TokenBatch, old, ref_logp: torch.Tensor) -> Advantages:
        """GAE over token rewards: the score on each completion's last token, minus kl_coef x the KL
        estimate on every token; advantages whitened over the batch's tokens."""
        cfg, mask = self.cfg, batch.mask
        token_rewards = last_token_rewards(rewards, mask)
        if cfg.kl_coef:
            token_rewards = token_rewards - cfg.kl_coef * kl_estimate(old.logp, ref_logp, cfg.kl_estimator) * mask
        advantages, returns = gae(token_rewards, old.values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:  # over the tokens of the whole batch, every trainer rank's share
            count, total, squares = self.share.pooled([float(mask.sum()), float((advantages * mask).sum()),
                                                       float((advantages ** 2 * mask).sum())])
            mean = total / max(count, 1.0)
            std = max(squares / max(count, 1.0) - mean ** 2, 0.0) ** 0.5
            advantages = (advantages - mean) / (std + 1e-8) * mask
        return Advantages(advantages, returns)


def algorithm(name: str) -> type[GRPO]:
    return {"grpo": GRPO, "ppo": PPO}[name]
