from __future__ import annotations

from dataclasses import dataclass

import torch

from unified.runtime.device import default_dtype, select_accelerator
from unified.runtime.distributed import Layout, init_distributed


@dataclass
class Runtime:
    accelerator: object  # a deepspeed DeepSpeedAccelerator
    device: torch.device
    dtype: torch.dtype


def start_runtime(device_cfg, parallel_cfg, seed: int = 0) -> Runtime:
    """Accelerator, process groups and RNG seeds for a run, from the `device` and `parallel` configs."""
    accelerator = select_accelerator(device_cfg.name)
    init_distributed(accelerator, Layout(parallel_cfg.tensor, parallel_cfg.pipeline, parallel_cfg.expert))
    accelerator.manual_seed_all(seed)
    torch.manual_seed(seed)
    device = torch.device(accelerator.current_device_name())
    return Runtime(accelerator, device, default_dtype(accelerator, device_cfg.dtype))
