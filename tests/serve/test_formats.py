"""Response shapes on their own: tool-call parsing, best_of selection, logprobs JSON can carry, and a stream
whose own text fails ending with an error event."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from unified.engine.outputs import CompletionOutput, RequestOutput
from unified.engine.sampler import TokenLogprob
from unified.serve.async_engine import Delta, Update
from unified.serve.detokenizer import IncrementalDetokenizer
from unified.serve.formats import LOGPROB_FLOOR, ChatFormat, CompletionFormat
from unified.serve.openai_api import _Choice, _Group, _stream, _Timer
from unified.serve.tools import parse_tool_calls, template_takes_tools


class _Tokenizer:
    def __init__(self, fails_on: int | None = None):
        self.fails_on = fails_on

    def decode(self, ids, skip_special_tokens=False) -> str:
        if self.fails_on in ids:
            raise ValueError("cannot decode")
        return "".join(f"<{i}>" for i in ids)


def _output(index: int, logprobs: list[float], text: str = "") -> CompletionOutput:
    entries = [TokenLogprob(7, lp, [(7, lp), (8, float("-inf"))]) for lp in logprobs]
    return CompletionOutput(index, text or f"sample {index}", [7] * len(logprobs), "length", entries)


def test_tool_calls_are_parsed_out_of_the_text():
    content, calls = parse_tool_calls('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Paris"}}\n</tool_call>')
    assert content == "Let me look."
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    two = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>')
    assert two[0] is None and [c["function"]["name"] for c in two[1]] == ["a", "b"]
    for text in ("no calls here", "<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_tool_calls(text) == (text, [])


def test_a_template_takes_tools_only_when_it_renders_them():
    assert template_takes_tools(SimpleNamespace(chat_template="{% for tool in tools %}{{ tool }}{% endfor %}"))
    assert not template_takes_tools(SimpleNamespace(chat_template="{{ messages[0].content }}"))
    assert not template_takes_tools(SimpleNamespace(chat_template=None))
    assert template_takes_tools(SimpleNamespace(chat_template={"default": "x", "tool_use": "{{ tools }}"}))


def test_best_of_keeps_the_samples_of_highest_mean_logprob_and_json_safe_logprobs():
    body = SimpleNamespace(n=2, logprobs=None, return_token_ids=False, prompt_logprobs=None, scores_only=False)
    fmt = CompletionFormat(body, "tiny", echoes=None)
    final = RequestOutput("r", [1, 2], [_output(0, [-3.0, -3.0]), _output(1, [-0.5]), _output(2, [-1.0, -2.0])], True)
    response = fmt.response([final], _Tokenizer())
    assert [c["text"] for c in response["choices"]] == ["sample 1", "sample 2"]
    assert [c["index"] for c in response["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in response["choices"])  # used for ranking, not asked for
    assert response["usage"]["completion_tokens"] == 5  # every sample generated counts
    chat = ChatFormat(SimpleNamespace(n=1, logprobs=True, return_token_ids=False, prompt_logprobs=None), "tiny",
                      parses_tool_calls=False)
    choice = chat.response([RequestOutput("r", [1], [_output(0, [float("-inf")])], True)], _Tokenizer())["choices"][0]
    json.dumps(choice, allow_nan=False)
    assert choice["logprobs"]["content"][0]["logprob"] == LOGPROB_FLOOR


class _Loop:
    """The engine loop's side of one request: a queue already holding its updates."""

    def __init__(self, updates: list):
        self.updates, self.aborted = updates, []

    async def submit(self, request_id, prompt, params, images):
        queue = asyncio.Queue()
        for update in self.updates:
            queue.put_nowait(update)
        return queue

    def abort(self, request_id):
        self.aborted.append(request_id)


def test_a_stream_whose_own_text_fails_ends_with_an_error_event():
    async def events(tokenizer) -> tuple[list[str], _Loop]:
        loop = _Loop([Update([Delta(0, [5], None, False)]), Update([Delta(0, [6], None, False)])])
        group = _Group(loop, ["r"])
        await group.submit("r", [1], None, None)
        body = SimpleNamespace(n=1, logprobs=None, return_token_ids=False, prompt_logprobs=None, scores_only=False)
        fmt = CompletionFormat(body, "tiny", echoes=None)
        metrics = SimpleNamespace(ttft=SimpleNamespace(observe=lambda s: None),
                                  tpot=SimpleNamespace(observe=lambda s: None),
                                  finished=SimpleNamespace(labels=lambda r: SimpleNamespace(inc=lambda: None)))
        choices = [_Choice(IncrementalDetokenizer(tokenizer))]
        sent = [e async for e in _stream(group, fmt, choices, tokenizer, _Timer(metrics, 0.0), False, None)]
        return sent, loop

    sent, loop = asyncio.run(events(_Tokenizer(fails_on=6)))
    assert json.loads(sent[0][6:])["choices"][0]["text"] == "<5>"
    assert json.loads(sent[1][6:])["error"]["type"] == "server_error"
    assert sent[-1] == "data: [DONE]\n\n" and loop.aborted == ["r"]
