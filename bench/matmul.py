"""CPU inference matmuls over packed weights: our panel kernel against oneDNN on its own packing, one run.

    .venv/bin/python bench/matmul.py [--rows 1 8 64 2048] [--rounds 3]

Shapes are SmolLM2-135M's (q/k/v fused, gate/up fused, o, down, the LM head). For each shape and row
count: `unified_cpu::panel_linear` over `pack_weight`'s panels (what `kernels.linear` runs on AVX2
machines), oneDNN's matmul over its blocked copy (`torch.ops.mkldnn._linear_pointwise`, the op vLLM's CPU
backend and PyTorch's compiler run) and F.linear (MKL sgemm on the plain weight). The three alternate
round by round; the table has each one's best round in GFLOP/s.
"""
from __future__ import annotations

import argparse
import importlib
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv 576->960": (960, 576), "gate_up 576->3072": (3072, 576), "o 576->576": (576, 576),
          "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}


def seconds_per_call(fn, budget: float = 0.2) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget or calls < 3:
        fn()
        calls += 1
    return elapsed / calls


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    linear = importlib.import_module("unified.kernels.linear")  # the package exports the function `linear`
    if not linear._panels_available():
        raise SystemExit("the panel kernel is not built on this machine (it needs AVX2 and a C++ compiler)")

    print(f"{'shape':<22}{'rows':>6}{'panels':>10}{'oneDNN':>10}{'F.linear':>10}{'panels/oneDNN':>15}   GFLOP/s")
    for label, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features)
        panels = linear.pack_weight(weight)
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, linear.ONEDNN_PACK_ROWS)
        for rows in args.rows:
            x = torch.randn(rows, in_features)
            contestants = {"panels": lambda: linear.linear(x, weight, None, panels),
                           "oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
                           "F.linear": lambda: F.linear(x, weight)}
            best = {name: float("inf") for name in contestants}
            for _ in range(args.rounds):
                for name, fn in contestants.items():
                    best[name] = min(best[name], seconds_per_call(fn))
            gflops = {name: 2 * rows * out_features * in_features / s / 1e9 for name, s in best.items()}
            print(f"{label:<22}{rows:>6}{gflops['panels']:>10.0f}{gflops['oneDNN']:>10.0f}{gflops['F.linear']:>10.0f}"
                  f"{best['oneDNN'] / best['panels']:>15.2f}")


if __name__ == "__main__":
    main()
