"""The policy and value objectives of GRPO and PPO, over per-token log-probabilities.

Shapes: [B, T] for B completions padded to T tokens, `mask` 1 on completion tokens. `logp` comes from the
trainer's forward (with gradients), `old_logp` from the same policy before this batch's first update
(kept across `updates_per_batch` updates), `ref_logp` from the reference model, `sampling_logp` from the
engine that sampled the tokens. Token-level averaging weighs every token of the batch alike (DAPO, Dr.
GRPO); sequence-level averages each completion's tokens first (the original GRPO), so long completions
weigh as much as short ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KL_ESTIMATORS = ("k1", "k3")
LOSS_LEVELS = ("token", "sequence")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens: k1 = log(p / p_ref), unbiased but
    noisy and possibly negative; k3 = p_ref/p - log(p_ref/p) - 1, unbiased and never negative (Schulman)."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        log_ratio = ref_logp - logp
        return log_ratio.exp() - log_ratio - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; choose {' or '.join(KL_ESTIMATORS)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """Mean over masked tokens: of all of them at once ("token"), or of each row's mean ("sequence")."""
    mask = mask.to(values.dtype)
    if level == "token":
        return (values * mask).sum() / mask.sum().clamp(min=1)
    if level == "sequence":
        per_row = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_row.mean()
    raise ValueError(f"unknown loss level {level!r}; choose {' or '.join(LOSS_LEVELS)}")


@dataclass
class PolicyLossStats:
    clip_ratio: float  # share of tokens whose ratio the clip held back
    kl: float  # mean KL estimate to the reference (reported at coefficient 0 too)
    importance_ratio: float  # mean exp(old_logp - sampling_logp): the trainer's over the sampler's probability
    value_loss: float | None = None  # PPO's critic loss, added by the objective that has a value head


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, ref_logp: torch.Tensor | None = None,
                kl_coef: float = 0.0, kl_estimator: str = "k3", level: str = "token",
                sampling_logp: torch.Tensor | None = None,
                tis_cap: float | None = None) -> tuple[torch.Tensor, PolicyLossStats]:
    """The clipped surrogate -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) with r = exp(logp - old_logp),
    plus `kl_coef` x the KL estimate to the reference. `advantages` are [B] (one per completion) or [B, T].
    With `tis_cap`, each token's term is weighted by min(exp(old_logp - sampling_logp), tis_cap):
    truncated importance sampling, for an engine that samples from a slightly different distribution
    (lower precision) than the trainer's."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    ratio = (logp - old_logp).exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    importance = None
    if sampling_logp is not None:
        importance = (old_logp - sampling_logp).exp().detach()
        if tis_cap is not None:
            per_token = per_token * importance.clamp(max=tis_cap)
    kl = kl_estimate(logp, ref_logp, kl_estimator) if ref_logp is not None else torch.zeros_like(logp)
    if kl_coef:
        per_token = per_token + kl_coef * kl
    loss = masked_mean(per_token, mask, level)
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_ratio=float(masked_mean((clipped < unclipped).to(logp.dtype), mask)),
            kl=float(masked_mean(kl, mask)),
            importance_ratio=float(masked_mean(importance, mask)) if importance is not None else 1.0)
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = 0.2) -> torch.Tensor:
    """PPO's value loss, 0.5 x max((V - R)^2, (V_clipped - R)^2) with V_clipped kept within `clip` of the
    values at rollout time (None: unclipped), averaged over tokens."""
    loss = (values - returns) ** 2
    if clip is not None:
        kept = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (kept - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)
