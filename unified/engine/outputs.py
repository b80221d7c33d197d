"""What the engine hands back: a request's outputs (one completion per sample) and the engine's counters."""
from __future__ import annotations

from dataclasses import dataclass

from unified.engine.sampler import TokenLogprob
from unified.engine.speculative import SpecDecodeStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # the request failed in the engine: its outputs end with finish_reason "error"
    prompt_logprobs: list | None = None  # with SamplingParams.prompt_logprobs: None, then a TokenLogprob per token


@dataclass
class EngineStats:
    running_requests: int
    waiting_requests: int
    used_blocks: int
    total_blocks: int
    fragmentation: float  # allocated-but-unfilled slots over allocated slots
    prefix_hit_rate: float  # prompt tokens found in the prefix cache over tokens looked up
    preemptions: int
    prefix_queried_tokens: int = 0  # since the last reset of the prefix cache (warm-up, weight swap)
    prefix_hit_tokens: int = 0
    spec: SpecDecodeStats | None = None  # speculative decoding's counters since start, when it is on

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.total_blocks
