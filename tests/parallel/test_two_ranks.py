"""Two CPU ranks (gloo) through the real launchers: the split model against `transformers`, and the
engine under tensor, pipeline and expert parallelism against the engine on one rank.

Each launch costs 20-40 s here, so the suite keeps to a few that together cover every layout and both
launchers (`deepspeed --num_gpus 2` and `torchrun`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, build_mtp_checkpoint, build_tiny_chat_checkpoint, run_cli
from tests.engine.conftest import greedy_answer
from tests.serve.conftest import free_port

BIN = Path(sys.executable).parent


def _launcher(launcher: str, ranks: int = 2) -> list[str]:
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()), "--module",
                "unified"]
    return [str(BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(free_port()), "-m", "unified"]


LAUNCH_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{BIN}:{os.environ['PATH']}"}


def launch(launcher: str, *args: str, timeout: float = 600, ranks: int = 2) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run([*_launcher(launcher, ranks), *args], cwd=cwd, capture_output=True, text=True,
                                timeout=timeout, env=LAUNCH_ENV)
        assert not os.listdir(cwd), f"the run cluttered its working directory: {os.listdir(cwd)}"
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def start_server(launcher: str, *args: str):
    """A two-rank server (recipe and model in `args`) on a free port: (its process, base URL, log file)."""
    port, log = free_port(), tempfile.TemporaryFile(mode="w+")
    server = subprocess.Popen([*_launcher(launcher), *args, f"port={port}"], stdout=log, stderr=subprocess.STDOUT,
                              cwd=tempfile.mkdtemp(), env={**LAUNCH_ENV, "UNIFIED_API_KEY": ""},
                              start_new_session=True)  # its own process group: see stop_server
    return server, f"http://127.0.0.1:{port}", log


def stop_server(server: subprocess.Popen) -> None:
    """Whatever of the launch is still running, ranks included: the deepspeed runner leaves its launcher and
    ranks behind when it is terminated."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_until_ready(server: subprocess.Popen, base: str, timeout: float = 300) -> None:
    """Until the launched server's /health answers 200; fails if it exits first or takes longer."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None and time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


@pytest.mark.parametrize("launcher,layout,family", [
    ("deepspeed", "tp2", "deepseek_v3"),  # MLA heads and MoE under tensor parallel
    ("torchrun", "ep2", "qwen3_moe"),  # experts split, tokens exchanged; torchrun sets no LOCAL_SIZE
    ("deepspeed", "pp2", "qwen3"),  # two stages, tied embedding on both ends
])
def test_split_model_matches_transformers(tiny_checkpoint, launcher, layout, family):
    result = launch(launcher, "recipe=check_parity", f"model={tiny_checkpoint(family)}", f"parallel={layout}")
    assert result.stdout.count("PASSED") == 1, result.stdout[-3000:]  # printed once, by rank 0
    assert "layer 2 " in result.stdout  # every stage's layers are in the report


def test_vision_language_model_under_tensor_parallel(tiny_vl_checkpoint):
    # The LM splits by heads, the tower is replicated; image+text logits still match transformers (so TP=1).
    result = launch("deepspeed", "recipe=check_parity", f"model={tiny_vl_checkpoint('qwen2_5_vl')}", "parallel=tp2")
    assert result.stdout.count("PASSED") == 1 and "images (" in result.stdout, result.stdout[-3000:]


def build_tiny_mqa_checkpoint(path: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """One KV head, so tensor parallel 2 replicates it; the built-in tokenizer, so batch inference runs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("qwen3_moe", vocab_size=49152, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  max_position_embeddings=512, initializer_range=0.5)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny_mqa_checkpoint(tmp_path_factory, smollm2_checkpoint):
    return build_tiny_mqa_checkpoint(tmp_path_factory.mktemp("tiny-mqa"), smollm2_checkpoint)


def _batch_logprobs(path: Path) -> dict[str, list]:
    return {r["id"]: r["logprobs"][0] for r in map(json.loads, path.read_text().splitlines())}


