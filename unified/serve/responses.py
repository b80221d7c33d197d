"""The shapes of what the server answers, for its OpenAPI document.

Handlers build plain dicts (no validation on the hot path); these models only document them, route by
route, with every error status a route can give. The suite's schemathesis run checks each response
against this document, so a handler that drifts from it fails there.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object, encoded as a string")


class AssistantToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[AssistantToolCall] | None = None


class _TokenIds(BaseModel):
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids: the prompt as the model saw it")
    token_ids: list[int] | None = Field(None, description="with return_token_ids: the tokens this choice generated")


class _ChatChoice(_TokenIds):
    index: int
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None


class ChatChoice(_ChatChoice):
    message: AssistantMessage


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class _Answer(BaseModel):
    id: str
    created: int
    model: str


PromptLogprobs = list[dict[str, dict] | None]
_PROMPT_LOGPROBS = ("with prompt_logprobs: per prompt token, null for the first, else {token id: {logprob, rank, "
                    "decoded_token}} for the token and the top k")


class ChatCompletion(_Answer):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids: the prompt as the model saw it")
    prompt_logprobs: PromptLogprobs | None = Field(None, description=_PROMPT_LOGPROBS)
    usage: Usage
    system_fingerprint: None


class StreamedToolCall(AssistantToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[StreamedToolCall] | None = None


class ChatChunkChoice(_ChatChoice):
    delta: ChatDelta


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null on every chunk but the "
                                                  "last, which has no choices")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="with echo, the prompt's first token has none")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_TokenIds):
    index: int
    prompt_logprobs: PromptLogprobs | None = Field(None, description=_PROMPT_LOGPROBS)
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class Completion(_Answer):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: None


class CompletionChunk(_Answer):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null on every chunk but the "
                                                  "last, which has no choices")


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(description="the context in tokens; null while the server starts")
    weight_version: str = Field(description="the served policy: the weight_version a trainer sent with its last "
                                            "update, else the count of weight updates since start")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Progress(BaseModel):
    done: int
    total: int


class Health(BaseModel):
    status: Literal["ready", "starting"]
    phase: Literal["loading_weights", "warming_up", "ready", "failed"]
    progress: dict[str, Progress]
    message: str
    model: str | None = None
    weights_version: int | None = None


class Feedback(BaseModel):
    object: Literal["feedback"]
    id: str
    accepted: bool
    comment: str | None
    created: int


class WeightsReloaded(BaseModel):
    object: Literal["weights"]
    reloaded: str
    weights_version: int


_ERRORS = {
    400: "the request is malformed or asks for something this server does not allow",
    401: "missing or wrong API key (when the server has one)",
    403: "the operation is switched off on this server",
    404: "no such model, conversation or route",
    409: "conflicts with the server's state",
    413: "the body is larger than the server accepts",
    503: "the server is starting, or the request could not finish",
    "default": "an unexpected server error",
}
_COMPONENTS = "#/components/schemas/"


def _event_stream(chunk: type[BaseModel]) -> dict:
    """Server-sent events as OpenAPI 3.1 describes a stream: the schema of one event, whose `data` is a JSON
    chunk (or an error, after which the stream ends) or the closing `[DONE]`."""
    payload = {"anyOf": [{"$ref": _COMPONENTS + chunk.__name__}, {"$ref": _COMPONENTS + "ErrorResponse"}]}
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}
    return {"schema": {"type": "object", "required": ["data"], "properties": {"data": data},
                       "description": "one server-sent event per chunk, `data: [DONE]` last"}}


def documented(ok: type[BaseModel] | None, *statuses: int, stream: type[BaseModel] | None = None) -> dict:
    """`responses=` for a route: its 200 body (and the chunks of its event stream), the listed error statuses
    and a default."""
    responses: dict = {code: {"model": ErrorResponse, "description": _ERRORS[code]} for code in (*statuses, "default")}
    if ok is not None:
        responses[200] = {"model": ok, "description": "success"}
        if stream is not None:
            responses[200]["content"] = {"text/event-stream": _event_stream(stream)}
    return responses


def _add_stream_chunks(schemas: dict) -> None:
    """Only the streams' schemas refer to the chunk models, so FastAPI does not list them."""
    for chunk in (ChatCompletionChunk, CompletionChunk):
        schema = chunk.model_json_schema(ref_template=_COMPONENTS + "{model}", mode="serialization")
        for name, definition in {**schema.pop("$defs", {}), chunk.__name__: schema}.items():
            schemas.setdefault(name, definition)


def describe_limits(document: dict, model_name: str, limits) -> dict:
    """The OpenAPI document completed: the schemas of stream chunks, and this server's own limits (the one
    model it serves, the serve.* bounds the handlers enforce), so that clients (and fuzzers) generating
    from the document send what it takes."""
    schemas = document["components"]["schemas"]
    _add_stream_chunks(schemas)

    def bound(schema: str, field: str, key: str, value) -> None:
        prop = schemas[schema]["properties"][field]
        for branch in prop.get("anyOf", [prop]):
            if branch.get("type") == ("array" if key == "maxItems" else "integer"):
                branch[key] = value

    for schema in ("ChatCompletionRequest", "CompletionRequest"):
        schemas[schema]["properties"]["model"]["enum"] = [model_name]
        bound(schema, "n", "maximum", limits.max_n)
        bound(schema, "max_tokens", "maximum", limits.max_tokens)
    bound("ChatCompletionRequest", "max_completion_tokens", "maximum", limits.max_tokens)
    bound("ChatCompletionRequest", "messages", "maxItems", limits.max_messages)
    bound("CompletionRequest", "best_of", "maximum", limits.max_n)
    for branch in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if branch.get("items", {}).get("type") in ("string", "array"):  # a batch of prompts, not one of token ids
            branch["maxItems"] = limits.max_prompts
    return document
