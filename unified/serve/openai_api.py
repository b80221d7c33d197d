"""`POST /v1/chat/completions` and `POST /v1/completions` in the shapes of the OpenAI API reference.

A handler turns the body into prompt token ids and sampling options (every limit checked here, before
the engine sees the request), submits it to the engine loop, and either collects the final output or
streams chunks as server-sent events. A client that goes away aborts its request, which frees its KV
blocks at the next step boundary. With a conversation log, a chat completion is on disk before the last
of its answer is sent, so feedback on it can follow at once.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from jinja2 import TemplateError
from fastapi.responses import JSONResponse, StreamingResponse

from unified.engine.sampling_params import InvalidRequest
from unified.serve.conversation_log import conversation_record
from unified.serve.detokenizer import IncrementalDetokenizer
from unified.serve.errors import APIError
from unified.serve.images import check_images, decode_images, image_refs, logged_messages, preprocess_images
from unified.serve.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from unified.engine.sampler import TokenLogprob

log = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    server = request.app.state.server
    loop = server.require_ready()
    server.check_model(body.model)
    from unified.engine.llm import chat_prompt  # loaded by the engine already; kept out of start-up imports

    if len(body.messages) > server.limits.max_messages:
        raise APIError(f"the request has {len(body.messages)} messages; this server accepts at most "
                       f"{server.limits.max_messages} (serve.max_messages)", param="messages")
    refs = image_refs(body.messages)
    processor = loop.engine.image_processor
    check_images(refs, len(await request.body()), server.limits, processor is not None)
    messages = [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.content if isinstance(m.content, str) else [p.model_dump(exclude_none=True)
                                                                          for p in m.content]}
                for m in body.messages]
    try:
        prompt = chat_prompt(loop.engine.tokenizer, messages, processor.prompt_marker if processor else None)
    except (TemplateError, ValueError, TypeError) as err:  # the model's own template refused the conversation
        raise APIError(f"the model's chat template rejected these messages: {err}", param="messages") from None
    images = await decode_images(refs)
    fmt = _ChatFormat(body, server.model_name)
    on_finish = None
    if server.conversations is not None:
        on_finish = functools.partial(_log_conversation, server.conversations, fmt, logged_messages(messages, images),
                                      loop.engine.weights_version)
    return await _serve(request, body, prompt, fmt, on_finish,
                        await preprocess_images(processor, images) if images else None)


async def _log_conversation(conversations, fmt, messages: list[dict], weights_version: int, final) -> None:
    record = conversation_record(fmt.id, fmt.created, fmt.model, weights_version, messages, final.outputs)
    try:
        await conversations.add_conversation(record)
    except OSError:  # the writer logged why; the client still gets its answer
        log.warning("chat completion %s answered but not logged", fmt.id)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    server = request.app.state.server
    loop = server.require_ready()
    server.check_model(body.model)
    if isinstance(body.prompt, str):
        prompt = loop.engine.tokenizer(body.prompt)["input_ids"]
    else:
        prompt = list(body.prompt)
    echo = (body.prompt if isinstance(body.prompt, str) else loop.engine.tokenizer.decode(prompt)) if body.echo else ""
    return await _serve(request, body, prompt, _CompletionFormat(body, server.model_name, echo))


async def _serve(request: Request, body, prompt: list[int], fmt, on_finish=None, images=None):
    """`on_finish(final output)`, a coroutine function, runs before the last of the answer is sent. `images`
    (ImageInputs) go with a prompt holding the model's image placeholder once per image."""
    server = request.app.state.server
    loop, limits = server.startup.loop, server.limits
    if body.n > limits.max_n:
        raise APIError(f"n={body.n} is more than this server allows ({limits.max_n}, serve.max_n)", param="n")
    context = loop.engine.max_model_len
    if not prompt:
        raise APIError("the prompt is empty; send at least one token", param="prompt")
    if len(prompt) >= context:
        raise APIError(f"the prompt has {len(prompt)} tokens but this model's context is {context} tokens; "
                       f"shorten the prompt", param="messages" if isinstance(fmt, _ChatFormat) else "prompt",
                       code="context_length_exceeded")
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, context - len(prompt))
    elif max_tokens > limits.max_tokens:
        raise APIError(f"max_tokens={max_tokens} is more than this server allows ({limits.max_tokens}, "
                       f"serve.max_tokens)", param="max_tokens")
    elif len(prompt) + max_tokens > context:
        raise APIError(f"this model's context is {context} tokens, but the prompt has {len(prompt)} and "
                       f"max_tokens asks for {max_tokens} more; lower max_tokens or shorten the prompt",
                       param="max_tokens", code="context_length_exceeded")
    try:
        params = body.sampling_params(max_tokens, body.logprobs_k())
        arrival = time.perf_counter()
        updates = await loop.submit(fmt.id, prompt, params, images)
    except InvalidRequest as err:
        raise APIError(str(err)) from None
    server.metrics.prompt_tokens.inc(len(prompt))
    tokenizer = loop.engine.tokenizer
    holdback = max((len(s) for s in params.stop), default=1) - 1
    choices = [_Choice(IncrementalDetokenizer(tokenizer, holdback)) for _ in range(body.n)]
    timer = _Timer(server.metrics, arrival)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(loop, fmt, updates, choices, tokenizer, timer, include_usage, on_finish)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    final = await _collect(request, loop, fmt.id, updates, timer)
    if on_finish is not None:
        await on_finish(final)
    return JSONResponse(fmt.response(final, tokenizer))


