"""Concurrency: 64 streaming clients at once, client disconnects, and no KV block left behind."""
from __future__ import annotations

import asyncio
import re
import time

import httpx
from openai import AsyncOpenAI, OpenAI


def _wait_idle(server, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while server.metric("unified_kv_cache_used_blocks") or server.metric("unified_num_requests_running"):
        assert time.monotonic() < deadline, "KV blocks still held after every request ended"
        time.sleep(0.1)


def test_64_concurrent_streams_complete_correctly(server):
    prompts = [f"Request {i}: write about the number {i * 37}." for i in range(64)]
    options = dict(model=server.model_name, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})

    async def one(client: AsyncOpenAI, prompt: str) -> str:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=True,
                                                      **options)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_at_once() -> list[str]:
        async with AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                               timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    streamed = asyncio.run(all_at_once())
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    alone = [client.chat.completions.create(messages=[{"role": "user", "content": p}], **options).choices[0].message.content
             for p in prompts]
    assert streamed == alone, "answers under load differ from answers given one at a time"
    _wait_idle(server)
    metrics = httpx.get(server.base_url + "/metrics").text
    assert not re.search(r'endpoint="/v1/[^"]*",status="5', metrics), "a request failed with a server error"


def test_disconnect_mid_stream_frees_the_blocks(server):
    aborted_before = _aborted(server)
    body = {"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 64, "n": 4, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    _wait_idle(server)
    assert _aborted(server) == aborted_before + 1


def _aborted(server) -> float:
    try:
        return server.metric('unified_requests_finished_total{reason="abort"}')
    except AssertionError:
        return 0.0


def test_a_cached_prefix_shows_as_hits_in_metrics(server):
    """A system prompt of 512+ tokens served once, then a request behind it with a short tail of its own: the
    second finds the prompt's full blocks in the prefix cache, and /metrics counts them."""
    system = " ".join(f"rule{i}" for i in range(160))
    body = {"model": server.model_name, "max_tokens": 1, "temperature": 0}
    queries, hits = server.metric("unified_prefix_cache_queries_total"), server.metric("unified_prefix_cache_hits_total")
    for tail in ("First question?", "Second question?"):
        response = httpx.post(server.base_url + "/v1/completions", json={**body, "prompt": f"{system}\n{tail}"},
                              timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] >= 512 + 4
    _wait_idle(server)
    assert server.metric("unified_prefix_cache_queries_total") - queries >= 2 * 512
    assert server.metric("unified_prefix_cache_hits_total") - hits >= 512
