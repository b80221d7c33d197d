"""Rollouts from the inference engine, and the trainer's log-probabilities of the same tokens.

Colocated, the engine runs the very modules the trainer updates (LoRA adapters included, as hooks on the
same linears), so a rollout samples the current policy with no copy. Each prompt is one engine request of
`num_generations` sequences; the engine returns the raw log-probability of every sampled token (the
model's own distribution, before temperature or filtering), which is what the trainer's forward must
reproduce: their difference is the train/inference consistency gate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from unified import kernels
from unified.engine.sampling_params import SamplingParams


@dataclass
class Rollout:
    group: int  # which prompt of the batch
    prompt_ids: list[int]
    completion_ids: list[int]
    sampling_logprobs: list[float]  # the engine's raw log-probability of each completion token
    text: str
    finish_reason: str


def generate(engine, prompts: list[list[int]], num_generations: int, max_tokens: int, temperature: float = 1.0,
             seed: int | None = None, seeds: list[int] | None = None) -> list[Rollout]:
    """`num_generations` completions of each prompt, grouped by prompt in prompt order (the engine's KV
    cache is taken back first if training released it). Prompt i samples with seed `seed + i x
    num_generations`, or with `seeds[i]`."""
    engine.restore_kv_cache()
    if seeds is None and seed is not None:
        seeds = [seed + i * num_generations for i in range(len(prompts))]
    request_ids = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(n=num_generations, temperature=temperature, max_tokens=max_tokens, logprobs=0,
                                seed=None if seeds is None else seeds[i])
        request_ids.append(engine.add_request(prompt, params))
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            finished[output.request_id] = output
    rollouts = []
    for group, (request_id, prompt) in enumerate(zip(request_ids, prompts)):
        output = finished[request_id]
        if output.error is not None:
            raise RuntimeError(f"a rollout failed in the engine: {output.error}")
        for completion in output.outputs:
            rollouts.append(Rollout(group, list(prompt), list(completion.token_ids),
                                    [entry.logprob for entry in completion.logprobs], completion.text,
                                    completion.finish_reason))
    return rollouts


@dataclass
class TokenBatch:
    """Rollouts as padded rows: prompt then completion, right-padded with 0."""
    input_ids: torch.Tensor  # [B, L]
    completion_start: torch.Tensor  # [B] index of each row's first completion token
    mask: torch.Tensor  # [B, T] 1 on completion tokens, T the longest completion
    sampling_logprobs: torch.Tensor  # [B, T]

    @classmethod
    def of(cls, rollouts: list[Rollout], device: torch.device | str = "cpu") -> "TokenBatch":
        width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
        longest = max(len(r.completion_ids) for r in rollouts)
        ids = torch.zeros(len(rollouts), width, dtype=torch.long)
        mask = torch.zeros(len(rollouts), longest)
        sampled = torch.zeros(len(rollouts), longest)
        for row, r in enumerate(rollouts):
            tokens = r.prompt_ids + r.completion_ids
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(r.completion_ids)] = 1
            sampled[row, :len(r.completion_ids)] = torch.tensor(r.sampling_logprobs)
        starts = torch.tensor([len(r.prompt_ids) for r in rollouts])
        return cls(ids.to(device), starts.to(device), mask.to(device), sampled.to(device))

    def rows(self, count: int) -> "TokenBatch":
        """The first `count` rows."""
        return TokenBatch(self.input_ids[:count], self.completion_start[:count], self.mask[:count],
                          self.sampling_logprobs[:count])

    def to(self, device: torch.device | str) -> "TokenBatch":
        return TokenBatch(self.input_ids.to(device), self.completion_start.to(device), self.mask.to(device),
                          self.sampling_logprobs.to(device))

    def completion_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, column) indexes [B, T] of the hidden states that predict each completion token (clamped
        inside the row for padding, which the mask drops)."""
        rows, longest = self.mask.shape
        offsets = torch.arange(longest, device=self.mask.device)
        columns = (self.completion_start[:, None] - 1 + offsets).clamp(max=self.input_ids.shape[1] - 2)
        return torch.arange(rows, device=self.mask.device)[:, None].expand(-1, longest), columns


@dataclass
class CompletionForward:
    logp: torch.Tensor  # [B, T] log-probability of each completion token (0 on padding)
    entropy: torch.Tensor | None  # [B, T] entropy of the whole next-token distribution, when asked for
    values: torch.Tensor | None  # [B, T] the value head's estimate before each token, when there is one


def completion_forward(model, batch: TokenBatch, value_head: nn.Module | None = None,
                       entropy: bool = False) -> CompletionForward:
    """The trainer's view of the completions from one causal forward of the padded rows on the training
    path (with autograd or not, the same arithmetic): the hidden state before each completion token gives
    its log-probability, the distribution's entropy and, with a value head, the state's value."""
    positions = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
    rows, columns = batch.completion_positions()
    with kernels.training_path():
        states = model(batch.input_ids, positions)[rows, columns]  # [B, T, H]
        logits = model.logits(states).float()  # [B, T, V]
    log_probs = logits.log_softmax(-1)
    targets = batch.input_ids[rows, columns + 1]  # [B, T]
    logp = log_probs.gather(-1, targets[..., None]).squeeze(-1) * batch.mask
    token_entropy = None
    if entropy:  # reported, never trained on
        detached = log_probs.detach()
        token_entropy = -(detached.exp() * detached).sum(-1) * batch.mask
    values = value_head(states).squeeze(-1).float() * batch.mask if value_head is not None else None
    return CompletionForward(logp, token_entropy, values)


def completion_logprobs(model, batch: TokenBatch) -> torch.Tensor:
    """The trainer's log-probability of each completion token [B, T] (0 on padding)."""
    return completion_forward(model, batch).logp
