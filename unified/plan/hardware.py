"""What a card offers the planner: memory, bandwidth, peak throughput, links, and the framework's own share.

`plan.hardware=<name>` reads configs/hardware/<name>.yaml, `plan.hardware=<path>` any YAML file of the same
fields, checked against `HardwareConfig` (a misspelt or mistyped field names itself). Kind `cpu` is this
machine: its ranks are processes sharing its memory, read at run time where the file leaves it null.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from unified.errors import UserError

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"


@dataclass
class HardwareConfig:
    name: str
    kind: str  # gpu (one rank per card, memory per card) | cpu (ranks are processes sharing the host's memory)
    memory_bytes: Optional[int]  # per card; a cpu host's whole memory (null: read at run time)
    bandwidth_bytes_s: float  # memory read bandwidth per card
    bf16_flops: float  # dense peaks per card
    fp8_flops: Optional[float]
    fp32_flops: float
    interconnect_bytes_s: float  # per card and direction, between cards of a node
    network_bytes_s: float  # per card and direction, between nodes
    cards_per_node: int
    # the framework's own resident memory per rank (process, device context), measured; cpu: null measures it
    reserve_bytes: Optional[int]
    cores: Optional[int] = None  # cpu: the host's cores (null: read at run time)

    def flops(self, dtype_bytes: int, fp8_weights: bool = False) -> float:
        if fp8_weights and self.fp8_flops:
            return self.fp8_flops
        return self.fp32_flops if dtype_bytes == 4 else self.bf16_flops


def hardware_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(spec: str, measure_reserve: bool = True) -> HardwareConfig:
    """`spec`: a name in configs/hardware/ or a path to a YAML file of HardwareConfig's fields. A cpu file's
    null reserve is measured (`measure_host_reserve`, a few seconds) unless `measure_reserve` is False (the
    start-up probe measures its own process instead)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(spec).expanduser()
    if not path.is_file():
        path = HARDWARE_DIR / f"{spec}.yaml"
    if not path.is_file():
        raise UserError(f"plan.hardware={spec!r} is neither a hardware file nor one of {', '.join(hardware_names())} "
                        f"(configs/hardware/); copy one of those files, edit it and pass its path")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(path))
        hardware = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise UserError(f"{path}: {err}".replace("\n", " ")) from err
    if hardware.kind not in ("gpu", "cpu"):
        raise UserError(f"{path}: kind={hardware.kind!r}; choose gpu or cpu")
    for key in ("memory_bytes", "bandwidth_bytes_s", "bf16_flops", "fp8_flops", "fp32_flops", "interconnect_bytes_s",
                "network_bytes_s", "cards_per_node", "reserve_bytes", "cores"):
        value = getattr(hardware, key)
        if value is not None and (value < 0 or (value == 0 and key not in ("memory_bytes", "reserve_bytes", "cores"))):
            raise UserError(f"{path}: {key}={value}; give a positive number")
    if hardware.kind == "cpu":
        hardware = replace(hardware, memory_bytes=hardware.memory_bytes or available_host_memory(),
                           cores=hardware.cores or os.cpu_count())
        if hardware.reserve_bytes is None and measure_reserve:
            hardware = replace(hardware, reserve_bytes=host_reserve())
    if not hardware.memory_bytes:
        raise UserError(f"{path}: memory_bytes is not set; give each card's memory in bytes")
    if hardware.reserve_bytes is None and hardware.kind != "cpu":
        raise UserError(f"{path}: reserve_bytes is not set; give the framework's own bytes per card (device "
                        f"context included), as measured by bench/plan.py")
    return hardware


def available_host_memory() -> int:
    """MemAvailable of this machine, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise UserError("cannot read MemAvailable from /proc/meminfo; set memory_bytes in the hardware file")


@functools.lru_cache(maxsize=1)
def host_reserve() -> int:
    """`measure_host_reserve`, once per process."""
    return measure_host_reserve()


def measure_host_reserve() -> int:
    """Resident bytes of a fresh process that imported torch, our engine and our loader (what cpu.yaml records)."""
    code = ("import torch, unified.engine, unified.checkpoint.loader\n"
            "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmRSS')))")
    env = {**os.environ, "PYTHONPATH": str(HARDWARE_DIR.parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return int(out.stdout.split()[-1])
