"""`unified recipe=quantize model=<dir|name> output=<dir> engine.quantization=int8|int4|fp8
[engine.quantize_lm_head=true]`: writes a quantized copy of a full-precision HF checkpoint.

int8 and int4 in compressed-tensors' formats (channel-wise `int-quantized`; symmetric group-wise
`pack-quantized`), fp8 in DeepSeek-V3's block format (e4m3, 128 x 128 blocks, `weight_scale_inv`); see
unified/checkpoint/quantized.py, which also loads them. The text layers' projections are quantized (and the
LM head with engine.quantize_lm_head); embeddings, norms, routers and vision towers are copied as they are.
The source is read one safetensors file at a time, so memory holds one shard, not the model.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from unified.checkpoint.builtin import resolve_model
from unified.checkpoint.hf_config import read_hf_config
from unified.checkpoint.loader import SIDECAR_FILES
from unified.checkpoint.output import check_new_folder
from unified.checkpoint.quantized import (int4_group, quantization_config, quantization_config_for, quantize_tensor,
                                          quantizes)
from unified.checkpoint.safetensors_io import INDEX, SafetensorsCheckpoint
from unified.errors import UserError

METHODS = ("int8", "int4", "fp8")


def run(cfg) -> None:
    method, lm_head = cfg.engine.quantization, cfg.engine.quantize_lm_head
    if method not in METHODS:
        raise UserError(f"recipe=quantize needs engine.quantization={'|'.join(METHODS)} (got {method!r})")
    if not cfg.output:
        raise UserError("recipe=quantize needs output=<folder> for the quantized checkpoint")
    source, target = resolve_model(cfg.model), Path(cfg.output)
    check_new_folder(target, source)
    hf = read_hf_config(source)
    if quantization_config(hf) is not None:
        raise UserError(f"{source} is already quantized (its config.json has a quantization_config)")
    if lm_head and getattr(hf, "tie_word_embeddings", False):
        lm_head = False
        print(f"{source} ties its LM head to the embeddings, which stay in full precision in the file; serve it with "
              f"engine.quantize_lm_head=true to quantize the engine's copy of the head")
    ckpt = SafetensorsCheckpoint(source)
    names = [n for n in ckpt.location]
    chosen = {n for n in names if quantizes(n, ckpt.shape(n), method, lm_head)}
    if not chosen:
        raise UserError(f"{source} has no projection weights to quantize")
    group = int4_group([ckpt.shape(n)[-1] for n in chosen]) if method == "int4" else None
    target.mkdir(parents=True, exist_ok=True)
    weight_map, before, after = {}, 0, 0
    for path in ckpt.files:  # one shard in memory at a time
        tensors = {}
        for name in (n for n in names if ckpt.location[n] == path):
            tensor = ckpt.get(name)
            before += tensor.numel() * tensor.element_size()
            stored = (quantize_tensor(name, tensor, method, group) if name in chosen else {name: tensor.contiguous()})
            tensors.update(stored)
        after += sum(t.numel() * t.element_size() for t in tensors.values())
        tmp = target / f".{path.name}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, target / path.name)
        weight_map.update({name: path.name for name in tensors})
    if len(ckpt.files) > 1:
        (target / INDEX).write_text(json.dumps({"metadata": {"total_size": after}, "weight_map": weight_map},
                                               indent=2))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config_for(method, lm_head, group or 128)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for name in SIDECAR_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    print(f"quantized {len(chosen)} of {len(names)} tensors of {source} to {method}"
          f"{f' (groups of {group})' if group else ''}: {before / 2 ** 20:.1f} MiB -> {after / 2 ** 20:.1f} MiB in "
          f"{target}")
