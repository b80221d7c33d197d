"""A multi-token prediction (MTP) layer, as DeepSeek-V3 and Kimi-K2 ship them (`num_nextn_predict_layers`).

The layer predicts the token after next: at position i it takes the embedding of token i + 1 and the main
model's final hidden state at i (each RMS-normed, concatenated, projected back to the hidden size by
`eh_proj`), runs one decoder block of the model's own kind (MLA attention over its own KV cache, an MoE
MLP), and scores the block's output, normed by `head_norm`, with the main model's LM head. Embedding and
head are shared with the main model, as DeepSeek-V3's report describes; the checkpoint's copies of them
are not read. As in vLLM, the embedding at position 0 is zeroed (nothing precedes that token).

Chained for more than one draft token, the layer's own output at i, normed by `head_norm` as the main
model's final hidden states are by its final norm, stands in for the main model's hidden state at i + 1
(vLLM's and SGLang's practice for a single MTP layer).
"""
from __future__ import annotations

import torch
from torch import nn

from unified.model.config import ModelConfig
from unified.model.norm import RMSNorm
from unified.model.rope import RotaryEmbedding
from unified.model.transformer import DecoderLayer


class MTPLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.layer = config.num_layers  # its global layer index: its KV cache layer comes after the model's
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False, dtype=dtype)
        self.block = DecoderLayer(config, self.layer, dtype)
        self.head_norm = RMSNorm(hidden, config.rms_norm_eps, dtype)

    def forward(self, embeds: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor,
                rope: RotaryEmbedding) -> torch.Tensor:
        """embeds [1, T, H] (the next tokens'), previous_hidden [1, T, H], positions [1, T] -> the block's output
        [1, T, H], which `head_norm` and then the main model's head turn into logits."""
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous_hidden)), dim=-1))
        cos, sin = rope.cos_sin(rope.batched(positions, x.shape[0]), x.dtype)
        return self.block(x, rope, cos, sin)
