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
    ("unknown field", CHAT, lambda s: _chat(s, functionz=[]), 400, "unknown field 'functionz'"),
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
    # Token ids are checked before anything uses them: echo decodes the prompt, the sampler compares stop ids.
    ("huge token id with echo", COMPLETIONS,
     lambda s: {"model": s.model_name, "prompt": [1, 2, 4152840609367], "echo": True}, 400, "token id 4152840609367"),
    ("negative token id", COMPLETIONS, lambda s: {"model": s.model_name, "prompt": [1, -2]}, 400, "prompt"),
    ("token id outside the vocabulary in a batch", COMPLETIONS,
     lambda s: {"model": s.model_name, "prompt": [[1, 2], [3, 10 ** 6]], "echo": True}, 400, "prompt[1]"),
    ("stop token id past int64", CHAT, lambda s: _chat(s, stop_token_ids=[2 ** 70]), 400, "stop_token_ids"),
    ("negative stop token id", CHAT, lambda s: _chat(s, stop_token_ids=[-3]), 400, "stop_token_ids"),
    ("stop token id outside the vocabulary", CHAT, lambda s: _chat(s, stop_token_ids=[10 ** 12]), 400,
     "stop_token_ids"),
    ("top_k past int64", CHAT, lambda s: _chat(s, top_k=2 ** 70), 400, "top_k"),
    # Bodies that cannot be read at all still get the OpenAI error shape.
    ("invalid UTF-8", CHAT, lambda s: b'{"model": "x", "messages": "\xff\xfe"}', 400, "not valid UTF-8"),
    ("JSON nested 100k deep", CHAT, lambda s: b"[" * 60000 + b"]" * 60000, 413, "serve.max_body_bytes"),
    ("JSON nested too deep", CHAT, lambda s: b'{"a": ' + b"[" * 20000 + b"]" * 20000 + b"}", 400, "nested too deeply"),
    ("tool schema nested too deep", CHAT, lambda s: _chat(s, tools=[{"type": "function", "function": {
        "name": "f", "parameters": json.loads('{"a": ' * 900 + "1" + "}" * 900)}}]), 400, "nests deeper than 64"),
    ("lone surrogate", CHAT, lambda s: json.dumps(_chat(s, messages=[{"role": "user", "content": "a\ud800b"}])).encode(),
     400, "lone UTF-16 surrogate"),
    ("lone surrogate in a prompt", COMPLETIONS,
     lambda s: json.dumps({"model": s.model_name, "prompt": "\udfff"}).encode(), 400, "prompt holds a lone"),
    ("constrained decoding", CHAT, lambda s: _chat(s, response_format={"type": "json_object"}), 400,
     "constrained decoding"),
    ("json_schema response format", COMPLETIONS, lambda s: {"model": s.model_name, "prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, 400, "constrained decoding"),
    ("tools on a template without tools", CHAT, lambda s: _chat(s, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]), 400, "does not render tools"),
    ("tool_choice required", CHAT, lambda s: _chat(s, tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f"}}]), 400, "constrained decoding"),
    ("tool message without its call id", CHAT, lambda s: _chat(s, messages=[{"role": "tool", "content": "x"}]), 400,
     "tool_call_id"),
    ("best_of below n", COMPLETIONS, lambda s: {"model": s.model_name, "prompt": "x", "n": 3, "best_of": 2}, 400,
     "best_of=2 must be at least n=3"),
    ("best_of streamed", COMPLETIONS,
     lambda s: {"model": s.model_name, "prompt": "x", "best_of": 2, "stream": True}, 400, "cannot stream"),
    ("best_of over the limit", COMPLETIONS, lambda s: {"model": s.model_name, "prompt": "x", "best_of": 5}, 400,
     "serve.max_n"),
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


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nothing", 404), ("POST", "/v2/completions", 404),
                                                ("DELETE", "/v1/completions", 405), ("POST", "/health", 405)])
def test_unknown_routes_and_methods_answer_in_the_openai_shape(server, method, path, status):
    response = httpx.request(method, server.base_url + path, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert path in error["message"] and "/openapi.json" in error["message"], error


def test_a_chunked_body_over_the_limit_is_refused_as_too_large(server):
    def chunks():
        yield b'{"model": "x", "prompt": "'
        for _ in range(20):
            yield b"x" * 4096
        yield b'"}'

    response = httpx.post(server.base_url + COMPLETIONS, content=chunks(), timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and "serve.max_body_bytes" in response.json()["error"]["message"]


def test_server_keeps_serving_after_bad_requests(server):
    for _ in range(2):
        httpx.post(server.base_url + CHAT, content=b"{", timeout=30)
        response = httpx.post(server.base_url + CHAT, json=_chat(server), timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] is not None


def test_openapi_document_describes_the_routes(server):
    document = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
    assert document["openapi"].startswith("3.")
    paths = document["paths"]
    assert {CHAT, COMPLETIONS, "/v1/models", "/v1/models/{model}", "/health", "/metrics"} <= set(paths)
    for path in (CHAT, COMPLETIONS):
        responses = paths[path]["post"]["responses"]
        assert "422" not in responses, "the server answers validation errors with 400"
        assert {"200", "400", "401", "404", "413", "503"} <= set(responses), responses.keys()
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
        ok = responses["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith(("/ChatCompletion", "/Completion"))
        assert "text/event-stream" in ok
    for path, ops in paths.items():
        for op in ops.values():
            for status, response in op["responses"].items():
                for media in response.get("content", {}).values():
                    assert media["schema"] != {}, f"{path} {status}: an empty schema checks nothing"
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "HTTPValidationError" not in document["components"]["schemas"]
    # The document states this server's own limits, so that what it generates is what the server takes.
    request = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert request["model"]["enum"] == [server.model_name] and request["n"]["maximum"] == 4
    assert request["messages"]["maxItems"] == 8