class _Timer:
    def __init__(self, metrics, arrival: float):
        self.metrics, self.arrival, self.last = metrics, arrival, None

    def tokens(self, count: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        elif count:
            self.metrics.tpot.observe((now - self.last) / count)
        self.last = now

    def done(self, final) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        for output in final.outputs:
            self.metrics.finished.labels(output.finish_reason).inc()

    def aborted(self) -> None:
        self.metrics.finished.labels("abort").inc()


class _Choice:
    def __init__(self, detokenizer: IncrementalDetokenizer):
        self.detokenizer = detokenizer
        self.started = False


async def _next(updates: asyncio.Queue):
    update = await updates.get()
    if isinstance(update, Exception):
        raise APIError(f"the request could not finish: {update}", status=503, type="server_error")
    return update


async def _collect(request: Request, loop, request_id: str, updates: asyncio.Queue, timer: _Timer):
    """Waits for the final output, aborting the request if the client disconnects meanwhile."""
    try:
        while True:
            try:
                update = await asyncio.wait_for(_next(updates), timeout=1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    raise asyncio.CancelledError from None
                continue
            if update.deltas:
                timer.tokens(len(update.deltas[0].token_ids))
            if update.final is not None:
                timer.done(update.final)
                return update.final
    except asyncio.CancelledError:
        loop.abort(request_id)
        timer.aborted()
        raise


async def _stream(loop, fmt, updates, choices, tokenizer, timer: _Timer, include_usage: bool, on_finish):
    finished = False
    try:
        while not finished:
            update = await _next(updates)
            if update.deltas:
                timer.tokens(len(update.deltas[0].token_ids))
            for delta in update.deltas:
                choice = choices[delta.index]
                # A finished sequence's last tokens may end in a stop string: its text comes from the final output.
                text = "" if delta.finished else choice.detokenizer.push(delta.token_ids)
                if not text and delta.logprobs is None:
                    continue
                logprobs = fmt.logprobs(delta.logprobs, tokenizer) if delta.logprobs is not None else None
                chunk = fmt.chunk(delta.index, text, logprobs, None, first=not choice.started)
                choice.started = True
                yield _sse(chunk, include_usage)
            if update.final is not None:
                finished = True
                timer.done(update.final)
                if on_finish is not None:
                    await on_finish(update.final)
                for output in update.final.outputs:
                    rest = choices[output.index].detokenizer.finish(output.text)
                    yield _sse(fmt.chunk(output.index, rest, None, output.finish_reason,
                                         first=not choices[output.index].started), include_usage)
                if include_usage:
                    yield _sse({**fmt.chunk_base(), "choices": [], "usage": _usage(update.final)}, False)
        yield "data: [DONE]\n\n"
    except APIError as err:  # the headers are sent: the error travels as an event, then the stream ends
        yield _sse({"error": err.body()["error"]}, False)
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            loop.abort(fmt.id)
            timer.aborted()


def _sse(chunk: dict, include_usage: bool) -> str:
    if include_usage and "usage" not in chunk:
        chunk["usage"] = None
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def _usage(final) -> dict:
    """Prompt tokens count each image's placeholder tokens, as the model saw them."""
    prompt_tokens = len(final.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in final.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens}}


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


class _Format:
    prefix = ""
    object = ""

    def __init__(self, body, model: str):
        self.body, self.model = body, model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def chunk_base(self) -> dict:
        return {"id": self.id, "object": self.object + ".chunk" if self.object == "chat.completion" else self.object,
                "created": self.created, "model": self.model}

    def response(self, final, tokenizer) -> dict:
        choices = [self.choice(o, tokenizer) for o in final.outputs]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": _usage(final), "system_fingerprint": None}


class _ChatFormat(_Format):
    prefix, object = "chatcmpl", "chat.completion"

    def logprobs(self, entries: list[TokenLogprob], tokenizer) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = _token_text(tokenizer, token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def choice(self, output, tokenizer) -> dict:
        return {"index": output.index, "message": {"role": "assistant", "content": output.text},
                "logprobs": self.logprobs(output.logprobs, tokenizer) if output.logprobs is not None else None,
                "finish_reason": output.finish_reason}

    def chunk(self, index: int, text: str, logprobs, finish_reason, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {**self.chunk_base(), "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                                  "finish_reason": finish_reason}]}


class _CompletionFormat(_Format):
    prefix, object = "cmpl", "text_completion"

    def __init__(self, body, model: str, echo: str):
        super().__init__(body, model)
        self.echo = echo

    def logprobs(self, entries: list[TokenLogprob], tokenizer) -> dict:
        tokens = [_token_text(tokenizer, e.token_id) for e in entries]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def choice(self, output, tokenizer) -> dict:
        return {"index": output.index, "text": self.echo + output.text,
                "logprobs": self.logprobs(output.logprobs, tokenizer) if output.logprobs is not None else None,
                "finish_reason": output.finish_reason}

    def chunk(self, index: int, text: str, logprobs, finish_reason, first: bool) -> dict:
        return {**self.chunk_base(), "choices": [{"index": index, "text": (self.echo if first else "") + text,
                                                  "logprobs": logprobs, "finish_reason": finish_reason}]}
