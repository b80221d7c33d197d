"""HF vision-language configs -> VisionConfig, plus what the text model needs from the outer config.

The text model is the family's `text_config`, translated like any text checkpoint (Qwen-VL text configs are
Qwen2's with M-RoPE; Kimi-K2.5's is DeepSeek-V3; LLaVA's is any text family we implement).
"""
from __future__ import annotations

from unified.checkpoint.hf_config import UnsupportedModelError
from unified.model.config import VisionConfig

VISION_LANGUAGE = ("qwen2_vl", "qwen2_5_vl", "kimi_k25", "llava")
# Text sub-configs that are another family's architecture under their own model_type.
TEXT_FAMILY_OF = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "kimi_k2": "deepseek_v3"}


def _qwen(v, kind: str) -> VisionConfig:
    if kind == "qwen2_vl":
        return VisionConfig(kind=kind, depth=v.depth, hidden_size=v.embed_dim, num_heads=v.num_heads,
                            intermediate_size=int(v.embed_dim * v.mlp_ratio), patch_size=v.patch_size,
                            in_channels=v.in_channels, temporal_patch_size=v.temporal_patch_size,
                            merge_size=v.spatial_merge_size, hidden_act=v.hidden_act, norm="layernorm",
                            norm_eps=1e-6, rope_theta=float(v.rope_parameters["rope_theta"]))
    return VisionConfig(kind=kind, depth=v.depth, hidden_size=v.hidden_size, num_heads=v.num_heads,
                        intermediate_size=v.intermediate_size, patch_size=v.patch_size, in_channels=v.in_channels,
                        temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size,
                        hidden_act=v.hidden_act, norm="rmsnorm", norm_eps=1e-6, gated_mlp=True,
                        rope_theta=float(v.rope_parameters["rope_theta"]), window_size=v.window_size,
                        fullatt_blocks=list(v.fullatt_block_indexes))


def _kimi(hf) -> VisionConfig:
    v = hf.vision_config
    kernel = list(v.merge_kernel_size)
    if kernel[0] != kernel[1] or (hf.projection_hidden_size or v.hidden_size) != v.hidden_size:
        raise UnsupportedModelError(f"kimi_k25 with merge_kernel_size {kernel} and projection_hidden_size "
                                    f"{hf.projection_hidden_size} (vision hidden {v.hidden_size}) is not supported: "
                                    f"we implement square kernels and a projector normalising each patch")
    return VisionConfig(kind="kimi_k25", depth=v.num_hidden_layers, hidden_size=v.hidden_size,
                        num_heads=v.num_attention_heads, intermediate_size=v.intermediate_size,
                        patch_size=v.patch_size, merge_size=kernel[0], hidden_act=v.hidden_act, norm="layernorm",
                        norm_eps=1e-5, patch_bias=True, rope_theta=float(v.rope_parameters["rope_theta"]),
                        rope_interleaved=True, pos_embed_shape=[v.pos_emb_height, v.pos_emb_width],
                        projector_act="gelu", projector_norm_eps=hf.projection_layer_norm_eps)


def _clip(hf) -> VisionConfig:
    v = hf.vision_config
    if v.model_type != "clip_vision_model":
        raise UnsupportedModelError(f"llava with a {v.model_type!r} vision tower is not supported; we implement "
                                    f"clip_vision_model")
    layers = hf.vision_feature_layer
    return VisionConfig(kind="clip", depth=v.num_hidden_layers, hidden_size=v.hidden_size,
                        num_heads=v.num_attention_heads, intermediate_size=v.intermediate_size,
                        patch_size=v.patch_size, in_channels=v.num_channels, hidden_act=v.hidden_act,
                        norm="layernorm", norm_eps=v.layer_norm_eps, rope_theta=None, image_size=v.image_size,
                        feature_layers=[layers] if isinstance(layers, int) else list(layers),
                        select_strategy=hf.vision_feature_select_strategy, projector_act=hf.projector_hidden_act,
                        projector_bias=bool(getattr(hf, "multimodal_projector_bias", True)))


def vision_config_from_hf(hf) -> VisionConfig:
    if hf.model_type in ("qwen2_vl", "qwen2_5_vl"):
        return _qwen(hf.vision_config, hf.model_type)
    if hf.model_type == "kimi_k25":
        return _kimi(hf)
    return _clip(hf)


def image_token_id_of(hf) -> int:
    token = getattr(hf, "image_token_id", None)
    return token if token is not None else hf.image_token_index  # older LLaVA configs
