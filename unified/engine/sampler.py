"""Turns each sequence's last logits into its next token, with per-request options and seeds.

Penalties: `repetition_penalty` as in HF (divide positive logits, multiply negative ones, over prompt
and output tokens); `presence_penalty` / `frequency_penalty` as in OpenAI (subtracted, over output
tokens). Then temperature, top-k, top-p and min-p; a temperature below GREEDY_BELOW is greedy. Each
sequence draws from its own generator, so a seeded request gives the same output whatever else is in the batch.

Every option SamplingParams accepts is numerically safe: nan logits are never drawn, +inf ones share all
the mass, a row with nothing finite left takes the argmax of its raw logits, and the temperature divides
logits shifted to a maximum of 0, so no value overflows to +inf. A row that raises anyway gets the
exception in place of its token, and the engine fails that request alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from unified import kernels
from unified.engine.sequence import Sequence
from unified.kernels.staging import to_device

PENALTY_RANGE = (1e-4, 1e4)  # repetition penalties past these act alike, and keep float32 logits finite
MAX_TEMPERATURE = 1e30  # as uniform as any hotter one, which float32 could make inf (and -inf / inf is nan)
CHUNK = 1024  # vocabulary entries per chunk of the two-level draw (see _draw)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely tokens and their logprobs, best first
    rank: int | None = None  # 1 + how many tokens are likelier (prompt logprobs report it, as vLLM does)


def _sanitize(logits: torch.Tensor) -> torch.Tensor:
    """nan is never drawn; +inf entries (an overflow) share all the mass."""
    logits = logits.masked_fill(logits.isnan(), float("-inf"))
    top = logits == float("inf")
    return torch.where(top, 0.0, float("-inf")) if top.any() else logits


def _penalize(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        penalty = min(max(p.repetition_penalty, PENALTY_RANGE[0]), PENALTY_RANGE[1])
        ids = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        picked = logits[ids]
        logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_counts:
        ids = torch.tensor(list(seq.output_counts), dtype=torch.long)
        counts = torch.tensor(list(seq.output_counts.values()), dtype=logits.dtype)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
    return logits


def _filter(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """logits: [V] with at least one finite value -> logits at the temperature, the filtered-out at -inf."""
    p = seq.params
    logits = (logits - logits.max()) / min(p.temperature, MAX_TEMPERATURE)  # <= 0, the best 0: no overflow
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p  # keep the smallest set reaching top_p
        drop[0] = False  # and the best token, however small top_p (1e-300 is 0 in float32)
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def _choose(logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor]:
    """One row: its token and the logits it was chosen from (for processed logprobs)."""
    processed = _penalize(logits, seq)
    best = processed.max().item()  # nan if any is: one pass tells whether the row needs sanitizing
    if not math.isfinite(best):
        processed = _sanitize(processed)
        best = processed.max().item()
    if best == float("-inf"):  # nothing finite: the model's own preference is all there is
        return int(logits.argmax()), processed
    if seq.params.greedy:
        return int(processed.argmax()), processed
    processed = _filter(processed, seq)
    return int(_draw(processed.unsqueeze(0), [seq])[0]), processed


def _draw(scaled: torch.Tensor, seqs: list[Sequence], in_place: bool = False) -> torch.Tensor:
    """One token per row of `scaled` [R, V] (logits at their temperature, each row's maximum 0, filtered-out
    entries -inf), drawn by inverting the row's cumulative distribution at one uniform number from its
    sequence's generator: exact, and far cheaper on CPU than torch.multinomial's exponential draw over the
    whole vocabulary. The inversion has two levels, so no pass over the vocabulary is serial: the sums of
    chunks of CHUNK weights pick the chunk, then a cumulative sum within that chunk alone picks the token.
    `in_place`: `scaled` may be overwritten (no copy of a [R, V] tensor is made)."""
    rows, vocab = scaled.shape
    device = scaled.device
    weights = scaled.exp_() if in_place else scaled.exp()
    whole = vocab // CHUNK * CHUNK
    sums = weights[:, :whole].view(rows, -1, CHUNK).sum(-1)
    if whole < vocab:
        sums = torch.cat([sums, weights[:, whole:].sum(-1, keepdim=True)], 1)
    cumulative = sums.cumsum(-1, dtype=torch.float64)  # [R, chunks]
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=s.generator(device), device=device) for s in seqs])
    target = u * cumulative[:, -1]
    chunk = torch.searchsorted(cumulative, target.unsqueeze(1), right=True).squeeze(1)
    chunk = torch.minimum(chunk, _last_positive(sums))  # the target may round up to the total
    rest = target - torch.where(chunk > 0, cumulative.gather(1, (chunk - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0)
    columns = chunk.unsqueeze(1) * CHUNK + torch.arange(CHUNK, device=device)  # [R, CHUNK]
    inside = weights.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, 0)
    position = torch.searchsorted(inside.cumsum(-1, dtype=torch.float64), rest.unsqueeze(1), right=True).squeeze(1)
    return chunk * CHUNK + torch.minimum(position, _last_positive(inside))


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """Per row of x [R, N] >= 0, the index of its last positive entry."""
    return x.shape[1] - 1 - (x > 0).flip(1).int().argmax(1)


def _plain(p) -> bool:
    """Rows the batched path takes: no penalties, no top-k/top-p/min-p."""
    return (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty and not p.top_k
            and p.top_p == 1.0 and not p.min_p)


def _choose_plain(logits: torch.Tensor, seqs: list[Sequence],
                  one_copy: bool | None = None) -> tuple[list[int | None], list[torch.Tensor]]:
    """Rows with `_plain` params, all at once: greedy ones take the maximum, the others are drawn at their
    temperature. Returns their tokens (None for a row whose logits are not all finite, which `_choose` takes
    one by one) and the logits each row was chosen from (raw for greedy rows, at the temperature otherwise).
    On an accelerator all the host needs comes back in one copy (the step's one sync): rows that turn out not
    to be finite were drawn too (the draw never raises) and are discarded; on CPU they are left out first, so
    the rows may be scaled in place."""
    best = logits.amax(-1)  # values only: several times faster than max(-1)
    one_copy = logits.device.type != "cpu" if one_copy is None else one_copy
    finite = None if one_copy else torch.isfinite(best).tolist()
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy and (one_copy or finite[i])]
    processed = list(logits)
    to_host = [torch.isfinite(best)] if one_copy else []
    if len(sampled) < len(seqs):
        to_host.append(kernels.argmax_rows(logits))
    if sampled:
        # in place only where `logits` is sample()'s own and every row is known to be finite
        every = len(sampled) == len(seqs) and not one_copy
        rows = logits if len(sampled) == len(seqs) else logits[to_device(sampled, torch.int64, logits.device)]
        shift = best if len(sampled) == len(seqs) else best[to_device(sampled, torch.int64, logits.device)]
        temperature = to_device([[min(seqs[i].params.temperature, MAX_TEMPERATURE)] for i in sampled], logits.dtype,
                                logits.device)
        scaled = (rows.sub_(shift.unsqueeze(1)) if every else rows - shift.unsqueeze(1)).div_(temperature)
        keep = any(seqs[i].params.logprobs is not None and seqs[i].params.logprobs_mode == "processed" for i in sampled)
        to_host.append(_draw(scaled, [seqs[i] for i in sampled], in_place=not keep))
    host = torch.cat([t.to(torch.int64) for t in to_host]).tolist()
    count = len(seqs)
    if one_copy:
        finite, host = host[:count], host[count:]
    tokens: list[int | None] = host[:count] if len(host) > len(sampled) else [None] * count
    for i, token, row in zip(sampled, host[len(host) - len(sampled):], scaled if sampled else ()):
        tokens[i], processed[i] = token, row
    return [t if finite[i] else None for i, t in enumerate(tokens)], processed


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax whose entries are finite or -inf (a row without finite logits would give nan)."""
    logprobs = logits.log_softmax(-1)
    return logprobs.masked_fill(logprobs.isnan(), float("-inf"))


def prompt_logprob_entry(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """A prompt token's entry from its row of raw log-probabilities [V], with its rank."""
    entry = _logprob_entry(logprobs, token, k)
    entry.rank = 1 + int((logprobs > logprobs[token]).sum())
    return entry


def _logprob_entry(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    top = logprobs.topk(k) if k else None
    return TokenLogprob(token, logprobs[token].item(),
                        list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])


@torch.inference_mode()  # the logits come from an inference-mode forward, and are overwritten in place
def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int | Exception], list[TokenLogprob | None]]:
    """logits: [S, V] float32, one row per sequence -> (next token ids, logprob entries). A row whose
    sampling raised has the exception in place of its token id. `logits` may be overwritten (a vocabulary of
    150k tokens makes each [S, V] copy tens of MB)."""
    raw = _log_probs(logits) if any(s.params.logprobs is not None and s.params.logprobs_mode == "raw"
                                    for s in seqs) else None
    tokens, entries = [], []
    plain_greedy = all(s.params.greedy and s.params.repetition_penalty == 1.0 and not s.params.presence_penalty
                       and not s.params.frequency_penalty for s in seqs)
    if plain_greedy:
        batched, processed_rows = kernels.argmax_rows(logits).tolist(), logits
    else:
        plain = [i for i, s in enumerate(seqs) if _plain(s.params)]
        batched, processed_rows = [None] * len(seqs), None
        if plain:
            rows = logits if len(plain) == len(seqs) else logits[to_device(plain, torch.int64, logits.device)]
            try:
                chosen, processed = _choose_plain(rows, [seqs[i] for i in plain])
            except Exception:  # noqa: BLE001 - the rows go one by one below, where a failure is a row's own
                chosen = []
            for row, (i, token) in enumerate(zip(plain, chosen)):
                batched[i] = token if token is None else (token, processed[row])
    for i, seq in enumerate(seqs):
        p = seq.params
        try:
            if plain_greedy:
                token, processed = batched[i], processed_rows[i]
            elif batched[i] is not None:
                token, processed = batched[i]
            else:
                token, processed = _choose(logits[i], seq)
            entry = None if p.logprobs is None else _logprob_entry(
                raw[i] if p.logprobs_mode == "raw" else _log_probs(processed), token, p.logprobs)
        except Exception as err:  # noqa: BLE001 - this request's alone: the engine fails it and steps on
            token, entry = err, None
        tokens.append(token)
        entries.append(entry)
    return tokens, entries
