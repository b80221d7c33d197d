"""The main job: answer one chat prompt with the shared model definition.

Greedy decoding over the full sequence at every step; the inference engine replaces this loop with
paged KV-cache decoding behind the same entry point.
"""
from __future__ import annotations

import torch

from unified.checkpoint import load_model
from unified.checkpoint.builtin import resolve_model
from unified.errors import UserError
from unified.runtime import start_runtime


@torch.inference_mode()
def generate_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int], device) -> list[int]:
    tokens = torch.tensor([prompt_ids], device=device)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        positions = torch.arange(tokens.shape[1], device=device)
        next_id = int(model.logits(model(tokens, positions)[:, -1]).argmax(-1))
        if next_id in stop_ids:
            break
        generated.append(next_id)
        tokens = torch.cat([tokens, tokens.new_tensor([[next_id]])], dim=1)
    return generated


def chat_prompt_ids(tokenizer, prompt: str, system_prompt: str | None) -> list[int]:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": prompt}]
    if not tokenizer.chat_template:
        return tokenizer(prompt)["input_ids"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def stop_token_ids(tokenizer, generation_config) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(generation_config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return ids


def run(cfg) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    if not cfg.prompt:
        raise UserError("the demo needs a prompt: unified recipe=demo 'prompt=\"What is the capital of France?\"'")
    runtime = start_runtime(cfg.device, cfg.parallel, cfg.seed)
    path = resolve_model(cfg.model)
    loaded = load_model(path, runtime.device, runtime.dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = None
    prompt_ids = chat_prompt_ids(tokenizer, cfg.prompt, cfg.generation.system_prompt)
    if len(prompt_ids) + cfg.generation.max_new_tokens > loaded.config.max_position_embeddings:
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; with max_new_tokens="
                        f"{cfg.generation.max_new_tokens} that exceeds the model's context of "
                        f"{loaded.config.max_position_embeddings} tokens: shorten the prompt")
    answer = generate_greedy(loaded.model, prompt_ids, cfg.generation.max_new_tokens,
                             stop_token_ids(tokenizer, generation_config), runtime.device)
    print(tokenizer.decode(answer, skip_special_tokens=True).strip())
