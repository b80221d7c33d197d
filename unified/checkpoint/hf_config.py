"""HF `config.json` -> our ModelConfig, for every family we implement natively.

The HF config is read through `transformers`' own config classes, so defaults that a checkpoint
omits and legacy RoPE fields are filled in exactly as `transformers` would.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from unified.errors import UserError
from unified.model.config import MLAConfig, MoEConfig, ModelConfig

DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "kimi_k2")
VISION_LANGUAGE = ("qwen2_vl", "qwen2_5_vl", "kimi_k25", "llava")  # see hf_vision_config
SUPPORTED = DENSE + MOE + VISION_LANGUAGE
# Kimi-K2 ships the DeepSeek-V3 architecture under its own model_type (with remote code); the Qwen-VL text
# models are Qwen2 with M-RoPE.
CONFIG_CLASS_OF = {"kimi_k2": "deepseek_v3", "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2"}


class UnsupportedModelError(UserError, ValueError):
    pass


def read_hf_config(checkpoint_dir: str | Path):
    """Returns the `transformers` config object for the checkpoint in `checkpoint_dir`."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{checkpoint_dir} has no config.json; point model= at a Hugging Face "
                                f"checkpoint folder (config.json + *.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err}); re-download or re-export the checkpoint") from err
    return hf_config_from_dict(raw, path)


def hf_config_from_dict(raw: dict, path: Path):
    """The `transformers` config object for a config.json's contents (read from `path`, named in errors)."""
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(f"{path}: model_type {model_type!r} is not implemented natively; "
                                    f"supported: {', '.join(SUPPORTED)}")
    quantization = raw.get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise UserError(f"{path}: quantization_config is {quantization!r}; it must be an object such as "
                        f'{{"quant_method": "fp8", ...}} or {{"quant_method": "compressed-tensors", ...}}')
    raw = {k: v for k, v in raw.items() if k not in ("auto_map",)}
    return CONFIG_MAPPING[CONFIG_CLASS_OF.get(model_type, model_type)].from_dict(raw)


def sequence_classifier_labels(hf) -> int | None:
    """num_labels of a *ForSequenceClassification checkpoint (its `architectures` say so); None for a causal LM."""
    architectures = getattr(hf, "architectures", None) or []
    return hf.num_labels if any(a.endswith("ForSequenceClassification") for a in architectures) else None


def _sliding_windows(hf) -> list[int | None]:
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        windows = [window if kind == "sliding_attention" else None for kind in layer_types]
    else:
        windows = [window] * hf.num_hidden_layers
    return windows if any(w is not None for w in windows) else []


def _rope_parameters(hf) -> dict:
    params = getattr(hf, "rope_parameters", None) or {}
    if "rope_theta" not in params:
        params = {**params, "rope_theta": getattr(hf, "rope_theta", 10000.0)}
    params.setdefault("rope_type", "default")
    return dict(params)


def _mla(hf, rope: dict) -> MLAConfig:
    qk_dim = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    scale = qk_dim ** -0.5
    if rope.get("rope_type") == "yarn" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return MLAConfig(q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
                     qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
                     v_head_dim=hf.v_head_dim, rope_interleave=getattr(hf, "rope_interleave", True),
                     softmax_scale=scale)


def _qwen_moe_dense_layers(hf) -> list[int]:
    only_mlp = set(getattr(hf, "mlp_only_layers", []) or [])
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return [i for i in range(hf.num_hidden_layers) if i in only_mlp or (i + 1) % step != 0]


def _moe(hf, family: str) -> MoEConfig:
    if family == "mixtral":
        return MoEConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                         expert_intermediate_size=hf.intermediate_size)
    if family in ("qwen2_moe", "qwen3_moe"):
        shared = getattr(hf, "shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
        return MoEConfig(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
                         expert_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=hf.norm_topk_prob,
                         shared_intermediate_size=shared, shared_expert_gate=bool(shared),
                         dense_layers=_qwen_moe_dense_layers(hf))
    return MoEConfig(num_experts=hf.n_routed_experts, top_k=hf.num_experts_per_tok,
                     expert_intermediate_size=hf.moe_intermediate_size, scoring="sigmoid",
                     norm_topk_prob=hf.norm_topk_prob, score_correction_bias=True,
                     num_groups=hf.n_group or 1, topk_groups=hf.topk_group or 1,
                     routed_scaling_factor=hf.routed_scaling_factor,
                     shared_intermediate_size=(hf.n_shared_experts or 0) * hf.moe_intermediate_size,
                     dense_layers=list(range(min(hf.first_k_dense_replace, hf.num_hidden_layers))))


def model_config_from_hf(hf) -> ModelConfig:
    if hf.model_type in VISION_LANGUAGE:
        return _vision_language_config(hf)
    family = CONFIG_CLASS_OF.get(hf.model_type, hf.model_type)
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True checkpoints are not supported")
    rope = _rope_parameters(hf)
    mla = _mla(hf, rope) if family == "deepseek_v3" else None
    attention_bias = bool(getattr(hf, "attention_bias", False))
    qkv_bias = {"qwen2": True, "qwen2_moe": bool(getattr(hf, "qkv_bias", True))}.get(family, attention_bias)
    o_bias = attention_bias if family in ("llama", "qwen3", "qwen3_moe", "deepseek_v3") else False
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    num_labels = sequence_classifier_labels(hf)
    return ModelConfig(
        family=family,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=hf.intermediate_size,
        rms_norm_eps=hf.rms_norm_eps,
        hidden_act=hf.hidden_act,
        max_position_embeddings=hf.max_position_embeddings,
        rope_parameters=rope,
        # a classifier has no LM head to tie, whatever its config says
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)) and num_labels is None,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        sliding_window=[] if mla else _sliding_windows(hf),
        mla=mla,
        moe=_moe(hf, family) if family in MOE else None,
        num_labels=num_labels,
        num_mtp_layers=(getattr(hf, "num_nextn_predict_layers", 0) or 0) if family == "deepseek_v3" else 0,
    )


def _vision_language_config(hf) -> ModelConfig:
    """The text model from the family's text_config, with the vision tower and image placeholder added."""
    from dataclasses import replace

    from unified.checkpoint.hf_vision_config import image_token_id_of, vision_config_from_hf

    text = hf.text_config
    if CONFIG_CLASS_OF.get(text.model_type, text.model_type) not in DENSE + MOE:
        raise UnsupportedModelError(f"{hf.model_type} with a {text.model_type!r} text model is not implemented "
                                    f"natively; supported text models: {', '.join(DENSE + MOE)}")
    config = model_config_from_hf(text)
    return replace(config, tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
                   vision=vision_config_from_hf(hf), image_token_id=image_token_id_of(hf),
                   mrope_section=config.rope_parameters.get("mrope_section"))