def test_engine_agrees_across_layouts(tiny_mqa_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Sample {i}: " + "word " * (3 + 7 * i),
                                           "max_tokens": 12, "logprobs": 2, "ignore_eos": True}) + "\n"
                               for i in range(6)))
    common = (f"model={tiny_mqa_checkpoint}", f"input={prompts}", "engine.num_blocks=64", "engine.block_size=4")
    single = run_cli("recipe=batch", *common, f"output={tmp_path / 'one.jsonl'}")
    assert single.returncode == 0, single.stderr[-3000:]
    reference = _batch_logprobs(tmp_path / "one.jsonl")
    for layout in ("tp2", "pp2", "ep2"):
        out = tmp_path / f"{layout}.jsonl"
        launch("deepspeed", "recipe=batch", *common, f"output={out}", f"parallel={layout}")
        split = _batch_logprobs(out)
        assert split.keys() == reference.keys()
        for request_id, entries in reference.items():
            assert [e["token_id"] for e in split[request_id]] == [e["token_id"] for e in entries], layout
            assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(split[request_id], entries)) < 1e-4, layout


def _speculation_on_two_ranks_keeps_one_ranks_tokens(model: Path, texts: list[str], tmp_path: Path, *spec: str
                                                     ) -> float:
    """Greedy batch answers to `texts` with speculation (`spec` overrides) on two tensor-parallel ranks: drafts
    were verified, and the tokens are those of one rank without speculation. Returns the mean acceptance length."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt": text, "max_tokens": 16, "temperature": 0,
                                           "logprobs": 1, "ignore_eos": True}) + "\n" for i, text in enumerate(texts)))
    common = (f"model={model}", f"input={prompts}", "engine.num_blocks=64", "engine.block_size=4")
    single = run_cli("recipe=batch", *common, f"output={tmp_path / 'one.jsonl'}")
    assert single.returncode == 0, single.stderr[-3000:]
    out = tmp_path / "tp2.jsonl"
    result = launch("deepspeed", "recipe=batch", *common, f"output={out}", "parallel=tp2", *spec)
    drafts = re.search(r"speculative decoding: (\d+) drafts, mean acceptance length ([\d.]+)",
                       result.stdout + result.stderr)
    assert drafts and int(drafts.group(1)) > 0
    reference, split = _batch_logprobs(tmp_path / "one.jsonl"), _batch_logprobs(out)
    for request_id, entries in reference.items():
        assert [e["token_id"] for e in split[request_id]] == [e["token_id"] for e in entries]
    return float(drafts.group(2))


def test_speculative_decoding_under_tensor_parallel_keeps_the_greedy_tokens(tiny_mqa_checkpoint, tmp_path):
    """n-gram drafts verified on two tensor-parallel ranks."""
    _speculation_on_two_ranks_keeps_one_ranks_tokens(
        tiny_mqa_checkpoint, ["one two three four " * (2 + i) for i in range(4)], tmp_path,
        "engine.speculative.method=ngram", "engine.speculative.prompt_lookup_min=1")


def test_a_draft_model_under_tensor_parallel_keeps_the_greedy_tokens(tiny_mqa_checkpoint, tmp_path):
    """A draft model split over the target's two ranks, its engine's steps followed by both; drafting with the
    target's own weights, every draft stands."""
    accepted = _speculation_on_two_ranks_keeps_one_ranks_tokens(
        tiny_mqa_checkpoint, [f"Question {i}: " + "why " * (1 + 2 * i) for i in range(4)], tmp_path,
        "engine.speculative.method=draft", f"engine.speculative.draft_model={tiny_mqa_checkpoint}",
        "engine.speculative.num_tokens=3")
    assert accepted > 3.0


def test_mtp_drafts_under_tensor_parallel_keep_the_greedy_tokens(smollm2_checkpoint, tmp_path):
    """A DeepSeek-V3 with an MTP layer, its drafts made on two tensor-parallel ranks."""
    _speculation_on_two_ranks_keeps_one_ranks_tokens(
        build_mtp_checkpoint(tmp_path / "mtp", tokenizer_from=smollm2_checkpoint),
        [f"Item {i}: " + "alpha beta " * (2 + 3 * i) for i in range(4)], tmp_path,
        "engine.speculative.method=mtp", "engine.speculative.num_tokens=3")


