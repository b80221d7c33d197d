"""Pre-sharded folders loaded on two CPU ranks (gloo) under `deepspeed --num_gpus 2`: one launch goes through
tensor, expert and pipeline parallel in turn (tests/parallel/presharded_ranks.py), each rank mapping only its
own file and computing the logits and greedy tokens that loading the HF checkpoint gives under that layout."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.parallel.test_two_ranks import BIN, LAUNCH_ENV
from tests.serve.conftest import free_port
from unified.checkpoint.manifest import shard_file
from unified.checkpoint.presharded import convert_to_presharded
from unified.runtime.layout import Layout

SCRIPT = "tests/parallel/presharded_ranks.py"


def test_presharded_folders_load_on_two_ranks_as_the_hf_checkpoint_does(tiny_checkpoint, tmp_path):
    from tests.conftest import ROOT

    hf = tiny_checkpoint("deepseek_v3")  # MLA, routed and shared experts
    layouts = {"2,1,1": Layout(tensor=2), "1,1,2": Layout(expert=2), "1,2,1": Layout(pipeline=2)}
    cases = []
    for sizes, layout in layouts.items():
        folder = tmp_path / sizes.replace(",", "-")
        convert_to_presharded(hf, folder, layout, log=lambda *_: None)
        cases.append(f"{sizes}={folder}")
    command = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
               str(ROOT / SCRIPT), str(hf), *cases]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=LAUNCH_ENV)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    reports = [json.loads(line.split("RESULT ", 1)[1]) for line in result.stdout.splitlines() if "RESULT " in line]
    assert [r[0]["layout"] for r in reports] == list(layouts), result.stdout[-3000:]
    for per_rank, layout in zip(reports, layouts.values()):
        for report in per_rank:
            assert report["same_logits"], report
            assert report["tokens"] == report["ref_tokens"], report
        # each rank mapped its own file and no other: (pipeline, tensor, expert) of ranks 0 and 1
        own = [shard_file(r * (layout.pipeline > 1), r * (layout.tensor > 1), r * (layout.expert > 1)) for r in (0, 1)]
        assert [r["mapped"] for r in per_rank] == [[own[0]], [own[1]]], per_rank
