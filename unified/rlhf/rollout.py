"""Rollouts from the inference engine, and the trainer's log-probabilities of the same tokens.

Colocated, the engine runs the very modules the trainer updates (LoRA adapters included, as hooks on the
same linears), so a rollout samples the current policy with no copy. Each prompt is one engine request of
`num_generations` sequences; the engine returns the raw log-probability of every sampled token (the
model's own distribution, before temperature or filtering), which is what the trainer's forward must
reproduce: their difference is the train/inference consistency gate.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from unified import kernels
from unified.engine.sampling_params import SamplingParams
from unified.model.attention import SegmentAttention
from unified.model.forward_context import forward_context


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
    """Rollouts laid out for the trainer's forward. Each row holds a prompt once, then as many of its
    completions as fit in `pack_tokens` tokens (at least one), each attending to the prompt and to itself
    (unified.model.attention.SegmentAttention): the prompt's tokens are computed once per row instead of
    once per completion. Per-completion tensors [B, T] follow the rollouts' order; T is the longest
    completion, and `mask` is 1 on completion tokens."""
    input_ids: torch.Tensor  # [R, L] packed rows, right-padded with 0
    positions: torch.Tensor  # [R, L] each completion's positions continue from its prompt's
    segments: torch.Tensor  # [R, L] 0 on the prompt, k on the row's k-th completion, -1 on padding
    row: torch.Tensor  # [B] the row that holds each completion
    predictors: torch.Tensor  # [B, T] the column whose hidden state predicts each completion token
    targets: torch.Tensor  # [B, T] the completion tokens (0 on padding)
    mask: torch.Tensor  # [B, T]
    sampling_logprobs: torch.Tensor  # [B, T] the engine's log-probabilities of the same tokens

    @classmethod
    def of(cls, rollouts: list[Rollout], device: torch.device | str = "cpu", pack_tokens: int = 0) -> "TokenBatch":
        """`pack_tokens` 0: one completion per row."""
        rows: list[list[int]] = []  # the rollouts of each row; consecutive rollouts of one prompt share rows
        for b, r in enumerate(rollouts):
            if rows:
                first = rollouts[rows[-1][0]]
                used = len(first.prompt_ids) + sum(len(rollouts[i].completion_ids) for i in rows[-1])
                if r.prompt_ids == first.prompt_ids and used + len(r.completion_ids) <= pack_tokens:
                    rows[-1].append(b)
                    continue
            rows.append([b])
        width = max(len(rollouts[members[0]].prompt_ids) + sum(len(rollouts[i].completion_ids) for i in members)
                    for members in rows)
        longest = max(1, max(len(r.completion_ids) for r in rollouts))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        segments = torch.full((len(rows), width), -1, dtype=torch.long)
        row_of = torch.zeros(len(rollouts), dtype=torch.long)
        predictors = torch.zeros(len(rollouts), longest, dtype=torch.long)
        targets = torch.zeros(len(rollouts), longest, dtype=torch.long)
        mask = torch.zeros(len(rollouts), longest)
        sampled = torch.zeros(len(rollouts), longest)
        for index, members in enumerate(rows):
            prompt = rollouts[members[0]].prompt_ids
            ids[index, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            positions[index, :len(prompt)] = torch.arange(len(prompt))
            segments[index, :len(prompt)] = 0
            column = len(prompt)
            for segment, b in enumerate(members, start=1):
                completion, n = rollouts[b].completion_ids, len(rollouts[b].completion_ids)
                ids[index, column:column + n] = torch.tensor(completion, dtype=torch.long)
                positions[index, column:column + n] = torch.arange(len(prompt), len(prompt) + n)
                segments[index, column:column + n] = segment
                row_of[b] = index
                # the prompt's last state predicts the first token; each token's own state the next one
                predictors[b] = len(prompt) - 1
                predictors[b, 1:n] = torch.arange(column, column + n - 1)
                targets[b, :n] = torch.tensor(completion, dtype=torch.long)
                mask[b, :n] = 1
                sampled[b, :n] = torch.tensor(rollouts[b].sampling_logprobs)
                column += n
        return cls(ids, positions, segments, row_of, predictors, targets, mask, sampled).to(device)

    @property
    def size(self) -> int:
        """How many completions."""
        return self.row.shape[0]

    def first(self, count: int) -> "TokenBatch":
        """The first rows, as many as hold the first `count` completions (and the rest of those rows')."""
        rows = int(self.row[min(count, self.size) - 1]) + 1
        kept = int((self.row < rows).sum())
        return TokenBatch(self.input_ids[:rows], self.positions[:rows], self.segments[:rows], self.row[:kept],
                          self.predictors[:kept], self.targets[:kept], self.mask[:kept],
                          self.sampling_logprobs[:kept])

    def to(self, device: torch.device | str) -> "TokenBatch":
        return TokenBatch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


@dataclass
class CompletionForward:
    logp: torch.Tensor  # [B, T] log-probability of each completion token (0 on padding)
    entropy: torch.Tensor | None  # [B, T] entropy of the whole next-token distribution, when asked for
    values: torch.Tensor | None  # [B, T] the value head's estimate before each token, when there is one


def completion_forward(model, batch: TokenBatch, value_head: nn.Module | None = None,
                       entropy: bool = False) -> CompletionForward:
    """The trainer's view of the completions from one forward of the packed rows on the training path
    (with autograd or not, the same arithmetic): the hidden state before each completion token gives its
    log-probability, the distribution's entropy and, with a value head, the state's value."""
    with kernels.training_path(), forward_context(SegmentAttention(batch.segments, batch.positions)):
        states = model(batch.input_ids, batch.positions)[batch.row[:, None], batch.predictors]  # [B, T, H]
        logits = model.logits(states).float()  # [B, T, V]
    log_probs = logits.log_softmax(-1)
    logp = log_probs.gather(-1, batch.targets[..., None]).squeeze(-1) * batch.mask
    token_entropy = None
    if entropy:  # reported, never trained on
        detached = log_probs.detach()
        token_entropy = -(detached.exp() * detached).sum(-1) * batch.mask
    values = value_head(states).squeeze(-1).float() * batch.mask if value_head is not None else None
    return CompletionForward(logp, token_entropy, values)


def completion_logprobs(model, batch: TokenBatch) -> torch.Tensor:
    """The trainer's log-probability of each completion token [B, T] (0 on padding)."""
    return completion_forward(model, batch).logp
