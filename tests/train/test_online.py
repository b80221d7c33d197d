"""The online-learning loop end to end: serve with the conversation log on, users accept sampled replies,
`recipe=online` fine-tunes on them, gates the candidate and hot-swaps it into the running server, which
then answers the accepted way, while a client chatting all along sees no error. A failing gate swaps
nothing and says why."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
from openai import OpenAI

from tests.conftest import run_cli
from tests.serve.conftest import TINY_SERVER_OPTIONS, ServerProcess

KEY = "online-key"
PROMPTS = ["Name a fruit.", "Name a color.", "Name an animal.", "Name a city."]
UNRATED = ["Say hello.", "Count to three.", "What is the time?"]
TRAIN = ("steps=40", "train.lr=1e-2", "train.warmup_steps=2", "train.seq_len=128", "train.micro_batch_size=4",
         "train.wandb=disabled", "online.min_parity_cosine=0.5")


@pytest.fixture(scope="module")
def served(tiny_chat_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("online") / "conversations.jsonl"
    process = ServerProcess(tiny_chat_checkpoint, *TINY_SERVER_OPTIONS, "serve.warm_up=false",
                            f"serve.conversation_log={log}", "serve.allow_weight_reload=true",
                            env={"UNIFIED_API_KEY": KEY})
    try:
        process.wait_ready()
        process.conversation_log = log
        process.client = OpenAI(base_url=process.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        yield process
    finally:
        assert process.stop() == 0, process.output()


def _chat(server, prompt: str, **options) -> tuple[str, str]:
    reply = server.client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": prompt}],
                                                  **{"max_tokens": 16, "temperature": 0, **options})
    return reply.id, reply.choices[0].message.content


def _weights_version(server) -> int:
    return httpx.get(server.base_url + "/health", timeout=10).json()["weights_version"]


def _feedback(server, response_id: str, accepted: bool) -> None:
    response = httpx.post(server.base_url + "/v1/feedback", json={"id": response_id, "accepted": accepted},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 200, response.text


def _online(server, model, output, *options: str):
    import os

    os.environ["UNIFIED_API_KEY"] = KEY  # the recipe reads the server's key from the same variable
    try:
        return run_cli("recipe=online", f"model={model}", f"data={server.conversation_log}", f"output={output}",
                       f"online.server={server.base_url}", *TRAIN, *options)
    finally:
        del os.environ["UNIFIED_API_KEY"]


def test_a_failing_gate_keeps_the_served_weights(served, tiny_chat_checkpoint, tmp_path):
    response_id, _ = _chat(served, "Name a planet.", temperature=1.0, seed=99, max_tokens=6)
    _feedback(served, response_id, accepted=True)
    _chat(served, UNRATED[0])
    result = _online(served, tiny_chat_checkpoint, tmp_path / "out", "online.min_improvement=1000")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "gate failed, the served weights stay as they are" in result.stdout
    assert "too little improvement" in result.stdout and "online.min_improvement=1000" in result.stdout
    assert (tmp_path / "out" / "gate.json").is_file()
    assert _weights_version(served) == 0


def test_served_model_learns_accepted_replies_while_a_client_chats(served, tiny_chat_checkpoint, tmp_path):
    accepted = {}
    seeds = iter(range(100))
    for prompt in PROMPTS:  # explore: sampled replies, which the user accepts
        # one that starts unlike every reply accepted so far: after a shared first token the tiny model can
        # hardly tell the prompts apart, and learns one continuation for both
        response_id, reply = _chat(served, prompt, temperature=1.0, seed=next(seeds), max_tokens=6)
        while reply.strip()[:4] in [r.strip()[:4] for r in accepted.values()]:
            response_id, reply = _chat(served, prompt, temperature=1.0, seed=next(seeds), max_tokens=6)
        _feedback(served, response_id, accepted=True)
        accepted[prompt] = reply
    rejected_id, _ = _chat(served, "Name a song.", temperature=1.0, seed=7, max_tokens=6)
    _feedback(served, rejected_id, accepted=False)
    for prompt in UNRATED:  # untouched traffic: the gate's held-back set
        _chat(served, prompt)
    before = {p: _chat(served, p)[1] for p in PROMPTS}
    assert before != accepted

    errors, answered, stop = [], [0], threading.Event()

    def keep_chatting() -> None:
        while not stop.is_set():
            try:
                with httpx.stream("POST", served.base_url + "/v1/chat/completions", timeout=60,
                                  headers={"Authorization": f"Bearer {KEY}"},
                                  json={"model": served.model_name, "stream": True, "max_tokens": 16,
                                        "messages": [{"role": "user", "content": "Tell me a story."}]}) as response:
                    events = [line for line in response.iter_lines() if line.startswith("data: ")]
                if response.status_code != 200 or events[-1] != "data: [DONE]" or '"error"' in "".join(events):
                    errors.append((response.status_code, events[-3:]))
                answered[0] += 1
            except httpx.HTTPError as err:
                errors.append(repr(err))

    client = threading.Thread(target=keep_chatting)
    client.start()
    try:
        result = _online(served, tiny_chat_checkpoint, tmp_path / "out")
    finally:
        stop.set()
        client.join()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "gate passed; the server now serves weights version 1" in result.stdout
    assert (tmp_path / "out" / "candidate" / "adapter" / "adapter_config.json").is_file()
    assert _weights_version(served) == 1
    assert not errors and answered[0] > 0
    assert {p: _chat(served, p)[1] for p in PROMPTS} == accepted


def test_logged_conversations_with_images_are_left_out(tmp_path):
    from unified.conversations import conversation_record
    from unified.train.online import split_log

    class Output:
        index, text, finish_reason = 0, "a reply", "stop"

    image = [{"type": "image", "sha256": "ab" * 32, "bytes": 123}, {"type": "text", "text": "what is this?"}]
    records = [conversation_record("a", 0, "m", 0, [{"role": "user", "content": "hello"}], [Output()]),
               conversation_record("b", 0, "m", 0, [{"role": "user", "content": image}], [Output()]),
               conversation_record("c", 0, "m", 0, [{"role": "user", "content": "hi"}], [Output()])]
    feedback = [{"feedback_for": rid, "accepted": True, "comment": None, "created": 1} for rid in ("a", "b")]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records + feedback))
    accepted, unrated = split_log(log)
    assert [c[0]["content"] for c in accepted] == ["hello"] and [c[0]["content"] for c in unrated] == ["hi"]


def test_foreign_log_records_are_read_or_left_out_not_fatal(tmp_path, tiny_chat_checkpoint):
    """A record without a feedback key is unrated; a conversation the template cannot place replies in is named
    and left out (before training, so the gate sees the same sets)."""
    from transformers import AutoTokenizer

    from unified.train.online import _usable, split_log

    record = {"id": "x", "created": 0, "model": "m", "weights_version": 0,
              "messages": [{"role": "user", "content": "hello"}],
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(record) + "\n")
    accepted, unrated = split_log(log)
    assert not accepted and len(unrated) == 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_checkpoint)
    starts_with_reply = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "so?"},
                         {"role": "assistant", "content": "yes"}]
    assert _usable(tokenizer, [unrated[0], starts_with_reply], "held-back") == [unrated[0]]
