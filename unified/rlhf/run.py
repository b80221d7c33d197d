"""`recipe=grpo` and `recipe=ppo` in one process, colocated (the engine samples the trainer's own parameters).

Every check a user can fail runs before the model loads: the options, the reward's import path, the
prompts. Each step logs TRL's metric names to the console, `<output>/metrics.jsonl` and wandb; every
`rlhf.eval_every` steps the held-out task prompts are answered greedily (`eval/reward`). Checkpoints go
to `<output>/checkpoints` as the fine-tuning recipes' do (every `train.save_every` steps and at the end;
a run started again continues from the newest). At the end `output` holds the servable checkpoint (LoRA
merged; the adapter in `output/adapter`; PPO's value head in `output/value_head.safetensors`).
"""
from __future__ import annotations

import copy
import logging
import os
import random
from pathlib import Path

import torch
from omegaconf import OmegaConf

from unified.errors import UserError
from unified.rlhf.algorithms import (PolicyObjective, Prompt, algorithm, check_rlhf_config, rollout_seed, score_rollouts,
                                     value_head)
from unified.rlhf.placement import Colocated, Roles, Separate, Share
from unified.rlhf.whole_weights import WholeWeights
from unified.rlhf.rewards import load_reward
from unified.rlhf.tasks import read_prompts, task_prompts

log = logging.getLogger(__name__)
EVAL_SEED_OFFSET = 1_000_003  # held-out prompts come from another seed than the training ones


