"""A server's life on the built-in SmolLM2: two-phase start-up, API keys, a real answer, graceful SIGTERM."""
from __future__ import annotations

import json
import signal
import time

import httpx

from tests.conftest import build_tiny_chat_checkpoint
from tests.serve.conftest import ServerProcess, stream_in_background

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _watch_start_up(server: ServerProcess) -> tuple[list[dict], httpx.Response]:
    """Polls /health until ready; sends one chat request while still starting."""
    reports, early = [], None
    while True:
        health = httpx.get(server.base_url + "/health", timeout=10)
        if health.status_code == 200:
            return reports, early
        assert health.status_code == 503 and health.headers["Retry-After"]
        reports.append(health.json())
        if early is None:
            early = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=10, json={
                "model": server.model_name, "messages": [{"role": "user", "content": "Hi"}]})
        time.sleep(0.05)


def test_start_up_auth_answer_and_graceful_shutdown(smollm2_checkpoint):
    server = ServerProcess(smollm2_checkpoint, "serve.shutdown_timeout_s=60", env={"UNIFIED_API_KEY": KEY})
    try:
        server.wait_listening()
        reports, early = _watch_start_up(server)

        # Phase one and two were visible, with progress; a request meanwhile got 503, not a hang.
        assert reports, "the server was ready before it was ever seen starting"
        assert {r["phase"] for r in reports} <= {"loading_weights", "warming_up"}
        assert any(r["progress"].get("warmup", {}).get("total") for r in reports) or \
            any(r["progress"].get("weights", {}).get("total") for r in reports), reports
        assert early.status_code == 503 and early.headers["Retry-After"], early.text
        assert "starting" in early.json()["error"]["message"]

        chat = {"model": server.model_name, "temperature": 0, "max_tokens": 16,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        url = server.base_url + "/v1/chat/completions"
        assert httpx.post(url, json=chat, timeout=60).status_code == 401
        assert httpx.post(url, json=chat, headers={"Authorization": "Bearer wrong"}, timeout=60).status_code == 401
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200  # probes need no key
        for scheme in ("bearer", "BEARER"):  # the scheme name is case-insensitive
            models = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=10)
            assert models.status_code == 200, models.text
        answer = httpx.post(url, json=chat, headers=AUTH, timeout=60)
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["message"]["content"]

        # SIGTERM while a stream is in flight: the stream finishes, new connections are refused, exit 0.
        events, client = stream_in_background(url, {**chat, "max_tokens": 32, "stream": True, "ignore_eos": True},
                                              AUTH)
        stopped_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        refused = False
        try:
            httpx.get(server.base_url + "/health", timeout=5)
        except httpx.TransportError:
            refused = True
        client.join(120)
        assert server.proc.wait(60) == 0, server.output()
        assert time.monotonic() - stopped_at < 90
        assert refused, "the server still accepted connections after SIGTERM"
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "length"
    finally:
        server.stop()


def test_shutdown_deadline_cancels_what_is_left(tmp_path, smollm2_checkpoint):
    # A long context, so the stream cannot finish within the deadline however fast the engine runs.
    checkpoint = build_tiny_chat_checkpoint(tmp_path / "long", smollm2_checkpoint, max_positions=8192)
    server = ServerProcess(checkpoint, "serve.shutdown_timeout_s=0.5", "serve.warm_up=false")
    try:
        server.wait_ready()
        events, client = stream_in_background(server.base_url + "/v1/completions", {
            "model": server.model_name, "prompt": "Go on", "max_tokens": 4000, "stream": True, "ignore_eos": True})
        server.proc.send_signal(signal.SIGTERM)
        client.join(60)
        assert server.proc.wait(60) == 0, server.output()
        assert events[-1] == "[DONE]", (len(events), events[-3:], server.output()[-3000:])
        assert "shut down" in json.loads(events[-2]).get("error", {}).get("message", ""), (len(events), events[-3:])
    finally:
        server.stop()


def test_a_model_that_cannot_load_ends_the_server_with_a_clear_error(tmp_path):
    from tests.conftest import run_cli
    from tests.serve.conftest import free_port

    result = run_cli("recipe=serve", f"model={tmp_path / 'missing'}", f"port={free_port()}", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "error: the server could not start" in result.stderr and "neither a checkpoint folder nor a built-in model" in result.stderr
    assert "Traceback" not in result.stderr
