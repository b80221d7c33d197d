"""Vision towers and projectors: pixels -> rows of LM embeddings, one row per image placeholder token.

Every tower has `forward(pixel_values, grid_thw) -> [tokens, LM hidden]` over all images of a call at once
(rows in image order); unified.model.multimodal.image_token_counts says how many rows each image gives.
`blocks` holds what they share.
"""
from __future__ import annotations

import torch
from torch import nn

from unified.model.config import VisionConfig


def build_vision_tower(config: VisionConfig, out_size: int, dtype: torch.dtype) -> nn.Module:
    if config.kind in ("qwen2_vl", "qwen2_5_vl"):
        from unified.model.vision.qwen import QwenVisionTower

        return QwenVisionTower(config, out_size, dtype)
    if config.kind == "kimi_k25":
        from unified.model.vision.kimi import KimiVisionTower

        return KimiVisionTower(config, out_size, dtype, projector_norm_size=config.hidden_size)
    if config.kind == "clip":
        from unified.model.vision.clip import ClipVisionTower

        return ClipVisionTower(config, out_size, dtype)
    raise ValueError(f"unknown vision tower kind {config.kind!r}")
