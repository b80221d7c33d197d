"""Rotary position embeddings.

Frequencies for every scaling scheme HF checkpoints use (default, linear, dynamic, yarn, llama3,
longrope) come from `transformers`' own RoPE initialisers, so a checkpoint's `rope_parameters` mean
exactly what they mean there. Two layouts: "half" rotates (x[:d/2], x[d/2:]) pairs (Llama, Qwen);
"interleaved" rotates (x0, x1), (x2, x3), ... (DeepSeek MLA) and returns the halves concatenated,
which is what HF does and is equivalent for attention since q and k are permuted alike.

M-RoPE (Qwen2-VL): positions carry three axes (temporal, height, width), [3, B, S]; the rotary
frequencies are cut into `mrope_section` runs and run i takes its angles from axis i % 3. Text tokens
have equal positions on the three axes, where M-RoPE reduces to plain RoPE, so [B, S] positions work
unchanged for such models.
"""
from __future__ import annotations

import torch
from torch import nn

from unified.kernels.rotary import apply_rotary


def rope_frequencies(rope_parameters: dict, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2 or less], attention_scaling) for a checkpoint's rope_parameters."""
    params = dict(rope_parameters)
    rope_type = params.get("rope_type", "default")
    theta = float(params["rope_theta"])
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = PretrainedConfig(head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1,
                                 max_position_embeddings=max_position_embeddings)
    hf_config.rope_parameters = params
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope_parameters: dict, head_dim: int, max_position_embeddings: int, interleaved: bool = False,
                 mrope_section: list[int] | None = None):
        super().__init__()
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = rope_frequencies(rope_parameters, head_dim, max_position_embeddings)
        # Computed on the host whatever the device (the same values everywhere), then placed where the model
        # is being built (a `with torch.device(...)` block moves factory calls, not this tensor).
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)
        self.interleaved = interleaved
        assert mrope_section is None or sum(mrope_section) == inv_freq.numel(), "mrope_section must cover head_dim/2"
        self.mrope_section = mrope_section

    def batched(self, positions: torch.Tensor, batch: int) -> torch.Tensor:
        """Positions as given to a model's forward -> [B, S], or [3, B, S] for M-RoPE axes. [S] is shared by
        the batch; for an M-RoPE model, [3, S] with a batch of one is read as the three axes of that row."""
        if positions.dim() == 1:
            return positions.expand(batch, -1)
        if self.mrope_section and positions.dim() == 2 and positions.shape[0] == 3 and batch == 1:
            return positions.unsqueeze(1)
        assert positions.dim() == 2 or (self.mrope_section and positions.dim() == 3), \
            f"positions of shape {tuple(positions.shape)} do not fit this model's rope"
        return positions

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] (or [3, B, S] under M-RoPE) -> cos, sin [B, S, D/2]."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [..., S, D/2]
        if positions.dim() == 3:
            freqs = torch.cat([run[i % 3] for i, run in enumerate(freqs.split(self.mrope_section, dim=-1))], dim=-1)
        return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, S, heads, D]; cos, sin: [B, S, D/2]."""
        return apply_rotary(x, cos, sin, self.interleaved)
