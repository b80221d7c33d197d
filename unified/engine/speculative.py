"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward of the target model.

A decoding sequence with a draft of k tokens computes k + 1 positions in one step (its last token and the
k drafts; the scheduler counts them against the token budget, the blocks they need are allocated like any
others). The k + 1 rows of logits then decide how many drafts stand:

- greedy sequences keep drafts while each equals the target's argmax at its position, then take the
  target's token at the first mismatch (or the bonus token after the last draft), so the output is the
  non-speculative output token for token;
- sampled sequences use the rejection rule (Leviathan et al.; vLLM's rejection sampler): draft d at a
  position where the target's distribution is p and the proposer's q is kept with probability
  min(1, p(d) / q(d)); the first rejected position draws from max(0, p - q) normalised, and when all are
  kept a bonus token is drawn from the next row. The output is distributed exactly as the target's. Every
  proposal here is a point mass (q(d) = 1): keep with probability p(d), else draw from p without d, which is
  drawing each position's token from p as plain sampling does and keeping on while it equals the draft. Done
  so, each token takes one number from the sequence's generator, with or without a draft at its position, so a
  seeded request's output does not depend on the batch (which decides how many drafts a step verifies).

The K/V written for rejected drafts lie beyond the sequence's computed tokens: the next step overwrites
them, and blocks held only for them go back to the pool (prefix-cache hashes cover computed tokens only).

Drafters: `ngram` (prompt lookup: the continuation of the latest earlier occurrence of the sequence's
last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`; vLLM's `ngram` method), `draft` (a
smaller model with the same vocabulary continues each sequence greedily; it runs in an engine of its own on
the target's ranks, split as the target is, whose prefix cache keeps each sequence's context between steps,
so a step's drafts cost the new tokens' prefill and `num_tokens - 1` decodes of the small model) and `mtp`
(the checkpoint's own multi-token prediction layer, unified/engine/mtp.py). Every proposal is a point mass (a
greedy choice), so the rule above is exact for each; a drafter that sampled would need the general rule.

Sequences with repetition, presence or frequency penalties, or processed-mode logprobs, decode one token
per step (their processing depends on every earlier token, drafts included).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from unified.config.schema import EngineConfig
from unified.engine.mtp import MTPDrafter
from unified.engine.sampler import _choose, _log_probs, _logprob_entry
from unified.engine.sampling_params import InvalidRequest, SamplingParams
from unified.engine.sequence import Sequence
from unified.errors import UserError

log = logging.getLogger(__name__)

METHODS = ("ngram", "draft", "mtp")


def check_config(cfg) -> None:
    """A clear error for an `engine.speculative` the engine cannot run."""
    if cfg.method == "draft" and not cfg.draft_model:
        raise UserError("engine.speculative.method=draft needs engine.speculative.draft_model=<checkpoint folder> "
                        "(a smaller model with the same tokenizer)")
    if cfg.method not in METHODS:
        raise UserError(f"engine.speculative.method={cfg.method!r} is unknown; use one of {', '.join(METHODS)}, "
                        f"or null for no speculation")
    if cfg.num_tokens < 1:
        raise UserError(f"engine.speculative.num_tokens={cfg.num_tokens}: propose at least 1 token per step")
    if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
        raise UserError(f"engine.speculative.prompt_lookup_min={cfg.prompt_lookup_min} and prompt_lookup_max="
                        f"{cfg.prompt_lookup_max}: need 1 <= min <= max")


def speculates(params: SamplingParams) -> bool:
    """Whether a sequence with these parameters may take drafts (see the module's last paragraph)."""
    return (params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty
            and (params.logprobs is None or params.logprobs_mode == "raw"))


def ngram_proposal(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the last n tokens (the longest
    n in [min_n, max_n] that occurs); [] when none does. A scan of the whole sequence: the reference `NgramIndex`
    answers from without one."""
    count = len(token_ids)
    if count <= min_n or num_tokens < 1:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, count - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every n-gram that has a successor
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start:start + num_tokens].tolist()
    return []


class NgramIndex:
    """One sequence's n-grams of `min_n` to `max_n` tokens, each mapped to the position after its latest
    occurrence that has a token after it, kept up to date as tokens are appended (max_n - min_n + 1 dict entries
    and updates per token).
    A proposal is then a few lookups at any context length, where a scan of the sequence (`ngram_proposal`, the
    same answers) costs every step time that grows with the context, which a sequence whose n-grams never match
    pays for nothing (bench/RESULTS.md)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.following: dict[tuple[int, ...], int] = {}
        self.count, self.last = 0, None  # tokens indexed, and the last of them

    def proposal(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """`ngram_proposal(token_ids, min_n, max_n, num_tokens)` for this sequence's tokens, which only grow."""
        count = len(token_ids)
        if self.count > count or (self.count and token_ids[self.count - 1] != self.last):  # other tokens: start over
            self.following.clear()
            self.count = 0
        for i in range(max(self.count, 1), count):  # token i follows the n-grams that end at i - 1
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self.following[tuple(token_ids[i - n:i])] = i
        self.count, self.last = count, token_ids[-1] if count else None
        if count <= self.min_n or num_tokens < 1:
            return []
        for n in range(min(self.max_n, count - 1), self.min_n - 1, -1):
            start = self.following.get(tuple(token_ids[count - n:]))
            if start is not None:
                return token_ids[start:start + num_tokens]
        return []


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: steps with a draft, draft tokens, accepted ones, accepted per position."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for position in range(accepted):
            self.accepted_per_pos[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified sequence gains per step: 1 (the target's own) plus the accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class Drafter:
    """Proposes drafts for sequences; `before_forward` and `after_step` let it follow the engine's steps."""

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (sequence, room): at most `room` draft tokens (possibly none)."""
        raise NotImplementedError

    def before_forward(self, batch) -> None:
        """After scheduling, before the target's forward."""

    def after_step(self, batch) -> None:
        """After the step's tokens are chosen and appended."""

    def follow(self, command) -> None:
        """On a follower rank of a multi-rank engine: obeys a `DrafterCommand` the driver's drafter sent."""
        raise NotImplementedError


class DrafterCommand:
    """A message from the driver's drafter to the followers' (`Drafter.follow`), between the target's steps
    (method `mtp`'s is `MTPForward`)."""


class FollowDraftSteps(DrafterCommand):
    """Method `draft` on several ranks: follow the draft engine's steps until its driver releases them."""


class NgramDrafter(Drafter):
    def __init__(self, cfg):
        self.min_n, self.max_n = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self._indexes: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts = []
        for seq, room in wanted:
            index = self._indexes.get(seq)
            if index is None:
                index = self._indexes[seq] = NgramIndex(self.min_n, self.max_n)
            drafts.append(index.proposal(seq.token_ids, room))
        return drafts


class Speculator:
    """Proposes drafts for the running sequences before a step and verifies them after it."""

    def __init__(self, cfg, max_model_len: int, drafter: Drafter):
        """`cfg`: a checked engine.speculative (`check_config`)."""
        self.cfg, self.max_model_len, self.drafter = cfg, max_model_len, drafter
        self.stats = SpecDecodeStats()
        self._logged_drafts = 0

    def propose(self, running: list[Sequence]) -> None:
        """Sets `draft` on each decoding sequence that may take one (room left in max_tokens and the context)."""
        wanted = []
        for seq in running:
            seq.draft = []
            if seq.num_computed_tokens != seq.num_tokens - 1 or not speculates(seq.params):
                continue
            room = min(self.cfg.num_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens - 1)
            if room > 0:
                wanted.append((seq, room))
        if wanted:
            for (seq, _), draft in zip(wanted, self.drafter.propose(wanted)):
                seq.draft = draft

    def verify(self, seq: Sequence, draft: list[int], rows: torch.Tensor, greedy_tokens: list[int] | None
               ) -> tuple[list[int], list]:
        """The tokens `seq` gains from its draft's step (the accepted drafts, then the target's own token) and
        their logprob entries (None where not asked for). `rows`: the step's float32 logits at the k + 1
        positions; `greedy_tokens`: their argmaxes instead, when the runner found only those."""
        if greedy_tokens is not None or seq.params.greedy:
            targets = greedy_tokens if greedy_tokens is not None else rows.argmax(-1).tolist()
            accepted = 0
            while accepted < len(draft) and draft[accepted] == targets[accepted]:
                accepted += 1
            tokens = draft[:accepted] + [targets[accepted]]
        else:
            tokens = self._rejection_sample(seq, draft, rows)
        self.stats.record(len(draft), len(tokens) - 1)
        k = seq.params.logprobs
        entries = ([_logprob_entry(_log_probs(rows[i]), token, k) for i, token in enumerate(tokens)]
                   if k is not None else [None] * len(tokens))
        return tokens, entries

    def _rejection_sample(self, seq: Sequence, draft: list[int], rows: torch.Tensor) -> list[int]:
        """The rejection rule for a draft that is a point mass q at each drafted token, as every drafter's is (they
        propose their greedy continuations): accepting with min(1, p/q) = p(draft), else drawing from the
        normalised max(0, p - q) = p without the draft, is drawing the position's token from p and keeping on
        while it equals the draft. So each token drawn here is the plain sampler's (`_choose`), taking one number
        from the sequence's generator, as without speculation: a seeded request's tokens do not depend on how
        many drafts a step had room to verify, which the rest of the batch decides."""
        tokens = []
        for i, proposed in enumerate(draft):
            tokens.append(_choose(rows[i], seq)[0])
            if tokens[-1] != proposed:
                return tokens
        return tokens + [_choose(rows[len(draft)], seq)[0]]

    def log_progress(self, final: bool = False) -> None:
        """The mean acceptance length in the log, every thousand drafts (and at the end, `final`)."""
        if final or self.stats.num_drafts >= self._logged_drafts + 1000:
            self._logged_drafts = self.stats.num_drafts
            log.info("speculative decoding: %d drafts, mean acceptance length %.2f tokens per step",
                     self.stats.num_drafts, self.stats.mean_acceptance_length)


class DraftModel(Drafter):
    """Method `draft`: a small model's engine that continues the target's sequences greedily.

    On several ranks the draft model is split as the target is and its engine spans the same ranks: the
    driver tells the target's followers to follow the draft engine's steps while it drafts, then releases
    them back to the target's."""

    def __init__(self, engine, target_runner):
        self.engine, self.target_runner = engine, target_runner

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """[] where the context does not fit the draft's engine."""
        ids = []
        for seq, count in wanted:
            try:
                ids.append(self.engine.add_request(seq.token_ids, SamplingParams(temperature=0, max_tokens=count,
                                                                                 ignore_eos=True)))
            except InvalidRequest:
                ids.append(None)
        done = {}
        followed = self.engine.has_unfinished() and self.target_runner.distributed
        if followed:
            self.target_runner.command(FollowDraftSteps())
        try:
            while self.engine.has_unfinished():
                done.update((out.request_id, out.outputs[0].token_ids) for out in self.engine.step())
        finally:
            if followed:  # a release without the command would end the followers' loop of the target's steps
                self.engine.release_followers()
        return [done.get(i, []) if i is not None else [] for i in ids]

    def follow(self, command: FollowDraftSteps) -> None:
        self.engine.follow(ignore_signals=False)


def cache_layers(spec, config) -> list[int]:
    """Cache layers a drafter adds after the model's own (method `mtp`: its layer's)."""
    return [config.num_layers] if spec is not None and spec.method == "mtp" else []


def speculator_for(engine, draft_model, accelerator) -> Speculator | None:
    """`engine`'s speculator under its `engine.speculative` config (None when off); `draft_model`: method
    `draft`'s model, which gets an engine of its own, or method `mtp`'s MTP layer."""
    spec = engine.cfg.speculative
    if spec is None or spec.method is None:
        return None
    if engine.runner.mrope:
        raise UserError("engine.speculative is not available for models with M-RoPE positions yet; "
                        "leave engine.speculative.method null")
    check_config(spec)
    if spec.method == "ngram":
        drafter = NgramDrafter(spec)
    elif spec.method in ("draft", "mtp") and engine.model.stage.size > 1:
        raise UserError(f"engine.speculative.method={spec.method} does not run under pipeline parallelism yet; use "
                        f"tensor or expert parallelism, or method=ngram")
    elif spec.method == "draft":
        drafter = DraftModel(_draft_engine(engine, draft_model, accelerator), engine.runner)
    else:
        if not engine.config.num_mtp_layers or draft_model is None:
            raise UserError("engine.speculative.method=mtp: the model has no multi-token prediction layer loaded "
                            "(DeepSeek-V3 / Kimi-K2 style checkpoints ship one: num_nextn_predict_layers); use "
                            "method=ngram or draft")
        drafter = MTPDrafter(draft_model, engine.model, engine.runner, engine.packs_weights)
    log.info("speculative decoding: %s, up to %d draft tokens per step", spec.method, spec.num_tokens)
    return Speculator(spec, engine.max_model_len, drafter)


def _draft_engine(engine, draft_model, accelerator):
    """The draft model's engine: as many blocks as the target's (it holds the same contexts, in fewer bytes),
    its own prefix cache, no speculation of its own."""
    if draft_model is None:
        raise UserError("engine.speculative.method=draft: no draft model was loaded; set "
                        "engine.speculative.draft_model=<checkpoint folder>")
    if draft_model.config.vocab_size != engine.config.vocab_size:
        raise UserError(f"the draft model's vocabulary ({draft_model.config.vocab_size} tokens) is not the "
                        f"target's ({engine.config.vocab_size}); use a draft model with the same tokenizer")
    cfg = engine.cfg
    draft_cfg = EngineConfig(block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                             max_num_batched_tokens=cfg.max_num_batched_tokens, chunked_prefill=cfg.chunked_prefill,
                             packed_weights=cfg.packed_weights, num_blocks=engine.blocks.num_blocks,
                             max_model_len=engine.max_model_len, enforce_eager=True)
    return type(engine)(draft_model, None, draft_cfg, engine.device, engine.dtype, accelerator,
                        group=engine.runner.group)
