"""Forward-pass speed of our model against `transformers` on the same weights, in one run.

    .venv/bin/python bench/forward.py [model=smollm2] [--tokens 128] [--batch 1]

Prints prefill tokens/s for both, and our column-parallel linear at TP=1 against nn.Linear and
against megatron's own forward (our linears must cost no more than plain ones on a single rank).
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


def best_of(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_gflops() -> float:
    a = torch.randn(1024, 1024)
    return 2 * 1024 ** 3 / best_of(lambda: a @ a) / 1e9


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()

    from unified.checkpoint import load_model
    from unified.checkpoint.builtin import resolve_model
    from unified.jobs.parity import reference_model
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from unified.model.parallel_layers import ColumnLinear, megatron_config
    from unified.runtime import init_distributed, select_accelerator

    init_distributed(select_accelerator("cpu"))
    host_before = matmul_gflops()
    path = resolve_model(args.model)
    ours = load_model(path).model
    reference = reference_model(path)
    ids = torch.randint(0, ours.config.vocab_size, (args.batch, args.tokens))
    positions = torch.arange(args.tokens)
    n = args.batch * args.tokens
    t_ours = best_of(lambda: ours.logits(ours(ids, positions)))
    t_ref = best_of(lambda: reference(input_ids=ids))

    x = torch.randn(args.tokens, 576)
    column = ColumnLinear(576, 1536, megatron_config(torch.float32))
    plain = torch.nn.Linear(576, 1536, bias=False)
    column.weight.copy_(plain.weight)  # same values: uninitialised memory may hold slow denormals
    megatron_forward = lambda inp: ColumnParallelLinear.forward(column, inp)[0]  # noqa: E731
    x1 = x[:1]
    rows = []
    for label, inp, calls in ((f"linear 576->1536, {args.tokens} tokens", x, 100), ("linear 576->1536, 1 token", x1, 1000)):
        per_call = [best_of(lambda f=f: [f(inp) for _ in range(calls)]) / calls for f in (column, plain, megatron_forward)]
        rows.append((label, *per_call))
    host_after = matmul_gflops()

    print(f"host fp32 matmul: {host_before:.0f} GFLOP/s before, {host_after:.0f} after")
    print(f"{'what':<44}{'unified':>12}{'peer':>12}{'ratio':>8}")
    print(f"{f'prefill tok/s, {args.model}, {args.batch}x{args.tokens}':<44}{n / t_ours:>12.0f}{n / t_ref:>12.0f}"
          f"{t_ref / t_ours:>8.2f}   (peer: transformers)")
    for label, ours_s, plain_s, megatron_s in rows:
        print(f"{label + ', us (TP=1)':<44}{ours_s * 1e6:>12.1f}{plain_s * 1e6:>12.1f}{plain_s / ours_s:>8.2f}"
              f"   (peer: nn.Linear; megatron's own forward: {megatron_s * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
