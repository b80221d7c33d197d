"""GRPO's and PPO's arithmetic against values computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from unified.rlhf.advantages import gae, group_advantages, last_token_rewards
from unified.rlhf.losses import kl_estimate, masked_mean, policy_loss, value_loss


def test_group_advantages_centre_and_scale_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0])  # two prompts, four generations each
    advantages = group_advantages(rewards, 4)
    std = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]: mean 0.5, squared deviations 0.25 each
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0, 0, 0, 0]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)
    # Dr. GRPO: centred only.
    assert group_advantages(rewards, 4, scale_by_std=False).tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]


def test_gae_by_hand():
    # One completion of 3 tokens (then padding): reward 1 on its last token.
    mask = torch.tensor([[1, 1, 1, 0]])
    rewards = last_token_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 1.0, 0.0]]
    values = torch.tensor([[0.5, 0.25, 0.75, 9.0]])  # the padding's value must not leak in
    gamma, lam = 0.9, 0.8
    d2 = 1.0 + 0 - 0.75
    d1 = 0.0 + gamma * 0.75 - 0.25
    d0 = 0.0 + gamma * 0.25 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    assert advantages.tolist()[0] == pytest.approx([a0, a1, a2, 0.0])
    assert returns.tolist()[0] == pytest.approx([a0 + 0.5, a1 + 0.25, a2 + 0.75, 0.0])


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx(k3)
    with pytest.raises(ValueError, match="k1 or k3"):
        kl_estimate(logp, ref, "k2")


def test_token_and_sequence_averaging():
    values = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert masked_mean(values, mask, "token").item() == pytest.approx(7 / 4)
    assert masked_mean(values, mask, "sequence").item() == pytest.approx((1 + 4) / 2)


def test_clipped_policy_loss_by_hand():
    old = torch.tensor([[-1.0, -1.0]])
    logp = torch.tensor([[-1.0 + math.log(1.5), -1.0 + math.log(0.5)]], requires_grad=True)  # ratios 1.5, 0.5
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(logp, old, torch.tensor([2.0]), mask, clip_low=0.2, clip_high=0.2)
    # A = 2 > 0: token 0 clipped to 1.2 (min(3.0, 2.4) = 2.4); token 1 keeps 0.5 (min(1.0, 1.6) = 1.0).
    assert loss.item() == pytest.approx(-(2.4 + 1.0) / 2)
    assert stats.clip_ratio == pytest.approx(0.5) and stats.kl == 0.0
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # a clipped token passes no gradient
    assert logp.grad[0, 1].item() == pytest.approx(-2.0 * 0.5 / 2)  # d(-r A / 2)/dlogp = -r A / 2

    negative, _ = policy_loss(logp.detach(), old, torch.tensor([-2.0]), mask)
    # A = -2: -min(-3.0, -2.4) = 3.0 for token 0; -min(-1.0, -1.6) = 1.6 for token 1.
    assert negative.item() == pytest.approx((3.0 + 1.6) / 2)


def test_kl_penalty_and_truncated_importance_sampling():
    logp = old = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    sampling = torch.tensor([[-1.0 - math.log(3.0), -2.0]])  # importance ratios 3 and 1
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask, ref_logp=ref, kl_coef=0.1, kl_estimator="k1",
                              sampling_logp=sampling, tis_cap=2.0)
    # ratio 1: surrogate -1 per token, weighted by min(3, 2) = 2 and 1; plus 0.1 x k1 (0.5, -1.0).
    assert loss.item() == pytest.approx(((-2.0 + 0.05) + (-1.0 - 0.1)) / 2)
    assert stats.kl == pytest.approx(-0.25) and stats.importance_ratio == pytest.approx(2.0)


def test_value_loss_clips_against_the_rollout_values():
    values, old, returns = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[0.0, 1.0]])
    mask = torch.ones(1, 2)
    # token 0: unclipped (1 - 0)^2 = 1, clipped V = 0.7: 0.49 -> max 1; token 1: (0 - 1)^2 = 1 both ways.
    assert value_loss(values, old, returns, mask, clip=0.2).item() == pytest.approx(0.5 * (1 + 1) / 2)
    assert value_loss(torch.tensor([[0.0, 0.0]]), old, returns, mask, clip=0.2).item() == pytest.approx(
        0.5 * (max(0.0, 0.3 ** 2) + 1) / 2)
