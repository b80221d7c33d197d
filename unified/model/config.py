"""Architecture description shared by every model family.

One dataclass covers dense and MoE decoders with GQA or MLA attention, optionally with a vision tower
in front (vision-language models) or a score head in place of the LM head (sequence classifiers, such as
reward models); each HF family is translated into it by `unified.checkpoint.hf_config`.
The model code reads only this, never an HF config.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)."""

    q_lora_rank: int | None  # None: a plain q projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    softmax_scale: float | None = None  # None: (nope + rope dim) ** -0.5


@dataclass
class MoEConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    scoring: str = "softmax"  # "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True
    score_correction_bias: bool = False  # DeepSeek-V3's aux-loss-free balancing bias
    num_groups: int = 1  # group-limited routing: pick topk_groups groups first
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen-MoE gates the shared expert with a sigmoid
    dense_layers: list[int] = field(default_factory=list)  # layers that keep a dense MLP


@dataclass
class VisionConfig:
    """A ViT tower and the projector that maps its features to the language model's hidden size.

    Every tower is a stack of pre-norm blocks (norm, attention within one image, norm, MLP); `kind` picks
    the front end (patch embedding, positions) and the back end (merger / projector):
      qwen2_vl, qwen2_5_vl: 3-D conv patches, 2-D rotary, merger of merge_size^2 patches (NaViT sizes)
      kimi_k25: 2-D conv patches + interpolated learned positions, 2-D rotary, merge kernel + projector
      clip: conv patches + class token + learned positions (LLaVA), features of `feature_layers`
    """

    kind: str
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    in_channels: int = 3
    temporal_patch_size: int = 1  # frames in one patch (Qwen repeats a still image to fill it)
    merge_size: int = 1  # an LM token covers merge_size x merge_size patches
    hidden_act: str = "quick_gelu"
    norm: str = "layernorm"  # or "rmsnorm"
    norm_eps: float = 1e-6
    gated_mlp: bool = False  # down(act(gate(x)) * up(x)) instead of fc2(act(fc1(x)))
    patch_bias: bool = False
    rope_theta: float | None = 10000.0  # 2-D rotary inside the tower; None: learned positions only
    rope_interleaved: bool = False  # rotary pairs (x0, x1), ... as in Kimi's original weights
    window_size: int | None = None  # Qwen2.5-VL: window side in pixels for the blocks not in fullatt_blocks
    fullatt_blocks: list[int] = field(default_factory=list)
    pos_embed_shape: list[int] = field(default_factory=list)  # Kimi: learned [height, width] table
    image_size: int = 0  # CLIP: the fixed square input size
    feature_layers: list[int] = field(default_factory=lambda: [-1])  # CLIP: hidden states fed to the projector
    select_strategy: str = "default"  # CLIP: "default" drops the class token, "full" keeps it
    projector_act: str = "gelu"
    projector_bias: bool = True
    projector_norm_eps: float = 1e-5


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: list[int | None] = field(default_factory=list)  # per layer; empty: none anywhere
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    vision: VisionConfig | None = None
    image_token_id: int | None = None  # the placeholder token that image features replace
    mrope_section: list[int] | None = None  # Qwen M-RoPE: rotary frequencies per (t, h, w) axis
    num_labels: int | None = None  # a sequence classifier (reward model): `score` head of this many outputs, no LM head
    num_mtp_layers: int = 0  # multi-token prediction layers stored after the model's (DeepSeek-V3: 1); see model/mtp.py

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    def sliding_window_of(self, layer: int) -> int | None:
        return self.sliding_window[layer] if self.sliding_window else None

    @property
    def rope_head_dim(self) -> int:
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim
