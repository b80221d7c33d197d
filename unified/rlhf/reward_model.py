"""A reward model as a RewardFn: an HF *ForSequenceClassification checkpoint with num_labels=1.

The checkpoint loads into the shared model definition with its `score` head; a text's reward is that head
on the hidden state of its last non-padding token, the rule of transformers (and so of the trainers that
made the checkpoint). Each (prompt, completion) is formatted as a reward model is trained on it: under the
tokenizer's chat template, the prompt as the user turn (or the prompt's own messages) and the completion as
the assistant turn; as prompt + completion in plain text when the tokenizer has no template.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from unified.chat import flatten_content
from unified.checkpoint import load_model
from unified.errors import UserError
from unified.model.score_head import last_token_index
from unified.model.transformer import CausalLM
from unified.rlhf.rewards import RewardFn

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_reward_model(path: str | Path, device: str | torch.device, dtype: torch.dtype,
                      batch_size: int = 16) -> RewardFn:
    """`reward(prompts, completions, **task_fields) -> list[float]`: the checkpoint's score of each completion,
    `batch_size` texts to a forward pass."""
    path = Path(path)
    tokenizer = _tokenizer(path)
    loaded = load_model(path, device, dtype, num_labels=1)
    pad_token_id = getattr(loaded.hf_config, "pad_token_id", None)
    device = torch.device(device)

    def reward(prompts: list, completions: list[str], **_task_fields) -> list[float]:
        rows = [_token_ids(tokenizer, prompt, completion) for prompt, completion in zip(prompts, completions)]
        return [score for start in range(0, len(rows), batch_size)
                for score in _scores(loaded.model, rows[start:start + batch_size], pad_token_id, device)]

    return reward


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not path.is_dir():
        raise UserError(f"reward model folder {path} does not exist; set rlhf.reward_model= to an HF "
                        f"*ForSequenceClassification checkpoint folder")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"reward model {path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); it scores text, "
                        f"so copy the tokenizer files of the model it was trained from into that folder")
    return AutoTokenizer.from_pretrained(path)


def _token_ids(tokenizer, prompt: str | list[dict], completion: str) -> list[int]:
    """One (prompt, completion) as the reward model reads it. A prompt may be text or a list of chat messages."""
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                else [{**m, "content": flatten_content(m["content"], None)} for m in prompt])
    if not tokenizer.chat_template:
        return tokenizer("\n".join(m["content"] for m in messages) + completion)["input_ids"]
    messages.append({"role": "assistant", "content": completion})
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))


@torch.inference_mode()
def _scores(model: CausalLM, rows: list[list[int]], pad_token_id: int | None, device: torch.device) -> list[float]:
    # Padded at the right with any id: causal attention never lets a scored token see what follows it.
    ids = pad_sequence([torch.tensor(row) for row in rows], batch_first=True).to(device)  # [B, S]
    lengths = torch.tensor([len(row) for row in rows], device=device)
    hidden = model(ids, torch.arange(ids.shape[1], device=device))  # [B, S, H]
    return model.scores(hidden, last_token_index(ids, lengths, pad_token_id))[:, 0].float().tolist()
