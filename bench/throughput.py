"""Offline throughput, batch-1 decode and prefix-cache TTFT: our engine beside its peers, one run.

    .venv/bin/python bench/throughput.py [--model llama-bench|smollm2] [--rounds 3] [--skip-transformers]

Workload (greedy, EOS ignored, fp32, CPU): 64 requests of 128 random prompt tokens, 128 new tokens each.
Peers: vLLM's CPU build (bench/setup_peers.sh makes its venv; run in a worker process so the engines
alternate), `transformers` generate with static batches of 16 and 64 (left padding, sdpa) and its
continuous-batching `generate_batch`. The host is shared and noisy: a matmul is measured before and
after, each engine gets one short unmeasured warm-up run, engines then alternate round by round, and
medians are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
HERE = Path(__file__).resolve().parent
NUM_REQUESTS, PROMPT_LEN, NEW_TOKENS = 64, 128, 128


def matmul_gflops() -> float:
    a = torch.randn(1024, 1024)
    best = min(_timed(lambda: a @ a) for _ in range(10))
    return 2 * 1024 ** 3 / best / 1e9


def read_bandwidth() -> float:
    """Bytes/s of the best of 5 `torch.sum` over a 1 GiB fp32 tensor."""
    x = torch.ones(2 ** 28)
    return x.numel() * 4 / min(_timed(lambda: x.sum()) for _ in range(5))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_model(name: str) -> Path:
    if name != "llama-bench":
        from unified.checkpoint.builtin import resolve_model

        return resolve_model(name)
    from transformers import LlamaConfig, LlamaForCausalLM

    from unified.checkpoint.builtin import cache_dir

    path = cache_dir() / "bench" / "llama-bench"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                             intermediate_size=1408, vocab_size=32000, max_position_embeddings=2048)
        LlamaForCausalLM(config).save_pretrained(path)
    return path


class Ours:
    def __init__(self, path: Path):
        from unified.checkpoint import load_model
        from unified.config.schema import EngineConfig
        from unified.engine.llm_engine import LLMEngine

        self.loaded = load_model(path)
        self.engine = LLMEngine(self.loaded.model, None, EngineConfig(num_blocks=2048), torch.device("cpu"),
                                torch.float32, None)

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        from unified.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        for prompt in prompts:
            self.engine.add_request(prompt, params)
        tokens = 0
        while self.engine.has_unfinished():
            tokens += sum(len(o.outputs[0].token_ids) for o in self.engine.step())
        return {"seconds": time.perf_counter() - start, "output_tokens": tokens}

    def weight_bytes_per_step(self) -> int:
        model = self.loaded.model
        embedding = model.embed.weight.numel() if model.lm_head is not None else 0
        return sum(p.numel() * p.element_size() for p in model.parameters()) - embedding * model.embed.weight.element_size()


class VLLM:
    def __init__(self, path: Path):
        python = HERE / ".venv-vllm" / "bin" / "python"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
               "OMP_WAIT_POLICY": "PASSIVE"}
        self.proc = subprocess.Popen([str(python), str(HERE / "peers" / "vllm_worker.py"), str(path)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, start_new_session=True)
        self._read()
        self.pause()

    def pause(self) -> None:
        """Stops vLLM's processes (its engine core polls while idle) so they cost the other engines nothing."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError("the vLLM worker exited; run it by hand to see why")

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        self.resume()
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        result = self._read()
        self.pause()
        return result

    def close(self) -> None:
        self.resume()
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def transformers_generate(path: Path, prompts: list[list[int]], batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch])  # equal lengths: left padding adds nothing
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return len(prompts) * NEW_TOKENS / (time.perf_counter() - start)


