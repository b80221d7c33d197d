"""The start-up probe: before a recipe reads a tensor, the plan for the devices actually present.

Every recipe that loads a model runs it first (unified/cli.py), on the model's configuration alone (a
configuration-only name is never resolved to weights; a model whose configuration cannot be read, or a layout
that breaks the layout rules, is left to the job, which names the problem). When the ranks' bytes exceed
their memory, the run stops with the plan's table and its nearest fixes (exit 2), unless
`plan.probe=warn` (log it and go on) or `off`. A configuration-only name that would fit stops with "no
weights". A KV cache too small for one sequence of the full context is only a warning: the engine then caps
the context, as it says. Otherwise the prediction for this rank is recorded for the engine and the trainer
to log beside what they measure (unified/runtime/memory_report.py).

The devices present: on CPU this machine (configs/hardware/cpu.yaml, its memory available now), with the
process's own resident memory now as the framework's reserve; on an accelerator, `plan.hardware` when it
names an accelerator's file, else the file whose name the device's name contains (h100, h200, ...), with the
device's own memory size, and as the reserve what the card holds once this process's context exists (its
context, other processes), measured with mem_get_info; the file's reserve_bytes is recipe=plan's estimate for
cards it cannot see. The cards are the launch's ranks.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch
from omegaconf import OmegaConf

from unified.checkpoint.shipped import is_config_only, model_config_of, require_weights
from unified.errors import UserError
from unified.plan.hardware import HardwareConfig, hardware_names, load_hardware
from unified.plan.planner import plan_for
from unified.plan.report import render
from unified.runtime.device import detect_device
from unified.runtime.memory_report import expect, resident_bytes

log = logging.getLogger(__name__)

# Jobs that load a model, and what they plan for; the others (plan, quantize, convert) stream or read nothing.
MODES = {"demo": "serve", "batch": "serve", "serve": "serve", "rollout": "serve", "check_parity": "serve",
         "vision_demo": "serve", "train": "train", "online": "train", "grpo": "train", "ppo": "train"}
PROBES = ("on", "warn", "off")


def probe(cfg) -> None:
    """Runs the plan for `cfg`'s job on the devices present; raises UserError (exit 2) when it cannot fit."""
    setting = {"False": "off", "True": "on"}.get(str(cfg.plan.probe), cfg.plan.probe)  # YAML reads off as false
    if setting not in PROBES:
        raise UserError(f"plan.probe={setting!r}; choose on, warn or off")
    if setting == "off" or cfg.job not in MODES:
        return
    try:
        config = model_config_of(cfg.model)
    except UserError:  # no readable configuration: the job reports that in its own words
        return
    hardware, device = present_hardware(cfg)
    cards = int(os.environ.get("WORLD_SIZE", "1"))
    plan = plan_for(OmegaConf.merge(cfg, {"plan": {"mode": MODES[cfg.job], "cards": cards}}), hardware, config)
    requested = plan.requested
    if requested.problems:  # an impossible layout: the job's own layout check names it
        return
    if not requested.short and not requested.fits:  # the engine caps the context
        log.warning("start-up probe: the KV cache will hold %d tokens, less than one %d-token sequence; sequences "
                    "stop there (unified recipe=plan shows the fixes)", requested.kv_tokens, plan.context)
    elif not requested.fits:
        message = (f"model={cfg.model} does not fit {cards} x {hardware.name} as configured (the start-up probe "
                   f"planned it before reading any weight):\n{render(plan)}\n(plan.probe=warn runs anyway; "
                   f"unified recipe=plan shows the same plan)")
        if setting == "on":
            raise UserError(message)
        log.warning(message)
    elif is_config_only(cfg.model):
        require_weights(cfg.model)
    baseline = hardware.reserve_bytes
    expect(plan.requested.peak, baseline)
    log.info("start-up probe: model=%s fits %d x %s, %.2f GiB predicted per rank at its peak (%s)", cfg.model, cards,
             hardware.name, plan.requested.peak / 2 ** 30, device)


def present_hardware(cfg) -> tuple[HardwareConfig, str]:
    """The hardware file for the device this run is about to use, sized as found, and the device's name."""
    name = cfg.device.name if cfg.device.name != "auto" else detect_device()
    if name == "cpu":
        hardware = load_hardware("cpu", measure_reserve=False)
        own = resident_bytes()  # the framework's share, measured on this very process
        return replace(hardware, reserve_bytes=own, memory_bytes=hardware.memory_bytes + own), "cpu"
    module = torch.cuda if name == "cuda" else getattr(torch, name)
    index = int(os.environ.get("LOCAL_RANK", "0"))
    props = module.get_device_properties(index)
    chosen = cfg.plan.hardware if cfg.plan.hardware != "cpu" else next(
        (n for n in hardware_names() if n.replace("-", "") in props.name.lower().replace(" ", "")), "h100")
    hardware = replace(load_hardware(chosen), memory_bytes=props.total_memory)
    if hasattr(module, "mem_get_info"):  # measured: what the card already holds once this process's context exists
        free, total = module.mem_get_info(index)
        hardware = replace(hardware, memory_bytes=total, reserve_bytes=total - free)
    return hardware, props.name
