"""Where each of our parameters lives in a Hugging Face checkpoint, in both directions.

A `Param` names our tensor and the HF tensors it is built from: `rows[e][p]` is part p of row e.
Parts of a row are concatenated (fused q|k|v, gate|up); several rows are stacked into a new leading
dimension (the experts of an MoE layer). `split` is the dimension along which each part is divided
across tensor-parallel ranks (None: replicated), so a rank reads only its slice of every part. KV
heads fewer than the ranks are replicated: each rank reads the one head its query heads attend with.
"""
from __future__ import annotations

from dataclasses import dataclass

from unified.checkpoint.hf_vision_names import text_prefixes, vision_params
from unified.model.config import ModelConfig


@dataclass(frozen=True)
class Param:
    ours: str
    rows: tuple[tuple[str, ...], ...]
    split: int | None = None
    sizes: tuple[int, ...] | None = None  # lengths of the parts along cat_dim; None: equal parts
    unit: int | None = None  # rows of one head: a part with fewer heads than ranks is replicated per head

    @property
    def is_experts(self) -> bool:
        """One row per routed expert: an expert-parallel rank reads only its experts' rows."""
        return self.ours.endswith(("experts.gate_up", "experts.down"))

    @property
    def stacked(self) -> bool:
        return len(self.rows) > 1 or self.is_experts

    @property
    def cat_dim(self) -> int:
        return self.split if self.split is not None else 0


def _single(ours: str, hf: str, split: int | None = None) -> Param:
    return Param(ours, ((hf,),), split)


def _gqa(cfg: ModelConfig, ours: str, hf: str) -> list[Param]:
    sizes = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
    params = [Param(f"{ours}qkv_proj.weight", ((f"{hf}q_proj.weight", f"{hf}k_proj.weight", f"{hf}v_proj.weight"),), 0,
                    sizes, cfg.head_dim),
              _single(f"{ours}o_proj.weight", f"{hf}o_proj.weight", 1)]
    if cfg.qkv_bias:
        params.append(Param(f"{ours}qkv_proj.bias", ((f"{hf}q_proj.bias", f"{hf}k_proj.bias", f"{hf}v_proj.bias"),), 0,
                            sizes, cfg.head_dim))
    if cfg.o_bias:
        params.append(_single(f"{ours}o_proj.bias", f"{hf}o_proj.bias"))
    if cfg.qk_norm:
        params += [_single(f"{ours}q_norm.weight", f"{hf}q_norm.weight"),
                   _single(f"{ours}k_norm.weight", f"{hf}k_norm.weight")]
    return params


def _mla(cfg: ModelConfig, ours: str, hf: str) -> list[Param]:
    assert cfg.mla is not None
    params = [_single(f"{ours}kv_a_proj.weight", f"{hf}kv_a_proj_with_mqa.weight"),
              _single(f"{ours}kv_a_norm.weight", f"{hf}kv_a_layernorm.weight"),
              _single(f"{ours}kv_b_proj.weight", f"{hf}kv_b_proj.weight", 0),
              _single(f"{ours}o_proj.weight", f"{hf}o_proj.weight", 1)]
    if cfg.mla.q_lora_rank is None:
        params.append(_single(f"{ours}q_proj.weight", f"{hf}q_proj.weight", 0))
    else:
        params += [_single(f"{ours}q_a_proj.weight", f"{hf}q_a_proj.weight"),
                   _single(f"{ours}q_a_norm.weight", f"{hf}q_a_layernorm.weight"),
                   _single(f"{ours}q_proj.weight", f"{hf}q_b_proj.weight", 0)]
    if cfg.qkv_bias:
        params += [_single(f"{ours}q_a_proj.bias", f"{hf}q_a_proj.bias")] if cfg.mla.q_lora_rank else []
        params.append(_single(f"{ours}kv_a_proj.bias", f"{hf}kv_a_proj_with_mqa.bias"))
    if cfg.o_bias:
        params.append(_single(f"{ours}o_proj.bias", f"{hf}o_proj.bias"))
    return params


def _gated_mlp(ours: str, hf: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> list[Param]:
    return [Param(f"{ours}gate_up_proj.weight", ((f"{hf}{gate}.weight", f"{hf}{up}.weight"),), 0),
            _single(f"{ours}down_proj.weight", f"{hf}{down}.weight", 1)]


def _moe(cfg: ModelConfig, ours: str, hf_layer: str) -> list[Param]:
    moe = cfg.moe
    assert moe is not None
    if cfg.family == "mixtral":
        hf, names = f"{hf_layer}block_sparse_moe.", ("w1", "w3", "w2")
    else:
        hf, names = f"{hf_layer}mlp.", ("gate_proj", "up_proj", "down_proj")
    gate, up, down = names
    experts = range(moe.num_experts)
    params = [_single(f"{ours}router.weight", f"{hf}gate.weight"),
              Param(f"{ours}experts.gate_up",
                    tuple((f"{hf}experts.{e}.{gate}.weight", f"{hf}experts.{e}.{up}.weight") for e in experts)),
              Param(f"{ours}experts.down", tuple((f"{hf}experts.{e}.{down}.weight",) for e in experts))]
    if moe.score_correction_bias:
        params.append(_single(f"{ours}router.score_bias", f"{hf}gate.e_score_correction_bias"))
    if moe.shared_intermediate_size:
        shared = "shared_expert." if moe.shared_expert_gate else "shared_experts."
        params += _gated_mlp(f"{ours}shared.", f"{hf}{shared}")
    if moe.shared_expert_gate:
        params.append(_single(f"{ours}shared_gate.weight", f"{hf}shared_expert_gate.weight"))
    return params


def parameter_map(cfg: ModelConfig) -> list[Param]:
    """HF names as transformers writes them; a vision-language checkpoint in another layout is read through
    hf_vision_names.in_checkpoint_layout."""
    base, layer_prefix, head = text_prefixes(cfg)
    params = [_single("embed.weight", f"{base}embed_tokens.weight", 0), _single("norm.weight", f"{base}norm.weight")]
    if cfg.num_labels is not None:
        params.append(_single("score.weight", "score.weight"))
    elif not cfg.tie_word_embeddings:
        params.append(_single("lm_head.weight", head, 0))
    for i in range(cfg.num_layers):
        params += decoder_layer_params(cfg, i, f"layers.{i}.", f"{layer_prefix}{i}.")
    return params + (vision_params(cfg, Param) if cfg.vision else [])


def decoder_layer_params(cfg: ModelConfig, layer: int, ours: str, hf: str) -> list[Param]:
    """One decoder layer's parameters: ours under the prefix `ours`, HF's under `hf`."""
    params = [_single(f"{ours}input_norm.weight", f"{hf}input_layernorm.weight"),
              _single(f"{ours}post_attn_norm.weight", f"{hf}post_attention_layernorm.weight")]
    params += (_mla if cfg.mla else _gqa)(cfg, f"{ours}attn.", f"{hf}self_attn.")
    if cfg.is_moe_layer(layer):
        return params + _moe(cfg, f"{ours}mlp.", hf)
    return params + _gated_mlp(f"{ours}mlp.", f"{hf}mlp.")


def mtp_params(cfg: ModelConfig) -> list[Param]:
    """The first MTP layer's parameters (unified/model/mtp.py), stored after the model's layers as DeepSeek-V3
    stores them: `model.layers.<num_layers>.` holds its norms, projection and block (its copies of the
    embedding and head are not read: the main model's serve)."""
    _, layer_prefix, _ = text_prefixes(cfg)
    hf = f"{layer_prefix}{cfg.num_layers}."
    return [_single("enorm.weight", f"{hf}enorm.weight"), _single("hnorm.weight", f"{hf}hnorm.weight"),
            _single("eh_proj.weight", f"{hf}eh_proj.weight"),
            _single("head_norm.weight", f"{hf}shared_head.norm.weight"),
            *decoder_layer_params(cfg, cfg.num_layers, "block.", hf)]
