"""Multi-node launch through a DeepSpeed hostfile: the commands the real launcher generates.

No second node exists here, so `pdsh` is replaced by a stand-in that prints what it was asked to run;
everything up to that point (hostfile parsing, world info, per-node launch command) is DeepSpeed's own.
"""
from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path


def test_hostfile_launch_generates_one_command_per_node(tmp_path):
    (tmp_path / "bin").mkdir()
    pdsh = tmp_path / "bin" / "pdsh"
    pdsh.write_text('#!/bin/sh\necho "PDSH-ARGS: $*"\n')
    pdsh.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2\nnode2 slots=2\n")
    venv_bin = Path(sys.executable).parent
    result = subprocess.run(
        [str(venv_bin / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh_check", "--master_addr", "node1",
         "--master_port", "29600", "--launcher", "pdsh", "--module", "unified", "recipe=serve", "model=/models/kimi",
         "parallel=tp2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PATH": f"{pdsh.parent}:{venv_bin}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr[-3000:]
    command = next(line for line in result.stdout.splitlines() if line.startswith("PDSH-ARGS: "))
    assert "-w node1,node2" in command
    assert "-m deepspeed.launcher.launch" in command and "--node_rank=%n" in command  # pdsh fills in the node
    assert "--master_addr=node1 --master_port=29600 --module" in command
    assert command.endswith("unified recipe=serve model=/models/kimi parallel=tp2")
    world = json.loads(base64.b64decode(re.search(r"--world_info=(\S+)", command).group(1)))
    assert world == {"node1": [0, 1], "node2": [0, 1]}  # 2 ranks on each of 2 nodes: world size 4
