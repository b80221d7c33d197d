"""Run on every rank by tests/parallel/test_presharded_two_ranks.py under `deepspeed --num_gpus 2`: for each
(layout, pre-sharded folder) given, loads the HF checkpoint and the pre-sharded folder under that layout in the
same process group, and compares their logits and greedy continuations. While the pre-sharded folder loads,
it records which of the folder's files this rank has mapped. Rank 0 prints one JSON line per layout.

    presharded_ranks.py <HF dir> <tensor>,<pipeline>,<expert>=<pre-sharded dir> ...
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import torch  # noqa: E402

from unified.checkpoint import load_model  # noqa: E402
from unified.runtime import Layout, init_distributed, select_accelerator, shutdown_distributed  # noqa: E402


def mapped_files(folder: Path) -> set[str]:
    with open("/proc/self/maps") as maps:
        return {Path(line.split()[-1]).name for line in maps if str(folder) in line}


def greedy(model, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[int]]:
    ids, first = prompt, None
    for _ in range(steps):
        logits = model.logits(model(ids, torch.arange(ids.shape[1])))
        first = logits if first is None else first
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return first, ids[0, prompt.shape[1]:].tolist()


def main(hf: str, cases: list[str]) -> None:
    accelerator = select_accelerator("cpu")
    prompt = torch.tensor([[3, 17, 42, 8, 99, 5, 61, 23]])
    for case in cases:
        sizes, folder = case.split("=", 1)
        layout = Layout(*map(int, sizes.split(",")))
        init_distributed(accelerator, layout)
        seen: set[str] = set()
        with torch.inference_mode():
            ref_logits, ref_tokens = greedy(load_model(hf).model, prompt, 4)
            model = load_model(folder, progress=lambda done, total: seen.update(mapped_files(Path(folder)))).model
            logits, tokens = greedy(model, prompt, 4)
        report = {"layout": sizes, "rank": torch.distributed.get_rank(), "mapped": sorted(seen),
                  "same_logits": torch.equal(logits, ref_logits), "tokens": tokens, "ref_tokens": ref_tokens}
        reports = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(reports, report)
        if torch.distributed.get_rank() == 0:
            print("RESULT " + json.dumps(reports), flush=True)
    shutdown_distributed(wait_for_peers=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    main(args[0], args[1:])
