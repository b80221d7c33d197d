"""The head of a sequence classifier (a reward model): one score vector per sequence, not logits per token.

As in transformers' *ForSequenceClassification, a bias-free linear maps the final hidden state of each
row's last real token to `num_labels` scores. The weight is tiny ([num_labels, H]), so every
tensor-parallel rank holds all of it.
"""
from __future__ import annotations

import torch
from torch import nn

from unified import kernels


class ScoreHead(nn.Module):
    def __init__(self, hidden_size: int, num_labels: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size, dtype=dtype))  # filled from the checkpoint

    def forward(self, hidden: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """hidden [B, S, H], last [B]: the position each row is scored at -> [B, num_labels]."""
        rows = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [B, H]
        return kernels.linear(rows, self.weight)


def last_token_index(input_ids: torch.Tensor, lengths: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """input_ids [B, S] right-padded, lengths [B] -> [B]: the position each row is scored at.

    transformers' rule: the last token that is not pad_token_id, or the last token when there is no pad
    id. The pad id is skipped inside a row's text too (often it is the end-of-turn token a chat ends with),
    so we apply the rule to the text, not only to where we padded."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # [S]
    scored = positions < lengths[:, None]  # [B, S]
    if pad_token_id is not None:
        scored &= input_ids != pad_token_id
    return (positions * scored).argmax(-1)
