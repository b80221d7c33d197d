"""Engine outputs in the OpenAI response shapes: chat completions and completions, whole or as stream chunks.

A request may hold several prompts (a completions batch), each submitted to the engine as a request of its
own with `samples` sequences; prompt p's choices are numbered p * n + i. With best_of > n, the n samples of
highest mean log-probability per token are kept. Logprobs the engine reports as -inf (a token filtered
out) are sent as -9999.0, as OpenAI does: JSON has no infinity.
"""
from __future__ import annotations

import math
import time
import uuid
from typing import TYPE_CHECKING

from unified.serve.tools import parse_tool_calls

if TYPE_CHECKING:
    from unified.engine.outputs import CompletionOutput, RequestOutput
    from unified.engine.sampler import TokenLogprob

LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def usage(finals: list[RequestOutput], completions: bool = True) -> dict:
    """Prompt tokens count each image's placeholder tokens, as the model saw them; completion tokens count
    every sample generated (best_of included), none where the answer drops them (`completions` False)."""
    prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(o.token_ids) for f in finals for o in f.outputs) if completions else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in finals)}}


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _prompt_logprobs(entries: list[TokenLogprob | None], tokenizer) -> list[dict | None]:
    """vLLM's shape: per prompt token, None for the first, else {token id: {logprob, rank, decoded_token}}
    for the token itself and the top k."""
    def described(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": _logprob(logprob), "rank": rank, "decoded_token": _token_text(tokenizer, token_id)}

    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        found = {str(t): described(t, lp, rank) for rank, (t, lp) in enumerate(entry.top, start=1)}
        found[str(entry.token_id)] = described(entry.token_id, entry.logprob, entry.rank)
        out.append(found)
    return out


def _mean_logprob(output: CompletionOutput) -> float:
    values = [e.logprob for e in output.logprobs or ()]
    return sum(values) / len(values) if values else LOGPROB_FLOOR


class ResponseFormat:
    prefix = ""
    object = ""

    def __init__(self, body, model: str, n: int, logprobs: bool):
        """`n` choices per prompt are returned; `logprobs`: whether the client asked for them."""
        self.body, self.model, self.n, self.wants_logprobs = body, model, n, logprobs
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def chunk_base(self) -> dict:
        return {"id": self.id, "object": self.object + ".chunk" if self.object == "chat.completion" else self.object,
                "created": self.created, "model": self.model}

    def best(self, final: RequestOutput) -> list[CompletionOutput]:
        """The outputs to return: all of them, or the n best when sampling more than n."""
        outputs = final.outputs
        if len(outputs) > self.n:
            outputs = sorted(outputs, key=_mean_logprob, reverse=True)[:self.n]
        return outputs

    def response(self, finals: list[RequestOutput], tokenizer) -> dict:
        choices = [self._with_token_ids(self.choice(p * self.n + i, output, tokenizer, final), final, output,
                                        tokenizer)
                   for p, final in enumerate(finals) for i, output in enumerate(self.best(final))]
        answer = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                  "choices": choices, "usage": usage(finals, self.returns_completions), "system_fingerprint": None}
        if len(finals) == 1:  # chat's one prompt: what vLLM's chat answer carries at the top
            if self.body.return_token_ids:
                answer["prompt_token_ids"] = list(finals[0].prompt_token_ids)
            if finals[0].prompt_logprobs is not None and self.object == "chat.completion":
                answer["prompt_logprobs"] = _prompt_logprobs(finals[0].prompt_logprobs, tokenizer)
        return answer

    def _with_token_ids(self, choice: dict, final: RequestOutput, output: CompletionOutput, tokenizer) -> dict:
        if self.body.return_token_ids:
            choice.update(prompt_token_ids=list(final.prompt_token_ids), token_ids=list(output.token_ids))
        if self.body.prompt_logprobs is not None and self.object == "text_completion":  # chat: at the top
            choice["prompt_logprobs"] = _prompt_logprobs(final.prompt_logprobs, tokenizer)
        return choice

    returns_completions = True  # False: the generated tokens are dropped (completions' scores_only)

    def _logprobs_of(self, output: CompletionOutput, tokenizer):
        return self.logprobs(output.logprobs, tokenizer) if self.wants_logprobs and output.logprobs is not None else None

    def holds_text(self) -> bool:
        """True when nothing may stream before the end (the answer is parsed as a whole)."""
        return False


