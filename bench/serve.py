"""HTTP serving: our OpenAI-compatible server beside `transformers serve`, same model and workload, one run.

    .venv/bin/python bench/serve.py [--model smollm2|<dir>] [--clients 16] [--requests 32] [--max-tokens 64]
                                    [--rounds 2] [--peer both|cb|sequential|none]

Each server runs as a subprocess on a free loopback port (ours: `python -m unified recipe=serve`; the peer:
`transformers serve <dir> --device cpu --dtype float32`, with `--continuous-batching` for `cb`; `--peer both`
runs the two), each with a KV cache of KV_TOKENS tokens. Workload:
`--clients` concurrent streaming clients share `--requests` chat requests with fixed prompts (numbered per
round and request, so no server gains from a prefix cache beyond the chat template), `max_tokens`,
temperature 0 and EOS ignored: ours takes `ignore_eos: true`; the peer rejects unknown fields but takes a
`generation_config` JSON, given `eos_token_id: -1`. Token counts come from each stream's final `usage`.
Per request: TTFT (first content chunk), TPOT ((end-to-end - TTFT) / (tokens - 1)) and end-to-end
latency; per round: output tokens/s. The host is shared and noisy: a matmul is measured before and
after, each server gets one unmeasured warm-up burst, servers alternate round by round (idle ones are
stopped with SIGSTOP), and each figure is the median over rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import httpx
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["the sea", "a lighthouse keeper", "how bread rises", "the history of clocks", "a rainy city",
          "why the sky is blue", "a chess match", "mountain weather"]
KV_TOKENS = 32768  # both servers get this KV cache; left to themselves each sizes it to ~half the host's memory
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def matmul_gflops() -> float:
    a, times = torch.randn(1024, 1024), []
    for _ in range(10):
        start = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - start)
    return 2 * 1024 ** 3 / min(times) / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_model_dir(path: Path, tmp: Path) -> Path:
    """`transformers serve` picks the class from config.json's `architectures`, which our built-in folders
    lack: give it a folder of symlinks with that one field added."""
    config = json.loads((path / "config.json").read_text())
    if config.get("architectures"):
        return path
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    shim = tmp / "peer-model"
    shim.mkdir()
    for f in path.iterdir():
        if f.name != "config.json":
            (shim / f.name).symlink_to(f.resolve())
    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    (shim / "config.json").write_text(json.dumps(config, indent=2))
    return shim


class Server:
    def __init__(self, name: str, command: list[str], ready_path: str, extra_body, port: int, tmp: Path):
        self.name, self.ready_path, self.extra_body = name, ready_path, extra_body
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp / f"{name.split()[0]}-{port}.log"
        self.proc = subprocess.Popen(command, env=ENV, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.model_id = None

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"exited with code {self.proc.returncode}")
                try:
                    if (await client.get(self.url + self.ready_path)).status_code == 200:
                        self.model_id = (await client.get(self.url + "/v1/models")).json()["data"][0]["id"]
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.ready_path} not 200 within {timeout:.0f} s")

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join("    " + l for l in self.log.read_text(errors="replace").splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait()


async def one_request(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int) -> dict:
    body = {"model": server.model_id, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **server.extra_body(max_tokens)}
    start = time.perf_counter()
    first, chunks, usage = None, 0, None
    async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":  # ours sends it; transformers serve just closes the stream
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                first = first or time.perf_counter()
                chunks += 1
            usage = event.get("usage") or usage
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    ttft = (first or end) - start
    return {"ttft": ttft, "e2e": end - start, "tokens": tokens,
            "tpot": (end - start - ttft) / (tokens - 1) if tokens > 1 else float("nan")}


async def workload(server: Server, prompts: list[str], clients: int, max_tokens: int) -> dict:
    queue = list(reversed(prompts))
    results = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10), limits=limits) as client:
        async def worker():
            while queue:
                results.append(await one_request(client, server, queue.pop(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        seconds = time.perf_counter() - start
    return {"tok/s": sum(r["tokens"] for r in results) / seconds, "requests": results,
            "short": sum(r["tokens"] < max_tokens for r in results)}


def percentiles(values: list[float]) -> tuple[float, float, float]:
    values = [v for v in values if v == v]  # drop NaN (one-token requests have no TPOT)
    if len(values) < 2:
        return (values[0] if values else float("nan"),) * 3
    q = statistics.quantiles(values, n=100, method="inclusive")  # linear interpolation, as numpy's default
    return q[49], q[89], q[98]


def start_servers(args, path: Path, tmp: Path) -> list[Server]:
    servers = []
    if not args.skip_ours:
        port = free_port()
        servers.append(Server("unified", [sys.executable, "-m", "unified", "recipe=serve", "host=127.0.0.1",
                                          f"port={port}", f"model={path}", f"engine.num_blocks={KV_TOKENS // 16}"],
                              "/health", lambda n: {"ignore_eos": True}, port, tmp))
    modes = {"cb": ["cb"], "sequential": ["sequential"], "both": ["cb", "sequential"], "none": []}[args.peer]
    if modes:
        from transformers.utils.import_utils import is_serve_available

        if not is_serve_available():
            print("transformers serve: cannot run, its extras are missing (pip install 'transformers[serving]')")
            modes = []
    cli = Path(sys.executable).parent / "transformers"
    peer_body = lambda n: {"generation_config": json.dumps({"max_new_tokens": n, "do_sample": False,
                                                             "eos_token_id": -1})}
    peer_dir = peer_model_dir(path, tmp) if modes else None
    for mode in modes:
        port = free_port()
        command = [str(cli), "serve", str(peer_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                   "--dtype", "float32"]
        if mode == "cb":  # its KV pages hold 256 tokens
            command += ["--continuous-batching", "--cb-num-blocks", str(KV_TOKENS // 256)]
        name = "transformers serve" + (" --continuous-batching" if mode == "cb" else "")
        servers.append(Server(name, command, "/v1/models", peer_body, port, tmp))
    return servers


async def bring_up(servers: list[Server], args) -> list[Server]:
    """Waits for each server, warms it up (one unmeasured burst of short requests), then stops it."""
    up = []
    for server in servers:
        try:
            await server.wait_ready(args.start_timeout)
            await workload(server, [f"Warm-up {i}: say hello." for i in range(args.clients)], args.clients, 8)
            up.append(server)
        except Exception as error:  # noqa: BLE001 - report why, then go on with the other servers
            print(f"{server.name}: could not run ({error}); last lines of its log {server.log}:\n"
                  f"{server.log_tail()}", flush=True)
            server.stop()
        server.pause()
    return up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2", help="a built-in name or an HF folder")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peer", choices=["cb", "sequential", "both", "none"], default="both")
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--start-timeout", type=float, default=300)
    args = parser.parse_args()

    gflops_before = matmul_gflops()
    if Path(args.model).is_dir():
        path = Path(args.model).resolve()
    else:
        from unified.checkpoint.builtin import resolve_model

        path = Path(resolve_model(args.model))
    servers: list[Server] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the servers
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        try:
            servers = start_servers(args, path, Path(tmp))
            up = asyncio.run(bring_up(servers, args))
            rounds = {s.name: [] for s in up}
            for r in range(args.rounds):
                prompts = [f"[{r}.{i}] Write a short story about {TOPICS[i % len(TOPICS)]}."
                           for i in range(args.requests)]
                for server in list(up):
                    server.resume()
                    try:
                        run = asyncio.run(workload(server, prompts, args.clients, args.max_tokens))
                    except Exception as error:  # noqa: BLE001 - report it, go on with the others
                        print(f"{server.name} failed in round {r + 1} ({error}); its log:\n{server.log_tail()}")
                        up.remove(server)
                        continue
                    finally:
                        server.pause()
                    rounds[server.name].append(run)
                    print(f"round {r + 1}: {server.name}: {run['tok/s']:.1f} output tok/s", flush=True)
        finally:
            for server in servers:
                server.stop()
    report(args, path, {name: runs for name, runs in rounds.items() if runs}, gflops_before, matmul_gflops())


def report(args, path: Path, rounds: dict, gflops_before: float, gflops_after: float) -> None:
    print(f"\nmodel {path.name}: {args.clients} streaming clients, {args.requests} chat requests/round, "
          f"max_tokens {args.max_tokens}, temperature 0, EOS ignored, fp32, CPU; medians of {args.rounds} rounds")
    print(f"host: matmul {gflops_before:.0f} GFLOP/s before, {gflops_after:.0f} after")
    header = f"{'server':<42}{'out tok/s':>10}" + "".join(f"{m + ' p50/p90/p99':>26}" for m in
                                                         ("TTFT ms", "TPOT ms", "E2E s"))
    print(header + "\n" + "-" * len(header))
    for name, runs in rounds.items():
        cells = []
        for metric, scale, fmt in (("ttft", 1e3, ".0f"), ("tpot", 1e3, ".0f"), ("e2e", 1, ".1f")):
            per_round = [percentiles([q[metric] * scale for q in run["requests"]]) for run in runs]
            cells.append(" / ".join(format(statistics.median(p[k] for p in per_round), fmt) for k in range(3)))
        throughput = statistics.median(run["tok/s"] for run in runs)
        print(f"{name:<42}{throughput:>10.1f}" + "".join(f"{c:>26}" for c in cells)
              + f"   (rounds: {', '.join(format(run['tok/s'], '.1f') for run in runs)})")
        short = sum(run["short"] for run in runs)
        if short:
            print(f"    {short} requests ended before max_tokens: that server did not ignore EOS")
    if "unified" in rounds:
        for peer in list(rounds)[1:]:
            pairs = [a["tok/s"] / b["tok/s"] for a, b in zip(rounds["unified"], rounds[peer])]
            print(f"unified / {peer}, output tok/s, paired rounds: {', '.join(f'{p:.2f}' for p in pairs)}; "
                  f"median {statistics.median(pairs):.2f}")


if __name__ == "__main__":
    main()
