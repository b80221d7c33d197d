"""Learning from served traffic, the serving half: the conversation log, feedback, and weights swapped live.

One server (conversation log on, reloads allowed, an API key) serves every case here, in file order.
"""
from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from tests.conftest import build_tiny_chat_checkpoint
from tests.engine.conftest import greedy_answer
from tests.serve.conftest import TINY_SERVER_OPTIONS, ServerProcess, ready, stream_in_background
from unified.conversations import read_conversations

KEY = "online-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Say something about the weather."}]
GREEDY = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_checkpoint):
    """Same architecture as the tiny chat model with other weights, and one with another hidden size."""
    return {"new": build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat-seed-1"), smollm2_checkpoint, seed=1),
            "narrow": build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat-narrow"), smollm2_checkpoint,
                                                 hidden_size=32)}


@pytest.fixture(scope="module")
def online(tiny_chat_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("online") / "conversations.jsonl"
    options = [o for o in TINY_SERVER_OPTIONS if not o.startswith("serve.max_tokens=")]
    process = ServerProcess(tiny_chat_checkpoint, *options, "serve.max_tokens=900", "serve.warm_up=false",
                            f"serve.conversation_log={log}", "serve.allow_weight_reload=true",
                            env={"UNIFIED_API_KEY": KEY})
    process.conversation_log = log
    with ready(process):
        yield process


@pytest.fixture(scope="module")
def client(online):
    return OpenAI(base_url=online.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _feedback(server: ServerProcess, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/feedback", json=body, headers=headers, timeout=30)


def _reload(server: ServerProcess, path, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/admin/reload_weights", json={"path": str(path)}, headers=headers,
                      timeout=120)


def _version(server: ServerProcess) -> int:
    return httpx.get(server.base_url + "/health", timeout=10).json()["weights_version"]


def test_chats_are_logged_and_feedback_is_merged(online, client):
    version = _version(online)
    whole = client.chat.completions.create(model=online.model_name, messages=MESSAGES, n=2, seed=5, max_tokens=8)
    chunks = list(client.chat.completions.create(model=online.model_name, messages=MESSAGES, stream=True, **GREEDY))
    streamed_id, streamed = chunks[0].id, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    accepted = _feedback(online, {"id": whole.id, "accepted": True})
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["accepted"] is True and accepted.json()["id"] == whole.id
    assert _feedback(online, {"id": streamed_id, "accepted": False, "comment": "too vague"}).status_code == 200

    logged = {r["id"]: r for r in read_conversations(online.conversation_log)}
    record = logged[whole.id]
    assert record["messages"] == MESSAGES and record["model"] == online.model_name
    assert record["weights_version"] == version and record["created"] == whole.created
    assert [c["message"]["content"] for c in record["choices"]] == [c.message.content for c in whole.choices]
    assert [c["finish_reason"] for c in record["choices"]] == [c.finish_reason for c in whole.choices]
    assert record["feedback"]["accepted"] is True and record["feedback"]["comment"] is None
    assert logged[streamed_id]["choices"] == [{"index": 0, "message": {"role": "assistant", "content": streamed},
                                               "finish_reason": "length"}]
    assert logged[streamed_id]["feedback"]["accepted"] is False
    assert logged[streamed_id]["feedback"]["comment"] == "too vague"


@pytest.mark.parametrize("body, status, words", [
    ({"id": "chatcmpl-unknown", "accepted": True}, 404, "no logged chat completion has the id 'chatcmpl-unknown'"),
    ({"id": "chatcmpl-x", "accepted": "yes"}, 400, "accepted"),
    ({"id": 7, "accepted": True}, 400, "id"),
    ({"accepted": True}, 400, "id"),
    ({"id": "chatcmpl-x", "accepted": True, "score": 5}, 400, "unknown field 'score'"),
])
def test_bad_feedback_is_refused(online, body, status, words):
    response = _feedback(online, body)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_feedback_and_reload_need_the_api_key(online, checkpoints):
    assert _feedback(online, {"id": "chatcmpl-x", "accepted": True}, headers=None).status_code == 401
    assert _reload(online, checkpoints["new"], headers=None).status_code == 401


def test_both_are_refused_with_how_to_enable_where_off(server, checkpoints):
    feedback = _feedback(server, {"id": "chatcmpl-x", "accepted": True}, headers=None)
    assert feedback.status_code == 409 and "serve.conversation_log=" in feedback.json()["error"]["message"]
    reload = _reload(server, checkpoints["new"], headers=None)
    assert reload.status_code == 403 and "serve.allow_weight_reload=true" in reload.json()["error"]["message"]


def _reference_answer(path) -> str:
    """What the engine answers offline, in this process, on the weights at `path`."""
    from transformers import AutoTokenizer

    from unified.chat import chat_prompt

    return greedy_answer(path, chat_prompt(AutoTokenizer.from_pretrained(path), MESSAGES), GREEDY["max_tokens"])


def test_reload_swaps_weights_under_load_and_flushes_the_prefix_cache(online, client, checkpoints, runtime,
                                                                       tiny_chat_checkpoint):
    """`runtime`: the reference engine runs in this process."""
    def chat():
        response = client.chat.completions.create(model=online.model_name, messages=MESSAGES, **GREEDY)
        return response.choices[0].message.content, response.usage.prompt_tokens_details.cached_tokens

    old, _ = chat()
    again, cached = chat()
    assert again == old and cached > 0  # the prompt's blocks are cached
    expected = _reference_answer(checkpoints["new"])
    assert expected != old, "both checkpoints answer alike; the test could not tell them apart"

    events, stream = stream_in_background(online.base_url + "/v1/chat/completions", {
        "model": online.model_name, "messages": [{"role": "user", "content": "Go on."}], "stream": True,
        "max_tokens": 900, "ignore_eos": True}, AUTH)
    reloaded = _reload(online, checkpoints["new"])
    seen_at_reload = len(events)
    assert reloaded.status_code == 200, reloaded.text
    assert reloaded.json() == {"object": "weights", "reloaded": str(checkpoints["new"]), "weights_version": 1}
    assert _version(online) == 1 and online.metric("unified_weights_version") == 1

    assert chat() == (expected, 0)  # new weights, and no block computed with the old ones
    new, cached = chat()
    assert new == expected and cached > 0  # blocks of the new weights are cached again

    stream.join(120)
    assert len(events) > seen_at_reload + 1, "the stream ended before the reload; it did not test concurrency"
    assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"

    mismatch = _reload(online, checkpoints["narrow"])
    assert mismatch.status_code == 400, mismatch.text
    assert "hidden_size is 32, served 64" in mismatch.json()["error"]["message"]
    assert "still serving weights version 1" in mismatch.json()["error"]["message"]
    missing = _reload(online, checkpoints["new"] / "missing")
    assert missing.status_code == 400 and "config.json" in missing.json()["error"]["message"]
    assert chat()[0] == expected and _version(online) == 1

    back = _reload(online, tiny_chat_checkpoint)  # and back: exactly what the server answered at start
    assert back.status_code == 200 and back.json()["weights_version"] == 2
    assert chat() == (old, 0)
    logged = [r for r in read_conversations(online.conversation_log) if r["messages"] == MESSAGES]
    assert [r["weights_version"] for r in logged[-4:]] == [1, 1, 1, 2]