def test_serving_on_two_ranks_reports_collectives_reloads_weights_and_stops_cleanly(
        tiny_mqa_checkpoint, smollm2_checkpoint, tmp_path, runtime):
    import httpx

    other = build_tiny_mqa_checkpoint(tmp_path / "tiny-mqa-seed-1", smollm2_checkpoint, seed=1)
    server, base, log = start_server("torchrun", "recipe=serve", f"model={tiny_mqa_checkpoint}", "parallel=tp2",
                                     "engine.num_blocks=64", "serve.warm_up=false", "serve.allow_weight_reload=true")
    request = {"model": tiny_mqa_checkpoint.name, "prompt": "Hello there", "max_tokens": 6, "ignore_eos": True,
               "temperature": 0}
    try:
        wait_until_ready(server, base)
        answer = httpx.post(base + "/v1/completions", timeout=60, json=request)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert 'unified_collective_seconds_count{kind="tp_all_reduce"}' in metrics

        # Both ranks swap their shard: the split model then answers as the new checkpoint does on one rank.
        reloaded = httpx.post(base + "/v1/admin/reload_weights", json={"path": str(other)}, timeout=120)
        assert reloaded.status_code == 200 and reloaded.json()["weights_version"] == 1, reloaded.text
        expected = greedy_answer(other, request["prompt"], 6)
        assert expected != answer.json()["choices"][0]["text"]
        after = httpx.post(base + "/v1/completions", timeout=60, json=request)
        assert after.json()["choices"][0]["text"] == expected

        server.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank
        server.wait(120)
        log.seek(0)
        output = log.read()
        assert "Application shutdown complete" in output, output[-3000:]
        # torchrun's own agent reports the signal it got; no rank may fail or raise from our code
        assert "exitcode" not in output and str(ROOT / "unified") not in output, output[-3000:]
    finally:
        stop_server(server)


def test_an_external_trainer_updates_a_tensor_parallel_rollout_server(smollm2_checkpoint, tmp_path):
    """recipe=rollout under deepspeed with parallel=tp2: both ranks join the trainer's update group and each
    writes its slice of every tensor the trainer broadcasts (tests/serve/external_trainer.py). Weights drawn
    narrow, so logprobs are of the size a trained model's are and fp32 rounding stays below the 1e-5 asked."""
    checkpoint = build_tiny_chat_checkpoint(tmp_path / "tiny-chat", smollm2_checkpoint, init_std=0.02)
    server, base, log = start_server("deepspeed", "recipe=rollout", f"model={checkpoint}", "parallel=tp2",
                                     "engine.num_blocks=64", "serve.warm_up=false")
    try:
        wait_until_ready(server, base)
        trainer = Path(ROOT, "tests", "serve", "external_trainer.py")
        run = subprocess.run([sys.executable, str(trainer), "--url", base, "--model", str(checkpoint),
                              "--model-name", checkpoint.name, "--mode", "distributed", "--steps", "2",
                              "--server-ranks", "2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        log.seek(0)
        assert run.returncode == 0, run.stdout + run.stderr + log.read()[-4000:]
        steps = [json.loads(line) for line in run.stdout.splitlines()]
        assert len(steps) == 2 and all(s["max_gap"] <= 1e-5 for s in steps), steps
    finally:
        stop_server(server)


def test_activation_aware_int8_runs_under_tensor_parallel(tiny_chat_checkpoint, tmp_path):
    """engine.quantization=int8 on two tensor-parallel ranks: both calibrate on the built-in text (a forward with
    collectives inside it), agree on which linears to smooth (they choose alpha by their summed error), and
    serve. (On random weights int8 may change a greedy token, so the answers are not compared with fp32 here;
    tests/engine/test_quantized_weights.py does that on SmolLM2.)"""
    prompts = tmp_path / "prompts.jsonl"
    texts = ["The capital of France is Paris. The capital of Germany is", "def add(a, b):\n    return"]
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt": text, "max_tokens": 6, "temperature": 0,
                                           "logprobs": 1, "ignore_eos": True}) + "\n" for i, text in enumerate(texts)))
    result = launch("deepspeed", "recipe=batch", f"model={tiny_chat_checkpoint}", f"input={prompts}",
                    f"output={tmp_path / 'int8.jsonl'}", "engine.num_blocks=64", "engine.block_size=4",
                    "parallel=tp2", "engine.quantization=int8")
    smoothed = re.findall(r"activation-aware int8: (\d+) of (\d+) linears smoothed", result.stdout + result.stderr)
    assert len(smoothed) == 2 and smoothed[0] == smoothed[1] and int(smoothed[0][0]) > 0, result.stderr[-3000:]
    answers = _batch_logprobs(tmp_path / "int8.jsonl")
    assert sorted(answers) == ["r0", "r1"] and all(len(entries) == 6 for entries in answers.values())
