"""OpenAI request bodies as pydantic models, and their translation into engine sampling options.

Models are strict and closed: a wrong type or an unknown field is a 400 that names it, as the OpenAI API
does. Fields the reference documents but we do not implement are absent, so they are refused by name
rather than silently ignored. Engine options OpenAI lacks (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`) are accepted as extra body fields, as in vLLM. Integers that reach a
tensor (token ids, top_k) are bounded here, so no request can overflow one. Text must be valid Unicode
(JSON may carry a lone UTF-16 surrogate, which no tokenizer can encode), and a body nests at most
MAX_DEPTH levels (chat templates recurse through tool schemas). The bodies of our own routes
(feedback, weight reload) follow the same rules.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from unified.engine.sampling_params import InvalidRequest, SamplingParams

SEED_LIMIT = 2 ** 62
INT32_MAX = 2 ** 31 - 1
# JSON Schema counts 2.0 as an integer, so the strict models take integral numbers written as floats too.
Int = Annotated[int, BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)]
TokenId = Annotated[Int, Field(ge=0, le=INT32_MAX)]
PromptTokenId = Annotated[Int, Field(ge=0)]
MAX_DEPTH = 64  # the deepest nesting a body may have: templates and serialisers below recurse through it


def _check_text_and_depth(body) -> None:
    """Raises ValueError naming the first place in `body` that holds a lone surrogate (keys included) or
    nests deeper than MAX_DEPTH. Iterative: a body may nest as deep as the JSON parser allows."""
    stack = [(body, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"{where} nests deeper than {MAX_DEPTH} levels; send a flatter body")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{where or 'body'} holds a lone UTF-16 surrogate (\\ud800-\\udfff alone), which "
                                 f"is not valid Unicode text; send valid UTF-8") from None
        elif isinstance(value, dict):
            stack += [(key, where or "body", depth) for key in value]
            stack += [(item, f"{where}.{key}" if where else str(key), depth + 1) for key, item in value.items()]
        elif isinstance(value, list):
            stack += [(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Request(_Body):
    """A route's whole body: its text and depth are checked once, here, before any field is used."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text_and_depth(cls, data):
        _check_text_and_depth(data)
        return data


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


class FunctionCall(_Body):
    name: str
    arguments: str = Field(description="the arguments as a JSON object, encoded as a string")


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class _Message(_Body):
    name: str | None = None


class PromptMessage(_Message):
    role: Literal["system", "developer", "user"]
    content: str | list[ContentPart]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[ContentPart] | None = Field(None, description="may be left out when tool_calls are given")
    tool_calls: list[ToolCall] | None = Field(None, description="the tools it called")

    @model_validator(mode="after")
    def _says_something(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Message):
    role: Literal["tool"]
    content: str | list[ContentPart]
    tool_call_id: str = Field(description="the call this result answers")


Message = Annotated[Union[PromptMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema object")
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Sampling(_Request):
    model: str
    n: Int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | Annotated[list[str], Field(max_length=16)] | None = Field(
        None, description="up to 16 strings; the text stops before the first")
    seed: Int | None = Field(None, ge=0, le=SEED_LIMIT)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = Field(None, description="only type 'text' until constrained "
                                                                     "decoding exists")
    # Engine options beyond the OpenAI reference.
    top_k: Int = Field(0, ge=0, le=INT32_MAX, description="0: off")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    return_token_ids: bool = Field(False, description="vLLM's: each choice also carries its prompt_token_ids and the "
                                                      "token_ids it generated (not with stream)")
    prompt_logprobs: Int | None = Field(None, ge=0, le=20, description="vLLM's: the raw logprob and rank of each "
                                        "prompt token after the first, plus the top k (not with stream)")

    def check_supported(self) -> None:
        if self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequest(f"response_format {self.response_format.type!r} needs constrained decoding, which "
                                 f"this server does not have yet; send response_format {{\"type\": \"text\"}} "
                                 f"or leave it out, and ask for JSON in the prompt")
        if self.stream and (self.return_token_ids or self.prompt_logprobs is not None):
            raise InvalidRequest("return_token_ids and prompt_logprobs work without streaming only here; send "
                                 "stream: false")

    @property
    def samples(self) -> int:
        """Sequences generated per prompt (completions' best_of may ask for more than the n returned)."""
        return self.n

    def engine_prompt_logprobs(self) -> int | None:
        """The top k the engine computes for each prompt token (None: none)."""
        return self.prompt_logprobs

    def default_max_tokens(self, server_default: int) -> int:
        """max_tokens when the client sends none (capped by the context the prompt leaves)."""
        return server_default

    def sampling_params(self, max_tokens: int, logprobs: int | None, n: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(n=n or self.n, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                seed=self.seed, max_tokens=max_tokens, stop=stop, stop_token_ids=self.stop_token_ids,
                                ignore_eos=self.ignore_eos, logprobs=logprobs,
                                prompt_logprobs=self.engine_prompt_logprobs())
        params.validate()
        return params


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1, description="deprecated by OpenAI in favour of max_completion_tokens")
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tool_choice is not None and not self.tools:
            raise InvalidRequest("tool_choice needs tools")
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            raise InvalidRequest("tool_choice 'required' or a named function needs constrained decoding, which "
                                 "this server does not have yet; send tool_choice 'auto' (the model decides) "
                                 "or 'none'")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) < len(names):
            raise InvalidRequest("two tools have the same function name; give each a name of its own")


class CompletionRequest(_Sampling):
    # The handler checks token ids against the vocabulary, which it knows.
    prompt: str | list[str] | list[PromptTokenId] | list[list[PromptTokenId]] = Field(
        description="text, token ids, or a batch of either (each prompt gets its own n choices)")
    max_tokens: Int | None = Field(None, ge=0, description="16 by default (OpenAI's), capped by the context the "
                                   "prompt leaves; 0 with echo scores the prompt alone")
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: Int | None = Field(None, ge=1, description="samples per prompt; the n with the highest mean "
                                                        "log-probability per token are returned")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        return self.logprobs

    @property
    def samples(self) -> int:
        return self.best_of or self.n

    def engine_prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens come with their logprobs
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def default_max_tokens(self, server_default: int) -> int:
        return 16

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, as lm-evaluation-harness scores text."""
        return self.echo and self.max_tokens == 0

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens=0 generates nothing; it scores the prompt with echo: true (and "
                                 "logprobs), else ask for at least one token")
        if self.stream and self.echo and (self.logprobs is not None or self.max_tokens == 0):
            raise InvalidRequest("echo with logprobs or max_tokens 0 works without streaming only here; send "
                                 "stream: false")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequest(f"best_of={self.best_of} must be at least n={self.n}")
        if self.stream and self.samples > self.n:
            raise InvalidRequest("best_of > n cannot stream: the best samples are known only at the end; "
                                 "send stream: false")

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one text or token-id list each."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [list(self.prompt)]


class FeedbackRequest(_Request):
    id: str = Field(min_length=1, description="the `id` of a chat completion this server answered")
    accepted: bool
    comment: str | None = None


class ReloadWeightsRequest(_Request):
    path: str = Field(min_length=1, description="a checkpoint folder of the served architecture that every rank "
                                                "can read")