class ChatFormat(ResponseFormat):
    prefix, object = "chatcmpl", "chat.completion"

    def __init__(self, body, model: str, parses_tool_calls: bool):
        super().__init__(body, model, body.n, body.logprobs)
        self.parses_tool_calls = parses_tool_calls

    def holds_text(self) -> bool:
        return self.parses_tool_calls

    def logprobs(self, entries: list[TokenLogprob], tokenizer) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = _token_text(tokenizer, token_id)
            return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        if not self.parses_tool_calls:
            return {"content": text}, finish_reason
        content, calls = parse_tool_calls(text)
        if not calls:
            return {"content": content}, finish_reason
        return {"content": content, "tool_calls": calls}, "tool_calls"

    def choice(self, index: int, output: CompletionOutput, tokenizer, final: RequestOutput | None = None) -> dict:
        message, finish_reason = self._message(output.text, output.finish_reason)
        return {"index": index, "message": {"role": "assistant", **message},
                "logprobs": self._logprobs_of(output, tokenizer), "finish_reason": finish_reason}

    def chunk(self, index: int, text: str, logprobs, finish_reason, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {**self.chunk_base(), "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                                  "finish_reason": finish_reason}]}

    def last_chunk(self, index: int, output: CompletionOutput, rest: str, first: bool) -> dict:
        """The chunk that ends a choice: the text not streamed yet (all of it, when tool calls are parsed)."""
        if not self.parses_tool_calls:
            return self.chunk(index, rest, None, output.finish_reason, first)
        message, finish_reason = self._message(output.text, output.finish_reason)
        if "tool_calls" in message:
            message["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        delta = {"role": "assistant", **message} if first else message
        return {**self.chunk_base(), "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                  "finish_reason": finish_reason}]}


class CompletionFormat(ResponseFormat):
    prefix, object = "cmpl", "text_completion"

    def __init__(self, body, model: str, echoes: list[str] | None):
        """`echoes`: each prompt's text, sent before its choices' text when the client asked for echo."""
        super().__init__(body, model, body.n, body.logprobs is not None)
        self.echoes = echoes
        self.returns_completions = not body.scores_only

    def _echo(self, index: int) -> str:
        return self.echoes[index // self.n] if self.echoes else ""

    def logprobs(self, entries: list[TokenLogprob | None], tokenizer, token_ids: list[int] | None = None) -> dict:
        """OpenAI's legacy shape; `token_ids` name the tokens of entries that are None (an echoed prompt's first,
        which has no logprob). Offsets count characters of the tokens' texts from the first."""
        ids = [e.token_id if e is not None else token_ids[i] for i, e in enumerate(entries)]
        tokens = [_token_text(tokenizer, t) for t in ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": [None if e is None else _logprob(e.logprob) for e in entries],
                "top_logprobs": [None if e is None else {_token_text(tokenizer, t): _logprob(lp) for t, lp in e.top}
                                 for e in entries],
                "text_offset": offsets}

    def choice(self, index: int, output: CompletionOutput, tokenizer, final: RequestOutput | None = None) -> dict:
        generated = self.returns_completions
        logprobs = None
        if self.wants_logprobs and self.echoes and final is not None and final.prompt_logprobs is not None:
            entries = [*final.prompt_logprobs, *((output.logprobs or []) if generated else [])]
            logprobs = self.logprobs(entries, tokenizer, list(final.prompt_token_ids))
        elif self.wants_logprobs and generated:
            logprobs = self._logprobs_of(output, tokenizer)
        return {"index": index, "text": self._echo(index) + (output.text if generated else ""), "logprobs": logprobs,
                "finish_reason": output.finish_reason}

    def chunk(self, index: int, text: str, logprobs, finish_reason, first: bool) -> dict:
        return {**self.chunk_base(), "choices": [{"index": index, "text": (self._echo(index) if first else "") + text,
                                                  "logprobs": logprobs, "finish_reason": finish_reason}]}

    def last_chunk(self, index: int, output: CompletionOutput, rest: str, first: bool) -> dict:
        return self.chunk(index, rest, None, output.finish_reason, first)
