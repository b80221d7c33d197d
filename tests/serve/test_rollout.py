"""`recipe=rollout` driven by an external trainer that knows nothing of unified (tests/serve/external_trainer.py):
SGLang's weight-sync endpoints, token ids in and out, and clear refusals of bad protocol use."""
from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import build_tiny_chat_checkpoint
from tests.serve.conftest import TINY_SERVER_OPTIONS, ServerProcess, free_port, ready

TRAINER = Path(__file__).with_name("external_trainer.py")
PROMPT = [5, 17, 42, 8, 99, 23, 61, 7]


@pytest.fixture(scope="module")
def narrow_chat(tmp_path_factory, smollm2_checkpoint):
    """Weights drawn narrow: logprobs of the size a trained model's are, so fp32 rounding stays under 1e-5."""
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat-narrow"), smollm2_checkpoint, init_std=0.02)


@pytest.fixture(scope="module")
def rollout(narrow_chat):
    with ready(ServerProcess(narrow_chat, *TINY_SERVER_OPTIONS, "serve.weight_update_timeout_s=5",
                             env={"UNIFIED_API_KEY": ""}, recipe="rollout")) as server:
        yield server


def _greedy(server, headers: dict | None = None) -> dict:
    answer = httpx.post(server.base_url + "/v1/completions", json={
        "model": server.model_name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout=60, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("mode", ["distributed", "disk"])
def test_an_external_trainer_updates_the_served_policy(rollout, narrow_chat, tmp_path, mode):
    run = subprocess.run([sys.executable, str(TRAINER), "--url", rollout.base_url, "--model",
                          str(narrow_chat), "--model-name", rollout.model_name, "--mode", mode,
                          "--steps", "2", "--scratch", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr + rollout.output()[-3000:]
    steps = [json.loads(line) for line in run.stdout.splitlines()]
    assert [s["weight_version"] for s in steps] == ["policy-1", "policy-2"]
    assert all(s["max_gap"] <= 1e-5 for s in steps), steps
    assert httpx.get(rollout.base_url + "/get_weight_version").json() == {"weight_version": "policy-2"}
    answer = _greedy(rollout)
    assert answer["prompt_token_ids"] == PROMPT and len(answer["choices"][0]["token_ids"]) == 4
    models = httpx.get(rollout.base_url + "/v1/models")
    assert models.json()["data"][0]["weight_version"] == "policy-2"
    assert models.headers["x-weight-version"] == "policy-2"
    assert rollout.metric("unified_weight_updates_total") >= 2


def test_bad_protocol_use_is_refused_and_the_weights_stay(rollout, narrow_chat):
    before = _greedy(rollout)["choices"][0]["logprobs"]["token_logprobs"]
    url = rollout.base_url
    q = "model.layers.0.self_attn.q_proj.weight"
    refused = httpx.post(url + "/update_weights_from_distributed",
                         json={"names": [q], "dtypes": ["float32"], "shapes": [[64, 64]], "group_name": "nope"})
    assert refused.status_code == 400 and not refused.json()["success"]
    assert "no weight update group named 'nope'" in refused.json()["message"]
    bad = httpx.post(url + "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
        "backend": "mpi"})
    assert bad.status_code == 400 and "gloo on CPU" in bad.json()["message"]
    assert httpx.post(url + "/destroy_weights_update_group", json={}).status_code == 400

    group = _join(url)  # a trainer that declares a wrong shape, then one that never sends
    twice = httpx.post(url + "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
        "backend": "gloo"})
    assert twice.status_code == 400 and "exists already" in twice.json()["message"]  # and the group still works:
    thread, result = _post_in_background(url + "/update_weights_from_distributed", {
        "names": [q, "model.layers.0.mlp.nonsense.weight"], "dtypes": ["float32", "float32"],
        "shapes": [[64, 65], [3]]})
    for shape in ([64, 65], [3]):  # the server still takes every declared tensor, so this does not hang
        torch.distributed.broadcast(torch.zeros(shape), group_src=0, group=group)
    thread.join()
    status, body = result[0]
    assert status == 400 and "received and dropped" in body["message"], body
    assert "shape [64, 65], but the model's is [64, 64]" in body["message"]
    assert "has no tensor 'model.layers.0.mlp.nonsense.weight'" in body["message"]
    silent = httpx.post(url + "/update_weights_from_distributed",
                        json={"names": [q], "dtypes": ["float32"], "shapes": [[64, 64]]}, timeout=60)
    assert silent.status_code == 400 and "stopped sending" in silent.json()["message"], silent.text
    assert "no weight update group" in httpx.post(url + "/destroy_weights_update_group", json={}).json()["message"]
    torch.distributed.destroy_process_group(group)
    # sizes the server cannot know: nothing is received, the group goes, the trainer is told
    for body, reason in (({"names": [q], "dtypes": ["fp33"], "shapes": [[64, 64]]}, "dtype 'fp33' is not a torch"),
                         ({"names": [q, q], "dtypes": ["fp32"], "shapes": [[64, 64]]}, "lists of one length")):
        group = _join(url)
        unknown = httpx.post(url + "/update_weights_from_distributed", json=body, timeout=60)
        assert unknown.status_code == 400 and reason in unknown.json()["message"], unknown.text
        assert "nothing was received" in unknown.json()["message"]
        torch.distributed.destroy_process_group(group)
    group = _join(url)  # a tied head is taken and said to be ignored
    shape = [json.loads((narrow_chat / "config.json").read_text())[k] for k in ("vocab_size", "hidden_size")]
    thread, result = _post_in_background(url + "/update_weights_from_distributed",
                                         {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [shape]})
    torch.distributed.broadcast(torch.zeros(shape), group_src=0, group=group)
    thread.join()
    assert result[0][0] == 200 and "lm_head.weight ignored" in result[0][1]["message"], result
    torch.distributed.destroy_process_group(group)
    assert _greedy(rollout)["choices"][0]["logprobs"]["token_logprobs"] == before
    assert httpx.post(url + "/reset_prefix_cache").json()["success"]


def test_token_ids_come_back_on_chat_too_and_not_with_a_stream(rollout):
    chat = httpx.post(rollout.base_url + "/v1/chat/completions", json={
        "model": rollout.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "return_token_ids": True}, timeout=60).json()
    assert chat["prompt_token_ids"] == chat["choices"][0]["prompt_token_ids"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    streamed = httpx.post(rollout.base_url + "/v1/completions", json={
        "model": rollout.model_name, "prompt": PROMPT, "stream": True, "return_token_ids": True})
    assert streamed.status_code == 400 and "stream: false" in streamed.text


def test_prompt_logprobs_score_every_prompt_token(rollout):
    url, name = rollout.base_url, rollout.model_name
    choice = httpx.post(url + "/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 2,
                                                      "prompt_logprobs": 2}, timeout=60).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(PROMPT)
    for token, entry in zip(PROMPT[1:], scored[1:]):
        mine = entry[str(token)]
        assert mine["logprob"] <= 0 and mine["rank"] >= 1 and mine["decoded_token"]
        ranked = sorted((e for t, e in entry.items() if t != str(token) or e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked][:2] == [1, 2]
    chat = httpx.post(url + "/v1/chat/completions", json={
        "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2,
        "prompt_logprobs": 0}, timeout=60).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all("prompt_logprobs" not in c for c in chat["choices"])


def _post_in_background(url: str, body: dict, headers: dict | None = None) -> tuple[threading.Thread, list]:
    result: list = []

    def send():
        answer = httpx.post(url, json=body, timeout=120, headers=headers)
        result.append((answer.status_code, answer.json()))

    thread = threading.Thread(target=send)
    thread.start()
    return thread, result


def _join(url: str):
    """This test process as the trainer's rank 0 of a two-member update group (the server is rank 1)."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    port, name = free_port(), "weight_update_group"
    thread, result = _post_in_background(url + "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"})
    timeout = datetime.timedelta(seconds=30)
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
    group, _ = _new_process_group_helper(2, 0, [], "gloo", PrefixStore(name, store), group_name=name, timeout=timeout)
    _world.pg_group_ranks[group] = {0: 0, 1: 1}  # group ranks are this group's own
    thread.join()
    assert result[0][0] == 200, result
    return group


def _resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


def test_sleep_gives_the_kv_cache_back_and_waking_serves_alike(tiny_chat_checkpoint):
    options = [o for o in TINY_SERVER_OPTIONS if not o.startswith(("engine.num_blocks", "serve.max_body_bytes"))]
    with ready(ServerProcess(tiny_chat_checkpoint, *options, "engine.num_blocks=2048", "engine.prefix_caching=false",
                             env={"UNIFIED_API_KEY": ""}, recipe="rollout")) as server:
        url, original = server.base_url, _greedy(server)["choices"][0]
        g = torch.Generator().manual_seed(0)
        fill = [torch.randint(100, 40000, (1000,), generator=g).tolist() for _ in range(32)]  # 32 x 64 blocks
        answer = httpx.post(url + "/v1/completions", json={"model": server.model_name, "prompt": fill,
                                                           "max_tokens": 24, "ignore_eos": True}, timeout=300)
        assert answer.status_code == 200, answer.text
        awake = _resident_bytes(server.proc.pid)
        asleep = httpx.post(url + "/sleep?level=1", timeout=60).json()
        assert "freed" in asleep, asleep
        freed = asleep["freed"]["kv_cache_bytes"]
        assert asleep["success"] and freed == 2048 * 16 * 512  # blocks x tokens x bytes per token
        dropped = awake - _resident_bytes(server.proc.pid)
        assert dropped >= 0.8 * freed, f"resident memory fell by {dropped} bytes of a {freed}-byte KV cache"
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
        assert httpx.get(url + "/health").json()["sleeping"] is True
        assert httpx.post(url + "/sleep?level=2").status_code == 409  # deeper needs a wake-up first
        refused = httpx.post(url + "/v1/completions", json={"model": server.model_name, "prompt": PROMPT})
        assert refused.status_code == 503 and "POST /wake_up" in refused.text
        assert httpx.post(url + "/wake_up").json()["success"]
        assert _greedy(server)["choices"][0] == original

        assert "weight_bytes" in httpx.post(url + "/sleep?level=2").json()["freed"]
        assert "already asleep at level 2" in httpx.post(url + "/sleep?level=2").json()["message"]
        refused = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(tiny_chat_checkpoint)})
        assert refused.status_code == 400 and "wake the engine up first" in refused.json()["message"]
        norm = ["model.norm.weight"], ["float32"], [[json.loads((tiny_chat_checkpoint / "config.json").read_text())
                                                    ["hidden_size"]]]
        group = _join(url)  # asleep: the update is taken in full (the trainer does not hang), then refused
        thread, result = _post_in_background(url + "/update_weights_from_distributed",
                                             dict(zip(("names", "dtypes", "shapes"), norm)))
        torch.distributed.broadcast(torch.ones(norm[2][0]), group_src=0, group=group)
        thread.join()
        assert result[0][0] == 400 and "wake the engine up first" in result[0][1]["message"], result
        assert "send the weights" in httpx.post(url + "/wake_up").json()["message"]
        thread, result = _post_in_background(url + "/update_weights_from_distributed",  # one tensor of many
                                             dict(zip(("names", "dtypes", "shapes"), norm)))
        torch.distributed.broadcast(torch.ones(norm[2][0]), group_src=0, group=group)
        thread.join()
        assert result[0][0] == 200, result
        torch.distributed.destroy_process_group(group)
        refused = httpx.post(url + "/v1/completions", json={"model": server.model_name, "prompt": PROMPT})
        assert refused.status_code == 503 and "no weights" in refused.text
        restored = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(tiny_chat_checkpoint)},
                              timeout=60)
        assert restored.json()["success"], restored.text
        assert _greedy(server)["choices"][0] == original
        assert httpx.post(url + "/sleep?level=3").status_code == 400
        assert server.metric("unified_asleep_seconds_total") > 0


def test_sleep_lets_requests_in_flight_run_out_their_time_then_ends_them(tiny_chat_checkpoint):
    """Under an API key, which the rollout endpoints ask for as /v1/* does."""
    with ready(ServerProcess(tiny_chat_checkpoint, *TINY_SERVER_OPTIONS, "serve.shutdown_timeout_s=0.3",
                             env={"UNIFIED_API_KEY": "secret"}, recipe="rollout")) as server:
        url, key = server.base_url, {"Authorization": "Bearer secret"}
        busy = {"model": server.model_name, "prompt": [PROMPT] * 64, "n": 4, "max_tokens": 64, "ignore_eos": True}
        thread, result = _post_in_background(url + "/v1/completions", busy, key)
        while not result and server.metric("unified_num_requests_running") == 0:
            time.sleep(0.02)  # until the engine runs it
        assert httpx.post(url + "/sleep").status_code == 401
        sleeper, asleep = _post_in_background(url + "/sleep", {}, key)
        while not httpx.get(url + "/is_sleeping", headers=key).json()["is_sleeping"]:
            time.sleep(0.02)
        woken = httpx.post(url + "/wake_up", headers=key, timeout=60).json()  # while /sleep waits: comes after it
        sleeper.join()
        thread.join()
        assert asleep[0][1]["success"] and woken["message"] == "awake", (asleep, woken)
        status, answer = result[0]
        assert status == 503 and "went to sleep" in answer["error"]["message"], answer
        assert httpx.get(url + "/is_sleeping", headers=key).json() == {"is_sleeping": False}
        assert _greedy(server, key)["choices"][0]["finish_reason"] == "length"
