"""HF tensor names of vision-language checkpoints: the text model's prefixes, the tower, other layouts.

The names we write (and list first) are those `save_pretrained` of transformers 5.24 writes. Checkpoints
in the wild also use other layouts: the original releases on the Hub (LLaVA's `vision_tower.vision_model.`,
Kimi-K2.5's `language_model.model.layers.`) and transformers' in-memory names (`model.language_model.`,
`model.visual.`). Each layout is a list of prefix rewrites of our names; a checkpoint is read with the layout
under which it holds the most of the tensors (a missing one is then reported by name).
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable

from unified.model.config import ModelConfig, VisionConfig


def text_prefixes(cfg: ModelConfig) -> tuple[str, str, str]:
    """(prefix of the embedding and final norm, prefix of decoder layer i, name of the LM head)."""
    kind = cfg.vision.kind if cfg.vision else None
    if kind == "clip":
        return "language_model.model.", "language_model.model.layers.", "language_model.lm_head.weight"
    if kind == "kimi_k25":  # transformers 5.24 saves Kimi's text layers as "blocks" (its rename, reversed)
        return "language_model.model.", "language_model.model.blocks.", "language_model.lm_head.weight"
    return "model.", "model.layers.", "lm_head.weight"


# Other layouts, as (pattern, replacement) rewrites of our names; the first matching rewrite applies.
OTHER_LAYOUTS: dict[str, list[list[tuple[str, str]]]] = {
    "qwen2_vl": [[(r"^visual\.", "model.visual."), (r"^model\.", "model.language_model.")]],
    "clip": [[(r"^vision_tower\.", "vision_tower.vision_model.")],
             [(r"^language_model\.model\.", "model.language_model."), (r"^language_model\.lm_head", "lm_head"),
              (r"^vision_tower\.", "model.vision_tower."),
              (r"^multi_modal_projector\.", "model.multi_modal_projector.")]],
    "kimi_k25": [[(r"^language_model\.model\.blocks\.", "language_model.model.layers."),
                  (r"^vision_tower\.encoder\.patch_embed\.", "vision_tower.patch_embed."),
                  (r"^model\.mm_projector\.", "mm_projector.")]],
}
OTHER_LAYOUTS["qwen2_5_vl"] = OTHER_LAYOUTS["qwen2_vl"]


def _rename(name: str, rules: list[tuple[str, str]]) -> str:
    for pattern, replacement in rules:
        if re.match(pattern, name):
            return re.sub(pattern, replacement, name, count=1)
    return name


def in_checkpoint_layout(params: list, cfg: ModelConfig, has: Callable[[str], bool]) -> list:
    """`params` with HF names rewritten to the layout of the checkpoint that `has` describes."""
    best, best_found = params, sum(has(n) for p in params for row in p.rows for n in row)
    for rules in OTHER_LAYOUTS.get(cfg.vision.kind, []) if cfg.vision else []:
        renamed = [replace(p, rows=tuple(tuple(_rename(n, rules) for n in row) for row in p.rows)) for p in params]
        found = sum(has(n) for p in renamed for row in p.rows for n in row)
        if found > best_found:
            best, best_found = renamed, found
    return best


def _linear(param_type, ours: str, hf: str, bias: bool = True) -> list:
    return [param_type(f"{ours}.weight", ((f"{hf}.weight",),))] + (
        [param_type(f"{ours}.bias", ((f"{hf}.bias",),))] if bias else [])


def _fused(param_type, ours: str, hfs: tuple[str, ...]) -> list:
    return [param_type(f"{ours}.{kind}", (tuple(f"{h}.{kind}" for h in hfs),)) for kind in ("weight", "bias")]


def vision_params(cfg: ModelConfig, param_type) -> list:
    """Our `vision.*` parameters and their HF tensors (all replicated: `split` None)."""
    v: VisionConfig = cfg.vision
    P, out = param_type, []
    layernorm = v.norm == "layernorm"
    if v.kind in ("qwen2_vl", "qwen2_5_vl"):
        out.append(P("vision.patch_embed", (("visual.patch_embed.proj.weight",),)))
        for i in range(v.depth):
            ours, hf = f"vision.blocks.{i}.", f"visual.blocks.{i}."
            out += _linear(P, f"{ours}norm1", f"{hf}norm1", layernorm)
            out += _linear(P, f"{ours}norm2", f"{hf}norm2", layernorm)
            out += _linear(P, f"{ours}attn.qkv", f"{hf}attn.qkv") + _linear(P, f"{ours}attn.proj", f"{hf}attn.proj")
            if v.gated_mlp:
                out += _fused(P, f"{ours}mlp.fc1", (f"{hf}mlp.gate_proj", f"{hf}mlp.up_proj"))
                out += _linear(P, f"{ours}mlp.fc2", f"{hf}mlp.down_proj")
            else:
                out += _linear(P, f"{ours}mlp.fc1", f"{hf}mlp.fc1") + _linear(P, f"{ours}mlp.fc2", f"{hf}mlp.fc2")
        out += _linear(P, "vision.merger.norm", "visual.merger.ln_q", layernorm)
        out += _linear(P, "vision.merger.fc1", "visual.merger.mlp.0")
        out += _linear(P, "vision.merger.fc2", "visual.merger.mlp.2")
    elif v.kind == "kimi_k25":
        hf = "vision_tower.encoder."
        out += _linear(P, "vision.patch_embed", f"{hf}patch_embed.proj")
        out.append(P("vision.pos_embed", (("vision_tower.patch_embed.pos_emb.weight",),)))
        for i in range(v.depth):
            ours, block = f"vision.blocks.{i}.", f"{hf}blocks.{i}."
            out += _linear(P, f"{ours}norm1", f"{block}norm0") + _linear(P, f"{ours}norm2", f"{block}norm1")
            out += _linear(P, f"{ours}attn.qkv", f"{block}wqkv") + _linear(P, f"{ours}attn.proj", f"{block}wo")
            out += _linear(P, f"{ours}mlp.fc1", f"{block}mlp.fc0") + _linear(P, f"{ours}mlp.fc2", f"{block}mlp.fc1")
        out += _linear(P, "vision.final_norm", f"{hf}final_layernorm")
        out += _linear(P, "vision.projector.norm", "model.mm_projector.pre_norm")
        out += _linear(P, "vision.projector.fc1", "mm_projector.proj.0")
        out += _linear(P, "vision.projector.fc2", "mm_projector.proj.2")
    else:
        hf = "vision_tower."
        out += [P("vision.patch_embed", ((f"{hf}embeddings.patch_embedding.weight",),)),
                P("vision.class_embedding", ((f"{hf}embeddings.class_embedding",),)),
                P("vision.position_embedding", ((f"{hf}embeddings.position_embedding.weight",),))]
        out += _linear(P, "vision.pre_norm", f"{hf}pre_layrnorm")
        out += _linear(P, "vision.post_norm", f"{hf}post_layernorm")
        for i in range(v.depth):
            ours, layer = f"vision.blocks.{i}.", f"{hf}encoder.layers.{i}."
            out += _linear(P, f"{ours}norm1", f"{layer}layer_norm1") + _linear(P, f"{ours}norm2", f"{layer}layer_norm2")
            out += _fused(P, f"{ours}attn.qkv", tuple(f"{layer}self_attn.{x}_proj" for x in "qkv"))
            out += _linear(P, f"{ours}attn.proj", f"{layer}self_attn.out_proj")
            out += _linear(P, f"{ours}mlp.fc1", f"{layer}mlp.fc1") + _linear(P, f"{ours}mlp.fc2", f"{layer}mlp.fc2")
        out += _linear(P, "vision.projector.fc1", "multi_modal_projector.linear_1", v.projector_bias)
        out += _linear(P, "vision.projector.fc2", "multi_modal_projector.linear_2", v.projector_bias)
    return out
