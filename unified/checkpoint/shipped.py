"""Configuration-only built-in models: giant architectures shipped as their HF config.json, without weights.

`model=deepseek-v3` (671B), `model=kimi-k2` (1T) and `model=unified-3t-vl` (~3T, text + image) name
configurations that `recipe=plan` and meta-device builds use as they would a checkpoint's config. The first
two are the public config.json files of the released checkpoints (block-FP8 `quantization_config`
included). `unified-3t-vl` is the seed workload, a ~3T-parameter text+image MoE, on paper:

- text: Kimi-K2's layer geometry unchanged (hidden 7168, 61 layers with the first dense, MLA with q_lora 1536,
  kv_lora 512, nope 128, rope 64, v 128, 64 heads, 1 shared expert, routed experts of width 2048, top-8,
  163840-token vocabulary) with 3x its routed experts: 1152. DeepSeek-V3 -> Kimi-K2 grew from 671B to 1T along
  that axis (256 -> 384 experts, same active parameters); continuing it to ~3T keeps the ~33B active
  parameters per token, so decode cost per token stays K2's while memory triples. 1152 = 2^7 x 9 splits
  evenly over expert parallel 64 (18 experts per rank) or 128.
- context: 1M tokens (YaRN factor 256 over the 4096-token original window, as K2 uses factor 32 for 128k).
- vision: Kimi-K2.5's MoonViT tower and projector as released (27 blocks of width 1152, 2x2 patch merge),
  which reads images at their own size; at 0.4B parameters it is <0.1% of the model.
They are not a Hydra group: `model=` stays a plain value (a folder or a name), as for `smollm2`.
"""
from __future__ import annotations

import json
from pathlib import Path

from unified.checkpoint.hf_config import hf_config_from_dict, model_config_from_hf, read_hf_config
from unified.errors import UserError
from unified.model.config import ModelConfig

SHIPPED_DIR = Path(__file__).with_name("shipped")


def config_only_names() -> list[str]:
    return sorted(path.stem for path in SHIPPED_DIR.glob("*.json"))


def is_config_only(model: str) -> bool:
    return not Path(model).expanduser().is_dir() and (SHIPPED_DIR / f"{model}.json").is_file()


def require_weights(model: str, key: str = "model") -> None:
    """Raises for a configuration-only name: what a job that is about to read weights calls first (`key`: the
    setting that named it)."""
    if is_config_only(model):
        raise UserError(f"{key}={model} is a configuration without weights (shipped for planning: unified "
                        f"recipe=plan model={model}); point {key}= at a checkpoint folder of it to run it")


def hf_config_of(model: str):
    """The `transformers` config of `model` (a folder, a configuration-only name or a built-in model), read
    without touching any weights (a built-in model with weights is converted on first use, as for loading)."""
    if is_config_only(model):
        path = SHIPPED_DIR / f"{model}.json"
        return hf_config_from_dict(json.loads(path.read_text()), path)
    from unified.checkpoint.builtin import resolve_model

    return read_hf_config(resolve_model(model))


def model_config_of(model: str) -> ModelConfig:
    """Our ModelConfig for `model=<dir|name>`, without weights (planning, meta-device builds)."""
    return model_config_from_hf(hf_config_of(model))
