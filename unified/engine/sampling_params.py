"""Per-request sampling options, validated when a request is added.

Logprobs: by default the raw model distribution (log-softmax of the unprocessed logits), which is what
RLHF needs to match a training forward pass; `logprobs_mode="processed"` reports the distribution
actually sampled from (after penalties, temperature, top-k/top-p/min-p).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from unified.errors import InvalidRequest


GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as in vLLM): sampling there is one-hot or overflows


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # below GREEDY_BELOW (0 included): greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style: over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style: over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: the chosen token's; k: plus the top k
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (never from the prefix cache)
    logprobs_mode: str = "raw"  # raw | processed

    @classmethod
    def from_dict(cls, options: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        params = cls(**options)
        params.validate()
        return params

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise InvalidRequest(message)

        need(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        need(math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature}")
        need(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        need(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
             f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        need(self.logprobs_mode in ("raw", "processed"), f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        need(all(isinstance(s, str) and s for s in self.stop), "stop must be a string or a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
