"""`recipe=grpo`: GRPO in one process, colocated (the engine samples the trainer's own parameters).

Every check a user can fail runs before the model loads: the options, the reward's import path, the
prompts. Each step logs TRL's metric names to the console and `<output>/metrics.jsonl`; every
`rlhf.eval_every` steps the held-out task prompts are answered greedily (`eval/reward`). At the end
`output` holds the servable checkpoint (LoRA merged; the adapter in `output/adapter`).
"""
from __future__ import annotations

import copy
import json
import logging
import random
from pathlib import Path

import torch

from unified.errors import UserError
from unified.rlhf.grpo import GRPO, PolicyObjective, Prompt, check_rlhf_config, score_rollouts
from unified.rlhf.rewards import load_reward
from unified.rlhf.rollout import generate
from unified.rlhf.tasks import read_prompts, task_prompts

log = logging.getLogger(__name__)
EVAL_SEED_OFFSET = 1_000_003  # held-out prompts come from another seed than the training ones


def _check_run(cfg):
    from unified.train.engine import check_train_config

    if not cfg.output:
        raise UserError("recipe=grpo needs output=<dir> for the trained model and its metrics")
    if cfg.steps is not None and cfg.steps < 1:
        raise UserError(f"steps={cfg.steps} must be at least 1")
    check_train_config(cfg.train)
    check_rlhf_config(cfg.rlhf)
    if cfg.parallel.tensor * cfg.parallel.pipeline * cfg.parallel.expert > 1:
        raise UserError("recipe=grpo runs on one rank for now (parallel=single); multi-rank rollouts and the "
                        "separate trainer/rollout mode are not built yet")
    return load_reward(cfg.rlhf.reward)


def _prompt_records(cfg) -> tuple[list[dict], list[dict]]:
    """(training prompts, held-out prompts); held-out only for a task."""
    if cfg.data:
        return read_prompts(cfg.data), []
    rc = cfg.rlhf
    options = dict(rc.task_options)
    return (task_prompts(rc.task, rc.train_prompts, cfg.seed, options),
            task_prompts(rc.task, rc.eval_prompts, cfg.seed + EVAL_SEED_OFFSET, options) if rc.eval_prompts else [])


def _prompts(records: list[dict], tokenizer) -> list[Prompt]:
    from unified.chat import chat_prompt

    out = []
    for record in records:
        text = record.get("messages", record.get("prompt"))
        ids = chat_prompt(tokenizer, text) if "messages" in record else tokenizer(text)["input_ids"]
        out.append(Prompt(ids, text, {k: v for k, v in record.items() if k not in ("prompt", "messages")}))
    return out


def _rollout_cache(cfg, prompts: list[Prompt]):
    """The engine options with a KV cache sized for one step's rollouts (or the held-out set, if larger),
    unless one is set: colocated, the rest of the memory belongs to training."""
    ec, rc = copy.copy(cfg.engine), cfg.rlhf
    if ec.num_blocks or ec.kv_cache_bytes:
        return ec
    longest = max(len(p.ids) for p in prompts) + rc.max_tokens
    sequences = max(rc.prompts_per_step * rc.num_generations, rc.eval_prompts)
    ec.num_blocks = sequences * -(-longest // ec.block_size)
    return ec


def _evaluate(engine, reward, prompts: list[Prompt], max_tokens: int) -> float:
    rollouts = generate(engine, [p.ids for p in prompts], 1, max_tokens, temperature=0.0)
    rewards = score_rollouts(reward, prompts, rollouts)
    return sum(rewards) / len(rewards)


def run_grpo(cfg) -> list[dict]:
    from transformers import AutoTokenizer
    from tqdm import tqdm

    from unified.checkpoint import load_model
    from unified.checkpoint.builtin import resolve_model
    from unified.engine.llm import eos_ids
    from unified.engine.llm_engine import LLMEngine
    from unified.runtime import start_runtime
    from unified.train.engine import initialize
    from unified.checkpoint.lora import apply_lora
    from unified.train.trainer import export_model

    reward = _check_run(cfg)
    rc, tc, output = cfg.rlhf, cfg.train, Path(cfg.output)
    train_records, eval_records = _prompt_records(cfg)
    runtime = start_runtime(cfg.device, cfg.parallel, cfg.seed)
    path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    train_prompts, eval_prompts = _prompts(train_records, tokenizer), _prompts(eval_records, tokenizer)
    loaded = load_model(path, runtime.device, runtime.dtype)
    model = loaded.model
    reference = None
    if tc.lora.rank > 0:
        apply_lora(model, tc.lora)
    else:
        reference = load_model(path, runtime.device, runtime.dtype).model
    steps = cfg.steps or 1
    tc.zero_stage = 0 if tc.zero_stage is None else tc.zero_stage
    trainer = initialize(model, tc, runtime.dtype, 1, steps, PolicyObjective(model, rc))
    engine = LLMEngine(model, tokenizer, _rollout_cache(cfg, train_prompts + eval_prompts), runtime.device,
                       runtime.dtype, runtime.accelerator, eos_ids(tokenizer, path))
    grpo = GRPO(engine, trainer, reward, rc, reference, seed=cfg.seed)
    order = list(range(len(train_prompts)))
    random.Random(cfg.seed).shuffle(order)
    output.mkdir(parents=True, exist_ok=True)
    history = []
    with open(output / "metrics.jsonl", "a") as sink, tqdm(total=steps, desc="grpo") as bar:
        if eval_prompts and rc.eval_every:
            before = _evaluate(engine, reward, eval_prompts, rc.max_tokens)
            sink.write(json.dumps({"step": 0, "eval/reward": before}) + "\n")
            log.info("held-out reward before training: %.3f on %d prompts", before, len(eval_prompts))
        for step in range(steps):
            chosen = [train_prompts[order[(step * rc.prompts_per_step + i) % len(order)]]
                      for i in range(rc.prompts_per_step)]
            metrics = {"step": step + 1, **grpo.step(chosen)}
            if eval_prompts and rc.eval_every and ((step + 1) % rc.eval_every == 0 or step + 1 == steps):
                metrics["eval/reward"] = _evaluate(engine, reward, eval_prompts, rc.max_tokens)
            sink.write(json.dumps(metrics) + "\n")
            sink.flush()
            history.append(metrics)
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.4f}",
                            logp_diff=f"{metrics['sampling/sampling_logp_difference/mean']:.1e}")
            bar.update()
    export_model(trainer, loaded, tc, output)
    torch.distributed.barrier()
    return history
