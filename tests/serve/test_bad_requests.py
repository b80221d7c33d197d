"""Every bad input gets the right 4xx with a message in the OpenAI error shape, and the server keeps serving."""
from __future__ import annotations

import json

import httpx
import pytest

GOOD_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _chat(server, **changes) -> dict:
    return {"model": server.model_name, **GOOD_CHAT, **changes}


CASES = [
    # (name, path, body builder, status, words the message must contain)
    ("malformed JSON", CHAT, lambda s: b'{"model": "x", "messages": [', 400, "not valid JSON"),
    ("not an object", CHAT, lambda s: b'[1, 2]', 400, "valid dictionary"),
    ("wrong type", CHAT, lambda s: _chat(s, temperature="hot"), 400, "temperature"),
    ("wrong type nested", CHAT, lambda s: _chat(s, messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("unknown field", CHAT, lambda s: _chat(s, tools=[]), 400, "unknown field 'tools'"),
    ("unknown role", CHAT, lambda s: _chat(s, messages=[{"role": "robot", "content": "x"}]), 400, "role"),
    ("missing messages", CHAT, lambda s: {"model": s.model_name}, 400, "messages"),
    ("no messages", CHAT, lambda s: _chat(s, messages=[]), 400, "messages"),
    ("too many messages", CHAT, lambda s: _chat(s, messages=[{"role": "user", "content": "x"}] * 9), 400, "at most 8"),
    ("unknown model", CHAT, lambda s: _chat(s, model="gpt-17"), 404, "does not exist"),
    ("max_tokens < 1", CHAT, lambda s: _chat(s, max_tokens=0), 400, "max_tokens"),
    ("max_tokens over the limit", CHAT, lambda s: _chat(s, max_tokens=65), 400, "serve.max_tokens"),
    ("n over the limit", CHAT, lambda s: _chat(s, n=5), 400, "serve.max_n"),
    ("top_logprobs without logprobs", CHAT, lambda s: _chat(s, top_logprobs=2), 400, "logprobs: true"),
    ("negative temperature", CHAT, lambda s: _chat(s, temperature=-1), 400, "temperature"),
    ("too many stop strings", CHAT, lambda s: _chat(s, stop=[str(i) for i in range(17)]), 400, "at most 16"),
    ("empty stop string", CHAT, lambda s: _chat(s, stop=[""]), 400, "non-empty"),
    ("image for a text model", CHAT, lambda s: _chat(s, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), 400, "text only"),
    ("prompt longer than the context", COMPLETIONS,
     lambda s: {"model": s.model_name, "prompt": [5] * 1024, "max_tokens": 1}, 400, "context is 1024 tokens"),
    ("prompt + max_tokens over the context", COMPLETIONS,
     lambda s: {"model": s.model_name, "prompt": [5] * 1000, "max_tokens": 30}, 400, "lower max_tokens"),
    ("empty prompt", COMPLETIONS, lambda s: {"model": s.model_name, "prompt": ""}, 400, "empty"),
    ("token id outside the vocabulary", COMPLETIONS, lambda s: {"model": s.model_name, "prompt": [10 ** 6]}, 400, "token ids"),
    ("body too large", COMPLETIONS, lambda s: {"model": s.model_name, "prompt": "x" * 70000}, 413, "serve.max_body_bytes"),
]


@pytest.mark.parametrize("name,path,body,status,words", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_refused_clearly(server, name, path, body, status, words):
    payload = body(server)
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    response = httpx.post(server.base_url + path, content=content, headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    assert error["type"] and "Traceback" not in response.text


def test_server_keeps_serving_after_bad_requests(server):
    for _ in range(2):
        httpx.post(server.base_url + CHAT, content=b"{", timeout=30)
        response = httpx.post(server.base_url + CHAT, json=_chat(server), timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] is not None


def test_openapi_document_describes_the_routes(server):
    document = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
    assert document["openapi"].startswith("3.")
    assert {CHAT, COMPLETIONS, "/v1/models", "/health", "/metrics"} <= set(document["paths"])