def _check_run(cfg):
    from unified.train.engine import check_train_config

    if not cfg.output:
        raise UserError(f"recipe={cfg.job} needs output=<dir> for the trained model and its metrics")
    if cfg.steps is not None and cfg.steps < 1:
        raise UserError(f"steps={cfg.steps} must be at least 1")
    check_train_config(cfg.train)
    check_rlhf_config(cfg.rlhf)
    if cfg.rlhf.reward_model is not None and not Path(cfg.rlhf.reward_model, "config.json").is_file():
        raise UserError(f"rlhf.reward_model={cfg.rlhf.reward_model!r} is not a checkpoint folder (no config.json there); "
                        f"give the folder of an HF *ForSequenceClassification model")
    if cfg.parallel.tensor * cfg.parallel.pipeline * cfg.parallel.expert > 1:
        raise UserError(f"recipe={cfg.job} runs without tensor, pipeline or expert parallelism for now "
                        f"(parallel=single); use rlhf.mode=separate to spread it over ranks")
    roles = Roles.of(cfg.rlhf, int(os.environ.get("WORLD_SIZE", "1")))
    if cfg.train.zero_stage == 3 and roles.separate:
        raise UserError(f"recipe={cfg.job} runs ZeRO-3 colocated only for now: DeepSpeed's ZeRO-3 holds collectives "
                        f"of the whole world (barriers at set-up, checks of its parameter trace at every forward) "
                        f"that the rollout ranks of rlhf.mode=separate cannot join; use train.zero_stage=0, 1 or 2 "
                        f"there, or rlhf.mode=colocated")
    if len(roles.trainers) > cfg.rlhf.prompts_per_step:
        raise UserError(f"rlhf.prompts_per_step={cfg.rlhf.prompts_per_step} leaves some of the {len(roles.trainers)} "
                        f"trainer ranks without a prompt group to train on: raise rlhf.prompts_per_step to at least "
                        f"{len(roles.trainers)}" + (f" or give rlhf.rollout_ranks more of the {roles.world} ranks"
                                                     if roles.separate else " or launch fewer ranks"))
    return None if cfg.rlhf.reward_model is not None else load_reward(cfg.rlhf.reward)  # the model loads later


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
    """The engine options with a KV cache sized for the sequences one step's rollouts (or the held-out
    evaluation, if larger) run at once, unless one is set: colocated, the rest of the memory belongs to training."""
    ec, rc = copy.copy(cfg.engine), cfg.rlhf
    if ec.num_blocks or ec.kv_cache_bytes:
        return ec
    longest = max(len(p.ids) for p in prompts) + rc.max_tokens
    sequences = max(rc.prompts_per_step * rc.num_generations, rc.eval_prompts * max(1, rc.eval_samples))
    ec.num_blocks = min(sequences, ec.max_num_seqs) * -(-longest // ec.block_size)  # what runs at once
    return ec


def _evaluate(rollouts, reward, prompts: list[Prompt], rc, seed: int) -> dict[str, float]:
    """The held-out reward: of one greedy answer per prompt (`eval/reward`) and, with rlhf.eval_samples,
    the mean of that many sampled answers per prompt at the training temperature, with its standard error
    over prompts (a prompt's samples are not independent of each other). Rollout ranks of a separate run
    only generate (`reward` None)."""
    ids = [p.ids for p in prompts]
    greedy = rollouts.generate(ids, 1, rc.max_tokens, 0.0, None)
    sampled = rollouts.generate(ids, rc.eval_samples, rc.max_tokens, rc.temperature, seed) if rc.eval_samples else []
    if reward is None:
        return {}
    scores = score_rollouts(reward, prompts, greedy)
    result = {"eval/reward": sum(scores) / len(scores)}
    if sampled:
        per_prompt = torch.tensor(score_rollouts(reward, prompts, sampled)).view(len(prompts), -1).mean(dim=1)
        stderr = float(per_prompt.std() / len(prompts) ** 0.5) if len(prompts) > 1 else 0.0
        result.update({"eval/reward_sampled": float(per_prompt.mean()), "eval/reward_sampled_stderr": stderr})
    return result


VALUE_HEAD = "value_head.safetensors"


def _save_value_head(head, output: Path) -> None:
    from safetensors.torch import save_file

    partial = output / f".{VALUE_HEAD}.partial"
    save_file({name: p.detach().float().cpu().contiguous() for name, p in head.named_parameters()}, str(partial))
    partial.replace(output / VALUE_HEAD)


def run_rlhf(cfg) -> list[dict]:
    from transformers import AutoTokenizer
    from tqdm import tqdm

    from unified.checkpoint import load_model
    from unified.checkpoint.builtin import resolve_model
    from unified.checkpoint.lora import apply_lora
    from unified.engine.llm import eos_ids
    from unified.engine.llm_engine import LLMEngine
    from unified.runtime import start_runtime
    from unified.train import checkpoint
    from unified.train.engine import initialize
    from unified.train.progress import MetricsSink
    from unified.train.trainer import CHECKPOINTS, export_model

    reward = _check_run(cfg)
    rc, tc, output = cfg.rlhf, cfg.train, Path(cfg.output)
    train_records, eval_records = _prompt_records(cfg)
    runtime = start_runtime(cfg.device, cfg.parallel, cfg.seed)
    roles = Roles.of(rc, torch.distributed.get_world_size())
    if roles.separate:
        import deepspeed

        from unified.runtime.role_layouts import init_role_layouts

        # DeepSpeed's communication setup (its shared-memory reduce on CPU) needs every rank, but only the
        # trainer ranks go on to deepspeed.initialize: set it up here, together.
        deepspeed.comm.init_distributed(runtime.accelerator.communication_backend_name())
        init_role_layouts(roles.blocks)  # the trainers data-parallel, each rollout engine its own layout
    trains = not roles.separate or roles.trains(torch.distributed.get_rank())
    if reward is None and trains:
        from unified.rlhf.reward_model import load_reward_model

        reward = load_reward_model(rc.reward_model, runtime.device, runtime.dtype)
    path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    train_prompts, eval_prompts = _prompts(train_records, tokenizer), _prompts(eval_records, tokenizer)
    loaded = load_model(path, runtime.device, runtime.dtype)
    model, lora = loaded.model, tc.lora.rank > 0
    if lora:
        apply_lora(model, tc.lora)  # on rollout ranks too: the adapters they receive go there
    reference = None
    if trains and not lora:
        reference = load_model(path, "cpu" if rc.reference_on_host else runtime.device, runtime.dtype).model
    steps = cfg.steps or 1
    tc.zero_stage = 0 if tc.zero_stage is None else tc.zero_stage

    def engine(group=None):
        return LLMEngine(model, tokenizer, _rollout_cache(cfg, train_prompts + eval_prompts), runtime.device,
                         runtime.dtype, runtime.accelerator, eos_ids(tokenizer, path), group=group)

    if roles.separate:
        rollouts = Separate(roles, model, lora, bucket_bytes=rc.sync_bucket_mb << 20)
        if not trains:
            rollouts.engine = engine(rollouts.engine_group)
    trainer = learner = None
    if trains:
        critic = value_head(model) if rc.algorithm == "ppo" else None
        trainer = initialize(model, tc, runtime.dtype, len(roles.trainers), steps,
                             PolicyObjective(model, rc, critic),
                             data_parallel_group=rollouts.trainer_group if roles.separate else None)
        whole = WholeWeights(trainer.module, partitioned=tc.zero_stage == 3)
        if roles.separate:
            rollouts.whole = whole
        else:
            with whole():
                rollouts = Colocated(engine(), model, whole, Share(torch.distributed.get_rank(), roles.world))
        learner = algorithm(rc.algorithm)(rollouts, trainer, reward, rc, reference, seed=cfg.seed,
                                          max_grad_norm=tc.max_grad_norm)
    output.mkdir(parents=True, exist_ok=True)
    checkpoints, trainer_group = output / CHECKPOINTS, rollouts.trainer_group if roles.separate else None
    start = checkpoint.resume(trainer, checkpoints, runtime.accelerator, lora) if trains and tc.resume else 0
    if roles.separate:
        box = [start]
        torch.distributed.broadcast_object_list(box, src=roles.trainers[0])
        start = box[0]
    if roles.separate or start:  # the rollout side starts from the trainer's weights (initial or resumed)
        rollouts.weights_changed()
    if start:
        log.info("continuing from the checkpoint of step %d in %s", start, checkpoints)
    order = list(range(len(train_prompts)))
    random.Random(cfg.seed).shuffle(order)
    sink = (MetricsSink(output, start, tc.wandb, tc.wandb_project,
                        OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else {})
            if trains and torch.distributed.get_rank() == 0 else None)  # the first trainer rank reports
    evaluate = bool(eval_prompts and rc.eval_every)
    eval_seed = cfg.seed + EVAL_SEED_OFFSET
    if evaluate and start == 0:
        before = _evaluate(rollouts, reward, eval_prompts, rc, eval_seed)
        if sink:
            sink.write({"step": 0, **before})
            log.info("held-out reward before training: %s on %d prompts", before, len(eval_prompts))
    with tqdm(total=steps, initial=start, desc=rc.algorithm, disable=sink is None) as bar:
        for step in range(start, steps):
            chosen = [train_prompts[order[(step * rc.prompts_per_step + i) % len(order)]]
                      for i in range(rc.prompts_per_step)]
            saves = (tc.save_every and (step + 1) % tc.save_every == 0) or step + 1 == steps
            if not trains:  # a rollout rank: the learner's collectives, in the learner's order
                rollouts.generate([p.ids for p in chosen], rc.num_generations, rc.max_tokens, rc.temperature,
                                  rollout_seed(cfg.seed, step, len(chosen), rc.num_generations))
                rollouts.weights_changed()
            else:
                learner.steps = step  # the rollouts' seeds and the prompts' order follow the step
                metrics = {"step": step + 1, **learner.step(chosen)}
            if evaluate and ((step + 1) % rc.eval_every == 0 or step + 1 == steps):
                result = _evaluate(rollouts, reward, eval_prompts, rc, eval_seed)
                if trains:
                    metrics.update(result)
            if not trains:
                if saves:
                    rollouts.checkpoint_saved()
                continue
            if sink:
                sink.write(metrics)  # before the checkpoint: a resumed run drops lines past its step, never misses one
            if saves:
                checkpoint.save(trainer, checkpoints, step + 1, runtime.accelerator, tc.keep_checkpoints, lora,
                                trainer_group)
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.4f}",
                            logp_diff=f"{metrics['sampling/sampling_logp_difference/mean']:.1e}")
            bar.update()
    if sink:
        sink.close()
    if trains:
        if learner.value_head is not None:
            with whole():  # ZeRO-3 partitions the head too
                if torch.distributed.get_rank() == 0:  # alike on every trainer rank
                    _save_value_head(learner.value_head, output)
        export_model(trainer, loaded, tc, output)
    torch.distributed.barrier()
    return sink.history if sink else []
