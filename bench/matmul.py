"""CPU inference matmuls over packed weights: our kernels against oneDNN on its own packing, one run.

    .venv/bin/python bench/matmul.py [--rows 1 2 4 8 64 2048] [--rounds 3]

Shapes are SmolLM2-135M's (q/k/v fused, gate/up fused, o, down, the LM head). For each shape and row
count: `unified_cpu::panel_linear` over `pack_weight`'s panels (what `kernels.linear` runs on AVX2 and
AVX-512 machines; absent elsewhere), `unified_cpu::skinny_linear` streaming the plain weight (up to 8 rows),
oneDNN's matmul over its blocked copy (`torch.ops.mkldnn._linear_pointwise`, the op vLLM's CPU backend and
PyTorch's compiler run) and F.linear (MKL sgemm on the plain weight). Each contestant cycles through
enough copies of the weight to pass 64 MiB, so that few-row calls read it from memory as a decode step
does. They alternate round by round; the table has each one's best round in GFLOP/s.
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
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 64, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    linear = importlib.import_module("unified.kernels.linear")  # the package exports the function `linear`
    panels = linear._panels_available()
    names = (["panels"] if panels else []) + ["skinny", "oneDNN", "F.linear"]
    print(f"{'shape':<22}{'rows':>6}" + "".join(f"{n:>10}" for n in names) + f"{'oneDNN/best':>13}   GFLOP/s")
    for label, (out_features, in_features) in SHAPES.items():
        copies = max(1, (64 << 20) // (out_features * in_features * 4))
        weights = [torch.randn(out_features, in_features) for _ in range(copies)]
        packed = [linear.pack_weight(w) for w in weights] if panels else []
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, linear.ONEDNN_PACK_ROWS) for w in weights]
        for rows in args.rows:
            x = torch.randn(rows, in_features)
            contestants = {
                "panels": lambda: [linear.linear(x, w, None, p) for w, p in zip(weights, packed)],
                "skinny": lambda: [torch.ops.unified_cpu.skinny_linear(x, w, None) for w in weights],
                "oneDNN": lambda: [torch.ops.mkldnn._linear_pointwise(x, o, None, "none", [], "") for o in onednn],
                "F.linear": lambda: [F.linear(x, w) for w in weights]}
            running = [n for n in names if n != "skinny" or rows <= linear.SKINNY_MAX_ROWS]
            best = {name: float("inf") for name in running}
            for _ in range(args.rounds):
                for name in running:
                    best[name] = min(best[name], seconds_per_call(contestants[name]) / copies)
            gflops = {name: 2 * rows * out_features * in_features / s / 1e9 for name, s in best.items()}
            others = min(s for name, s in best.items() if name != "oneDNN")
            print(f"{label:<22}{rows:>6}" + "".join(f"{gflops[n]:>10.0f}" if n in gflops else f"{'':>10}"
                                                   for n in names) + f"{best['oneDNN'] / others:>13.2f}")

if __name__ == "__main__":
    main()
