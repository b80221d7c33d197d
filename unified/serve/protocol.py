"""OpenAI request bodies as pydantic models, and their translation into engine sampling options.

Models are strict and closed: a wrong type or an unknown field is a 400 that names it, as the OpenAI API
does. Fields the reference documents but we do not implement are absent, so they are refused by name
rather than silently ignored. Engine options OpenAI lacks (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`) are accepted as extra body fields, as in vLLM. The bodies of our own
routes (feedback, weight reload) follow the same rules.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from unified.engine.sampling_params import InvalidRequest, SamplingParams

SEED_LIMIT = 2 ** 62


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class _Sampling(_Body):
    model: str
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = Field(None, description="up to 16 strings; the text stops before the first")
    seed: int | None = Field(None, ge=0, le=SEED_LIMIT)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Engine options beyond the OpenAI reference.
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 16:
            raise InvalidRequest(f"stop holds {len(stop)} strings; send at most 16")
        params = SamplingParams(n=self.n, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                seed=self.seed, max_tokens=max_tokens, stop=stop, stop_token_ids=self.stop_token_ids,
                                ignore_eos=self.ignore_eos, logprobs=logprobs)
        params.validate()
        return params


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI in favour of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(description="text, or token ids")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        return self.logprobs


class FeedbackRequest(_Body):
    id: str = Field(min_length=1, description="the `id` of a chat completion this server answered")
    accepted: bool
    comment: str | None = None


class ReloadWeightsRequest(_Body):
    path: str = Field(min_length=1, description="a checkpoint folder of the served architecture that every rank "
                                                "can read")
