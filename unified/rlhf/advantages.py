"""Advantages: GRPO's group-normalised rewards and PPO's generalised advantage estimation (GAE).

Shapes: a rollout batch is B completions padded to T tokens; `mask` [B, T] is 1 on completion tokens.
GRPO scores whole completions ([B] rewards, B = prompts x num_generations, each prompt's group
contiguous) and gives every token of a completion its group-relative advantage. PPO spreads a sequence
reward over tokens (the reward on the last token, as TRL and OpenRLHF do) and learns values per token.
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_by_std: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """rewards [B] with B = prompts x num_generations -> advantages [B]: each reward minus its group's
    mean, divided by the group's (unbiased) standard deviation plus `eps` unless `scale_by_std` is off
    (Dr. GRPO: the division favours groups of near-equal rewards, which carry little signal)."""
    assert rewards.dim() == 1 and rewards.numel() % num_generations == 0, (rewards.shape, num_generations)
    groups = rewards.view(-1, num_generations)  # [P, G]
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] sequence rewards -> [B, T] token rewards, each on its completion's last token."""
    token_rewards = torch.zeros_like(mask, dtype=rewards.dtype)
    last = mask.long().cumsum(dim=1).argmax(dim=1)  # the first index where the count of tokens peaks
    token_rewards[torch.arange(mask.shape[0]), last] = rewards
    return token_rewards * mask


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over [B, T] completions (values past the last token count 0):
    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V.
    Both are 0 outside `mask`."""
    mask = mask.to(values.dtype)
    values = values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        following = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = token_rewards[:, t] + gamma * following - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask
