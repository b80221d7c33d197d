"""The tensors one rank of a layout holds, by name and shape, worked out from the model's own rules.

This mirrors how the model's modules shard themselves (unified/model): column-parallel linears split their
output features over tensor parallel, row-parallel ones their input features; KV heads fewer than the
tensor-parallel ranks are replicated; MLA's down-projections and every norm are replicated; the routed
experts are split over expert parallel only (each rank holds its experts at full width); a pipeline stage
holds its contiguous run of layers, the embedding on the first stage (and on the last when the head is
tied), the final norm and head on the last; the vision tower is replicated on the first stage. Nothing is
built: a 3T model's inventory is a few thousand small records. `meta_build` builds the same rank's modules
on the meta device, and tests/plan checks that both agree to the byte.

The vision tower is not sharded and its shape does not depend on the layout, so its tensors are read off
the tower built once on the meta device rather than restated here.
"""
from __future__ import annotations

from dataclasses import dataclass

from unified.model.config import ModelConfig
from unified.model.transformer import stage_layers
from unified.runtime.layout import Layout

# What a tensor is, for the weight formats (weight_bytes.py): "projection" is a decoder layer's linear weight
# (the quantized formats store these quantized), the rest stay in the model's dtype.
PROJECTION, EMBEDDING, HEAD, NORM, ROUTER, BIAS, VISION, BUFFER = (
    "projection", "embedding", "head", "norm", "router", "bias", "vision", "buffer")


@dataclass(frozen=True)
class RankTensor:
    name: str  # the model's parameter or buffer name
    shape: tuple[int, ...]  # this rank's shard
    kind: str
    float32: bool = False  # held in float32 whatever the model's dtype (routing bias, rotary frequencies)
    packable: bool = False  # a tensor-parallel linear: the inference engine may keep a packed / int8 copy of it
    buffer: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class Stage:
    """One rank's coordinates in a layout, as far as what it holds depends on them."""

    layout: Layout
    stage: int = 0  # pipeline stage

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.layout.pipeline - 1


def rank_tensors(config: ModelConfig, place: Stage) -> list[RankTensor]:
    """Every parameter and buffer the rank at `place` holds."""
    layout, tp = place.layout, place.layout.tensor
    tied, classifier = config.tie_word_embeddings, config.num_labels is not None
    h = config.hidden_size
    out: list[RankTensor] = []
    if place.first or (place.last and tied):
        out.append(RankTensor("embed.weight", (config.vocab_size // tp, h), EMBEDDING))
    for layer in stage_layers(config.num_layers, layout.pipeline, place.stage):
        out += _layer(config, layer, layout)
    if place.last:
        out.append(RankTensor("norm.weight", (h,), NORM))
        if classifier:
            out.append(RankTensor("score.weight", (config.num_labels, h), HEAD))
        elif not tied:
            out.append(RankTensor("lm_head.weight", (config.vocab_size // tp, h), HEAD, packable=True))
    out.append(RankTensor("rope.inv_freq", (_rotary_frequencies(config),), BUFFER, float32=True, buffer=True))
    if config.vision is not None and place.first:
        out += _vision_tensors(config)
    return out


def mtp_tensors(config: ModelConfig, layout: Layout) -> list[RankTensor]:
    """The multi-token prediction layer engine.speculative.method=mtp loads (unified/model/mtp.py): its norms, its
    replicated eh_proj [H, 2H] and a decoder block at layer index num_layers (embedding and head are the model's)."""
    h, p = config.hidden_size, "mtp."
    norms = [RankTensor(p + name, (h,), NORM) for name in ("enorm.weight", "hnorm.weight", "head_norm.weight")]
    return [*norms, *_linear(p + "eh_proj", h, 2 * h, False, packable=False),
            *_layer(config, config.num_layers, layout)]


def _linear(name: str, out_features: int, in_features: int, bias: bool, packable: bool = True,
            bias_features: int | None = None) -> list[RankTensor]:
    tensors = [RankTensor(f"{name}.weight", (out_features, in_features), PROJECTION, packable=packable)]
    if bias:
        tensors.append(RankTensor(f"{name}.bias", (bias_features or out_features,), BIAS))
    return tensors


def _layer(config: ModelConfig, layer: int, layout: Layout) -> list[RankTensor]:
    p, h, tp = f"layers.{layer}.", config.hidden_size, layout.tensor
    out = [RankTensor(p + "input_norm.weight", (h,), NORM), RankTensor(p + "post_attn_norm.weight", (h,), NORM)]
    out += _mla(config, p + "attn.", tp) if config.mla else _gqa(config, p + "attn.", tp)
    if config.is_moe_layer(layer):
        out += _moe(config, p + "mlp.", layout)
    else:
        out += _gated_mlp(p + "mlp.", h, config.intermediate_size, tp)
    return out


def _gqa(config: ModelConfig, p: str, tp: int) -> list[RankTensor]:
    d, h = config.head_dim, config.hidden_size
    qkv = (config.num_heads + 2 * max(config.num_kv_heads, tp)) * d // tp
    out = _linear(p + "qkv_proj", qkv, h, config.qkv_bias)
    out += _linear(p + "o_proj", h, config.num_heads * d // tp, config.o_bias, bias_features=h)
    if config.qk_norm:
        out += [RankTensor(p + "q_norm.weight", (d,), NORM), RankTensor(p + "k_norm.weight", (d,), NORM)]
    return out


def _mla(config: ModelConfig, p: str, tp: int) -> list[RankTensor]:
    mla, h, heads = config.mla, config.hidden_size, config.num_heads // tp
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank is None:
        out = _linear(p + "q_proj", heads * qk, h, False)
    else:  # the down-projections are plain replicated linears, not tensor-parallel ones
        out = _linear(p + "q_a_proj", mla.q_lora_rank, h, config.qkv_bias, packable=False)
        out.append(RankTensor(p + "q_a_norm.weight", (mla.q_lora_rank,), NORM))
        out += _linear(p + "q_proj", heads * qk, mla.q_lora_rank, False)
    out += _linear(p + "kv_a_proj", mla.kv_lora_rank + mla.qk_rope_head_dim, h, config.qkv_bias, packable=False)
    out.append(RankTensor(p + "kv_a_norm.weight", (mla.kv_lora_rank,), NORM))
    out += _linear(p + "kv_b_proj", heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, False)
    out += _linear(p + "o_proj", h, heads * mla.v_head_dim, config.o_bias, bias_features=h)
    return out


def _gated_mlp(p: str, hidden: int, intermediate: int, tp: int) -> list[RankTensor]:
    return _linear(p + "gate_up_proj", 2 * intermediate // tp, hidden, False) + \
        _linear(p + "down_proj", hidden, intermediate // tp, False)


def _moe(config: ModelConfig, p: str, layout: Layout) -> list[RankTensor]:
    moe, h = config.moe, config.hidden_size
    local, inter = moe.num_experts // layout.expert, moe.expert_intermediate_size
    out = [RankTensor(p + "router.weight", (moe.num_experts, h), ROUTER)]
    if moe.score_correction_bias:
        out.append(RankTensor(p + "router.score_bias", (moe.num_experts,), ROUTER, float32=True, buffer=True))
    out += [RankTensor(p + "experts.gate_up", (local, 2 * inter, h), PROJECTION),
            RankTensor(p + "experts.down", (local, h, inter), PROJECTION)]
    if moe.shared_intermediate_size:
        out += _gated_mlp(p + "shared.", h, moe.shared_intermediate_size, layout.tensor)
    if moe.shared_expert_gate:
        out.append(RankTensor(p + "shared_gate.weight", (1, h), ROUTER))
    return out


def _rotary_frequencies(config: ModelConfig) -> int:
    """The length of the rotary frequency table every rank keeps (transformers' initialisers decide it)."""
    from unified.model.rope import rope_frequencies

    return rope_frequencies(config.rope_parameters, config.rope_head_dim, config.max_position_embeddings)[0].numel()


def _vision_tensors(config: ModelConfig) -> list[RankTensor]:
    return [RankTensor(name, shape, BUFFER if buffer else VISION, float32=float32, buffer=buffer)
            for name, shape, buffer, float32 in _vision_shapes(config.vision, config.hidden_size)]


_VISION_SHAPES: dict[str, tuple] = {}


def _vision_shapes(vision, out_size: int) -> tuple[tuple[str, tuple[int, ...], bool, bool], ...]:
    """(name, shape, is a buffer, is float32 whatever the model's dtype) of the tower's tensors."""
    key = f"{vision!r}/{out_size}"
    if key not in _VISION_SHAPES:
        import torch

        from unified.model.vision import build_vision_tower

        with torch.device("meta"):
            tower = build_vision_tower(vision, out_size, torch.bfloat16)
        _VISION_SHAPES[key] = tuple(
            (f"vision.{name}", tuple(t.shape), buffer, t.dtype == torch.float32)
            for buffer, named in ((False, tower.named_parameters()), (True, tower.named_buffers()))
            for name, t in named)
    return _VISION_SHAPES[key]
