"""Turns each sequence's last logits into its next token, with per-request options and seeds.

Penalties: `repetition_penalty` as in HF (divide positive logits, multiply negative ones, over prompt
and output tokens); `presence_penalty` / `frequency_penalty` as in OpenAI (subtracted, over output
tokens). Then temperature, top-k, top-p and min-p; temperature 0 is greedy. Each sequence draws from
its own generator, so a seeded request gives the same output whatever else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from unified.engine.sequence import Sequence


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely tokens and their logprobs, best first


def _penalize(logits: torch.Tensor, seq: Sequence) -> None:
    p = seq.params
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        picked = logits[ids]
        logits[ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_counts:
        ids = torch.tensor(list(seq.output_counts), dtype=torch.long)
        counts = torch.tensor(list(seq.output_counts.values()), dtype=logits.dtype)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts


def _filter(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def _logprob_entry(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    top = logprobs.topk(k) if k else None
    return TokenLogprob(token, logprobs[token].item(),
                        list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [S, V] float32, one row per sequence -> (next token ids, logprob entries)."""
    raw = logits.log_softmax(-1) if any(s.params.logprobs is not None and s.params.logprobs_mode == "raw"
                                        for s in seqs) else None
    tokens, entries = [], []
    plain_greedy = all(s.params.greedy and s.params.repetition_penalty == 1.0 and not s.params.presence_penalty
                       and not s.params.frequency_penalty for s in seqs)
    greedy_ids = logits.max(-1).indices.tolist() if plain_greedy else None  # max: 2.5x faster than argmax on CPU
    for i, seq in enumerate(seqs):
        p = seq.params
        if greedy_ids is not None:
            token, processed = greedy_ids[i], logits[i]
        else:
            processed = logits[i].clone()
            _penalize(processed, seq)
            if p.greedy:
                token = int(processed.argmax())
            else:
                processed = _filter(processed, seq)
                token = int(torch.multinomial(processed.softmax(-1), 1, generator=seq.generator))
        if p.logprobs is None:
            entries.append(None)
        else:
            source = raw[i] if p.logprobs_mode == "raw" else processed.log_softmax(-1)
            entries.append(_logprob_entry(source, token, p.logprobs))
        tokens.append(token)
    return tokens, entries