def transformers_generate_batch(path: Path, prompts: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    start = time.perf_counter()
    with torch.inference_mode():
        outputs = model.generate_batch(prompts, generation_config=config)
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    from unified.runtime import init_distributed, select_accelerator

    init_distributed(select_accelerator("cpu"))
    gflops_before, bandwidth = matmul_gflops(), read_bandwidth()
    path = bench_model(args.model)
    generator = torch.Generator().manual_seed(0)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]

    def random_prompts(count: int, length: int = PROMPT_LEN) -> list[list[int]]:
        return [torch.randint(0, vocab, (length,), generator=generator).tolist() for _ in range(count)]

    prefix = random_prompts(1, 1024)[0]

    ours = Ours(path)
    peers = {"vllm-cpu": VLLM(path)} if (HERE / ".venv-vllm" / "bin" / "python").exists() else {}
    engines = {"unified": ours, **peers}
    throughput = {name: [] for name in engines}
    decode = {name: [] for name in engines}
    for engine in engines.values():  # one short unmeasured run each: first-touch costs are not throughput
        engine.run(random_prompts(NUM_REQUESTS), 8)
    for _ in range(args.rounds):
        prompts = random_prompts(NUM_REQUESTS)  # new each round, so no engine gains from its prefix cache
        for name, engine in engines.items():
            result = engine.run(prompts, NEW_TOKENS)
            throughput[name].append(result["output_tokens"] / result["seconds"])
            # Batch-1 decode: the time of 127 extra tokens, measured as a 128-token run minus a 1-token run.
            first = engine.run(prompts[1:2], 1)["seconds"]
            whole = engine.run(prompts[2:3], NEW_TOKENS)["seconds"]
            decode[name].append((NEW_TOKENS - 1) / (whole - first))
    for peer in peers.values():
        peer.close()

    cold = ours.run([prefix + prompts[0][:16]], 1)["seconds"]
    warm = ours.run([prefix + prompts[1][:16]], 1)["seconds"]
    hf = {} if args.skip_transformers else {
        "transformers generate, batch 16": transformers_generate(path, prompts, 16),
        "transformers generate, batch 64": transformers_generate(path, prompts, 64),
        "transformers generate_batch": transformers_generate_batch(path, prompts)}
    gflops_after = matmul_gflops()

    roofline = bandwidth / ours.weight_bytes_per_step()
    median = {name: statistics.median(v) for name, v in throughput.items()}
    print(f"model {args.model}: {NUM_REQUESTS} requests x {PROMPT_LEN} prompt + {NEW_TOKENS} new tokens, greedy, fp32, "
          f"{torch.get_num_threads()} threads")
    print(f"host: matmul {gflops_before:.0f} GFLOP/s before, {gflops_after:.0f} after; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; batch-1 decode roofline {roofline:.0f} tok/s "
          f"({ours.weight_bytes_per_step() / 1e6:.0f} MB of weights per step)")
    print(f"{'engine':<36}{'output tok/s':>14}{'batch-1 decode tok/s':>22}")
    for name in engines:
        print(f"{name:<36}{median[name]:>14.0f}{statistics.median(decode[name]):>22.1f}   "
              f"(rounds: {', '.join(f'{v:.0f}' for v in throughput[name])})")
    for name, value in hf.items():
        print(f"{name:<36}{value:>14.0f}")
    if "vllm-cpu" in median:
        pairs = [a / b for a, b in zip(throughput["unified"], throughput["vllm-cpu"])]
        print(f"unified / vllm-cpu, paired rounds: {', '.join(f'{p:.2f}' for p in pairs)}; "
              f"median {statistics.median(pairs):.2f}")
    if hf:
        print(f"unified / best transformers: {median['unified'] / max(hf.values()):.2f}")
    print(f"batch-1 decode: {statistics.median(decode['unified']) / roofline:.0%} of roofline")
    print(f"TTFT, 1024-token shared prefix + 16 new: cold {cold * 1e3:.0f} ms, cached {warm * 1e3:.0f} ms "
          f"({warm / cold:.0%})")


if __name__ == "__main__":
    main()
