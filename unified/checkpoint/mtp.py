"""Loading a checkpoint's multi-token prediction layer (unified/model/mtp.py), which `transformers` drops.

DeepSeek-V3 and Kimi-K2 store it as one more decoder layer, `model.layers.<num_hidden_layers>.`, with its
own norms and projection beside the block; a tensor-parallel rank reads its slices as the loader does.
"""
from __future__ import annotations

from pathlib import Path

import torch

from unified.checkpoint.hf_config import model_config_from_hf, read_hf_config
from unified.checkpoint.hf_names import mtp_params
from unified.checkpoint.loader import assemble, current_shard
from unified.checkpoint.quantized import dequantizing
from unified.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint
from unified.model.mtp import MTPLayer


def load_mtp_layer(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
                   ) -> MTPLayer:
    path = Path(path)
    hf = read_hf_config(path)
    config = model_config_from_hf(hf)
    if not config.num_mtp_layers:
        raise CheckpointError(f"{path} ships no multi-token prediction layer (num_nextn_predict_layers is 0 or "
                              f"absent in config.json, as in every model but DeepSeek-V3 / Kimi-K2 style ones); "
                              f"use engine.speculative.method=ngram or draft instead")
    ckpt = dequantizing(SafetensorsCheckpoint(path), hf)
    params = mtp_params(config)
    missing = [name for param in params for row in param.rows for name in row if not ckpt.has(name)]
    if missing:
        raise CheckpointError(f"{path}: config.json declares num_nextn_predict_layers={config.num_mtp_layers}, but "
                              f"the MTP layer's tensors are missing ({', '.join(missing[:3])}"
                              f"{', ...' if len(missing) > 3 else ''}); was it saved with transformers, which "
                              f"drops them? Use the original checkpoint, or engine.speculative.method=ngram")
    with torch.device(device):
        layer = MTPLayer(config, dtype)
    shard = current_shard()
    targets = dict(layer.named_parameters()) | dict(layer.named_buffers())
    with torch.no_grad():
        for param in params:
            tensor = assemble(ckpt, param, shard)
            target = targets.pop(param.ours)
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"{param.rows[0][0]} in {path} has shape {tuple(tensor.shape)}, but the MTP "
                                      f"layer built from config.json expects {tuple(target.shape)}")
            target.copy_(tensor)
    unfilled = [name for name in targets if name in dict(layer.named_parameters())]
    assert not unfilled, f"MTP parameters not covered by the name map: {unfilled}"
    return layer.eval()
