"""One request never fails the others, a client that leaves stops its work, and tools reach the template.

A server of its own: a context's worth of max_tokens (so requests run long enough to be dropped mid-way)
and a chat template that renders tools."""
from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import pytest
from openai import AsyncOpenAI

from tests.serve.conftest import ServerProcess, ready, stream_in_background

# A Hermes-style template: the tools as JSON in a system turn, calls as <tool_call> JSON.
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}To call one, answer <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>{{ {"name": call.function.name,
"arguments": call.function.arguments} | tojson }}</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "today's weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
LONG = {"max_tokens": 900, "ignore_eos": True}
SERVED_NAME = "acme/tiny-tools"  # names of the hub's shape hold a '/'


def test_a_served_name_with_a_slash_has_its_model_card(roomy_server):
    card = httpx.get(f"{roomy_server.base_url}/v1/models/{SERVED_NAME}", timeout=10)
    assert card.status_code == 200 and card.json()["id"] == SERVED_NAME, card.text
    assert httpx.get(f"{roomy_server.base_url}/v1/models/acme/other", timeout=10).status_code == 404


@pytest.fixture(scope="module")
def roomy_server(tiny_chat_checkpoint, tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-tools")
    shutil.copytree(tiny_chat_checkpoint, model, dirs_exist_ok=True)
    (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    process = ServerProcess(model, "engine.num_blocks=1024", "serve.max_tokens=1000", "serve.max_n=4",
                            f"serve.model_name={SERVED_NAME}", env={"UNIFIED_API_KEY": ""})
    process.model_name = SERVED_NAME
    with ready(process):
        yield process


def _chat(server, content: str = "Tell me a story.", **options) -> dict:
    return {"model": server.model_name, "messages": [{"role": "user", "content": content}], **options}


def _wait_idle(server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while server.metric("unified_num_requests_running") or server.metric("unified_kv_cache_used_blocks"):
        assert time.monotonic() < deadline, "requests still running (or KV blocks held) after their clients left"
        time.sleep(0.05)


# Every extreme the schema allows, and a little past it (those must be refused with a 4xx, never a 5xx).
EXTREMES = [
    {"temperature": 1e-300}, {"temperature": 1e-38}, {"temperature": 1e-6}, {"temperature": 0}, {"temperature": 2},
    {"top_p": 1e-300}, {"top_p": 5e-324}, {"top_p": 1}, {"min_p": 1}, {"min_p": 1e-300},
    {"repetition_penalty": 1e-40}, {"repetition_penalty": 5e-324}, {"repetition_penalty": 10},
    {"presence_penalty": 2, "frequency_penalty": 2}, {"presence_penalty": -2, "frequency_penalty": -2},
    {"top_k": 1}, {"top_k": 2 ** 31 - 1}, {"top_k": 2 ** 70}, {"seed": 0}, {"seed": 2 ** 62}, {"seed": 2 ** 63},
    {"stop": [chr(0x10FFFF) * 40] * 16}, {"stop": ["\x00", "e", " "]}, {"stop": "a" * 10000},
    {"stop_token_ids": list(range(64))}, {"stop_token_ids": [49151]}, {"n": 4, "temperature": 1e-300},
    {"logprobs": True, "top_logprobs": 20, "temperature": 1e-300}, {"max_tokens": 1}, {"max_tokens": 10 ** 30},
    {"temperature": 1e-300, "top_p": 1e-300, "min_p": 1, "repetition_penalty": 1e-40, "top_k": 1,
     "presence_penalty": -2, "frequency_penalty": 2},
]


def test_extreme_requests_never_fail_the_streams_beside_them(roomy_server):
    server, url = roomy_server, roomy_server.base_url + "/v1/chat/completions"
    streams = [stream_in_background(url, _chat(server, f"Story {i}", stream=True, max_tokens=300, ignore_eos=True))
               for i in range(3)]
    statuses = []
    with httpx.Client(timeout=120) as client:
        for options in EXTREMES:
            body = _chat(server, "Hi", **{"max_tokens": 8, **options})
            response = client.post(url, json=body)
            statuses.append(response.status_code)
            assert response.status_code < 500, (options, response.text)
            if response.status_code == 200:
                choices = response.json()["choices"]
                assert choices and all(c["finish_reason"] in ("stop", "length") for c in choices), (options, choices)
            else:
                assert response.json()["error"]["message"], options
    for events, thread in streams:
        thread.join(120)
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert statuses.count(200) >= len(EXTREMES) - 4, statuses  # only the values past the schema are refused
    assert "engine step failed" not in server.output()


def test_a_dropped_request_stops_at_once(roomy_server):
    """Non-streaming clients that time out: their requests are aborted, not run to max_tokens."""
    server = roomy_server
    aborted = _count(server, 'unified_requests_finished_total{reason="abort"}')
    finished = _count(server, 'unified_requests_finished_total{reason="length"}')

    async def impatient() -> None:
        async with httpx.AsyncClient(timeout=0.5) as client:
            async def one(i: int) -> None:
                with pytest.raises(httpx.TimeoutException):
                    await client.post(server.base_url + "/v1/completions", json={
                        "model": server.model_name, "prompt": f"Count to a thousand, {i}:", "n": 4, **LONG})
            await asyncio.gather(*(one(i) for i in range(8)))

    asyncio.run(impatient())
    _wait_idle(server, timeout=2.0)
    assert _count(server, 'unified_requests_finished_total{reason="abort"}') == aborted + 8
    assert _count(server, 'unified_requests_finished_total{reason="length"}') == finished


def test_dropped_clients_of_a_prompt_batch_free_every_request(roomy_server):
    server = roomy_server
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", timeout=0.5, json={
            "model": server.model_name, "prompt": ["One", "Two", "Three"], **LONG})
    _wait_idle(server, timeout=2.0)


def test_tools_reach_the_template_and_calls_come_back_parsed(roomy_server):
    server = roomy_server

    async def ask():
        async with AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            plain = await c.chat.completions.create(**_chat(server, "Weather in Paris?", max_tokens=2))
            tooled = await c.chat.completions.create(**_chat(server, "Weather in Paris?", max_tokens=2), tools=TOOLS,
                                                     tool_choice="auto")
            return plain, tooled

    plain, tooled = asyncio.run(ask())
    # The tool definitions were rendered into the prompt by the model's own template.
    assert tooled.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    answer = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": server.model_name, "messages": history, "tools": TOOLS, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    bad = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": server.model_name, "messages": [*history[:1], {"role": "assistant", "tool_calls": [
            {**call, "function": {"name": "get_weather", "arguments": "{not json"}}]}], "max_tokens": 2})
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]


def _count(server, name: str) -> float:
    try:
        return server.metric(name)
    except AssertionError:
        return 0.0
