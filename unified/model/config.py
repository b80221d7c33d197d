"""Architecture description shared by every model family.

One dataclass covers dense and MoE decoders with GQA or MLA attention; each HF family is translated
into it by `unified.checkpoint.hf_config`. The model code reads only this, never an HF config.
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

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    def sliding_window_of(self, layer: int) -> int | None:
        return self.sliding_window[layer] if self.sliding_window else None

    @property
    def rope_head_dim(self) -> int:
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim
