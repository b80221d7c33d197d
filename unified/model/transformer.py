"""The decoder-only language model used by every path: training, serving, rollouts, parity checks.

forward(input_ids [B, S], positions [B, S] or [S]) -> final hidden states [B, S, H]; `logits()` maps
hidden states to vocabulary scores. `inputs_embeds` lets a vision front end hand in token embeddings
with image features already merged at the placeholder positions.
"""
from __future__ import annotations

import torch
from torch import nn

import kernels

from unified.model.attention import GQAttention
from unified.model.config import ModelConfig
from unified.model.mla import MLAttention
from unified.model.mlp import GatedMLP
from unified.model.moe import MoE
from unified.model.norm import RMSNorm
from unified.model.parallel_layers import ColumnLinear, PackableWeight, VocabEmbedding, gather_vocab, megatron_config
from unified.model.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = MLAttention(config, layer, dtype) if config.mla else GQAttention(config, layer, dtype)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (MoE(config, dtype) if config.is_moe_layer(layer)
                    else GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, dtype))

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), rope, cos, sin)
        return x + self.mlp(self.post_attn_norm(x))


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        mp = megatron_config(dtype)
        self.embed = VocabEmbedding(config.vocab_size, config.hidden_size, mp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else ColumnLinear(config.hidden_size, config.vocab_size, mp)
        self.tied_head_packed: tuple[torch.Tensor, int] | None = None
        self.rope = RotaryEmbedding(config.rope_parameters, config.rope_head_dim, config.max_position_embeddings,
                                    interleaved=bool(config.mla and config.mla.rope_interleave))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                layer_outputs: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Returns final-norm hidden states; appends each layer's output to `layer_outputs` if given."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [B, S, H]
        if positions.dim() == 1:
            positions = positions.expand(x.shape[0], -1)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, self.rope, cos, sin)
            if layer_outputs is not None:
                layer_outputs.append(x)
        return self.norm(x)

    def vocab_parallel_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V/tp]: this rank's slice of the vocabulary (for vocab-parallel cross-entropy)."""
        if self.lm_head is None:
            return kernels.linear(hidden, self.embed.weight, None, self.tied_head_packed)
        return self.lm_head(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]: every rank gets the whole vocabulary's logits."""
        return gather_vocab(self.vocab_parallel_logits(hidden))

    def pack_weights(self, rows: int) -> None:
        """Attaches pre-packed copies of the big matmul weights for inference (see kernels.linear);
        call again after the weights change."""
        for module in self.modules():
            if isinstance(module, PackableWeight):
                module.pack(rows)
        if self.lm_head is None:
            packed = kernels.pack_linear_weight(self.embed.weight, rows)
            self.tied_head_packed = None if packed is None else (packed, rows)
