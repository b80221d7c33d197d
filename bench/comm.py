"""Share of engine step time spent in collectives under tensor parallel 2, and bytes moved per token.

    .venv/bin/python bench/comm.py [--tp 2] [--prompt 512] [--batch 32]

Starts itself on `--tp` CPU ranks with torchrun. The model is the Llama of bench/throughput.py (hidden
512, 8 layers, 8/2 heads, intermediate 1408, vocab 32000, random weights). Rank 0 drives the real
engine: prefill steps (one `--prompt`-token request) and decode steps (`--batch` sequences, one token
each); every collective on the model path is timed and its bytes counted (unified.runtime.comm).

Analytic count per token, for a dense model under tensor parallel: each layer all-reduces the hidden
state twice (attention output, MLP output) and the embedding lookup once more, H values each; a token
that samples also gathers the vocabulary's logits (V/tp values from each rank). Bytes are those each
rank hands to a collective; a ring all-reduce puts 2(p-1)/p times that on the wire.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=4096)


def make_checkpoint(folder: Path) -> None:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from unified.checkpoint.builtin import resolve_model

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model("smollm2") / name, folder / name)


def measure(step, ledger, steps: list) -> tuple[float, float, float]:
    """Runs `step()` for each element of `steps`; returns medians of (step s, collective s, bytes)."""
    totals, comms, sizes = [], [], []
    for _ in steps:
        ledger.reset()
        start = time.perf_counter()
        step()
        totals.append(time.perf_counter() - start)
        comms.append(sum(ledger.seconds.values()))
        sizes.append(sum(ledger.bytes.values()))
    return statistics.median(totals), statistics.median(comms), statistics.median(sizes)


def rank_main(args) -> None:
    import torch

    from unified.config.schema import DeviceConfig, EngineConfig, ParallelConfig
    from unified.engine.llm import build_engine
    from unified.engine.sampling_params import SamplingParams
    from unified.runtime.comm import CommLedger, recording

    torch.set_num_threads(1)
    engine = build_engine(args.checkpoint, DeviceConfig("cpu", "float32"), ParallelConfig(tensor=args.tp),
                          EngineConfig(num_blocks=2048, prefix_caching=False, max_num_seqs=args.batch,
                                       max_num_batched_tokens=max(2048, args.prompt)))
    if not engine.is_driver:
        engine.follow()
        return
    ledger, vocab, hidden, layers = CommLedger(), MODEL["vocab_size"], MODEL["hidden_size"], MODEL["num_hidden_layers"]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with recording(ledger):
        def prefill() -> None:
            engine.add_request(torch.randint(0, vocab, (args.prompt,)).tolist(), params)
            while engine.has_unfinished():
                engine.step()

        prefill()  # warm-up
        pre = measure(prefill, ledger, range(5))
        decode_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for _ in range(args.batch):
            engine.add_request(torch.randint(0, vocab, (16,)).tolist(), decode_params)
        engine.step()  # the batch's prefill
        for _ in range(5):
            engine.step()  # warm-up decode steps
        dec = measure(engine.step, ledger, range(20))
        while engine.has_unfinished():
            engine.step()
    engine.shutdown()

    def analytic(tokens: int, sampled: int) -> float:
        return ((2 * layers + 1) * hidden * tokens + vocab // args.tp * sampled) * 4 / tokens

    print(f"\ntensor parallel {args.tp} on CPU (gloo), Llama hidden {hidden}, {layers} layers, vocab {vocab}, fp32")
    print(f"{'step':<26}{'step ms':>9}{'in collectives':>16}{'share':>8}{'bytes/token':>13}{'analytic':>10}")
    for name, (total, comm, size), tokens, sampled in (
            (f"prefill 1 x {args.prompt} tokens", pre, args.prompt, 1),
            (f"decode {args.batch} x 1 token", dec, args.batch, args.batch)):
        print(f"{name:<26}{total * 1e3:>9.1f}{comm * 1e3:>13.1f} ms{comm / total:>8.0%}{size / tokens:>13.0f}"
              f"{analytic(tokens, sampled):>10.0f}")
    wire = 2 * (args.tp - 1) / args.tp
    print(f"(bytes each rank hands to collectives; a ring all-reduce sends {wire:.2f}x that on the wire)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.checkpoint:
        rank_main(args)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="bench-comm-") as folder:
        make_checkpoint(Path(folder))
        torchrun = Path(sys.executable).with_name("torchrun")
        subprocess.run([str(torchrun), "--nproc_per_node", str(args.tp), "--master_port", "29517", __file__,
                        "--tp", str(args.tp), "--prompt", str(args.prompt), "--batch", str(args.batch),
                        "--checkpoint", folder], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


if __name__ == "__main__":
    main()
