"""TRL's GRPOTrainer as the peer of bench/rlhf.py, run in bench/.venv-trl (see bench/setup_trl.sh).

    bench/.venv-trl/bin/python bench/peers/trl_grpo.py --model DIR --data PROMPTS.jsonl --output DIR
        --steps N --prompts-per-step P --num-generations G --max-tokens T --lr LR --lora-rank R --lora-alpha A

The workload of `unified recipe=grpo` as TRL spells it: the same prompt lines (chat `messages` plus the
reasoning-gym `entry`, scored by our `unified.rlhf.tasks:task_reward`), P x G completions sampled with
`transformers` generate at temperature 1 (fp32, CPU), one optimizer update per batch (one micro-batch, no
gradient accumulation or checkpointing), LoRA through peft, a constant learning rate, no KL term. Every step
appends one line to <output>/metrics.jsonl under our metric names (`timing/rollout_s`, `rollout_tok_s`,
`completions/mean_length`, ...), so bench/rlhf.py reads both sides the same way. The rollout time is that of
TRL's generation call (`_generate_single_turn`: generate, then the cut at the first EOS).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from unified.rlhf import tasks

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # a Llama's


def task_reward(prompts, completions, entry, **_fields) -> list[float]:
    """Our default reward over TRL's chat completions; entries travel as JSON text (an Arrow column of nested
    dicts would have to share one schema)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return tasks.task_reward(prompts, texts, entry=[json.loads(e) for e in entry])


class TimedGRPOTrainer(GRPOTrainer):
    """Logs the time and the completion tokens of each rollout beside TRL's own metrics."""

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        started = time.perf_counter()
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        seconds = time.perf_counter() - started
        self._metrics["train"]["timing/rollout_s"].append(seconds)
        self._metrics["train"]["rollout_tok_s"].append(sum(len(ids) for ids in completion_ids) / seconds)
        return completion_ids, logprobs


class MetricsSink(TrainerCallback):
    """One JSON line per logged training step (TRL logs every step here)."""

    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "timing/rollout_s" in logs:
            with self.path.open("a") as sink:
                sink.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def dataset(path: Path) -> Dataset:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return Dataset.from_list([{"prompt": r["messages"], "entry": json.dumps(r["entry"])} for r in records])


def grpo_config(args) -> GRPOConfig:
    batch = args.prompts_per_step * args.num_generations
    return GRPOConfig(
        output_dir=str(args.output), max_steps=args.steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_generations=args.num_generations, num_iterations=1,
        max_completion_length=args.max_tokens, temperature=1.0, beta=0.0, epsilon=0.2, scale_rewards="group",
        loss_type="dapo",  # token-level mean over the batch, as our rlhf.loss_level=token
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        activation_checkpointing=False, bf16=False, use_cpu=True, seed=0, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, model_init_kwargs={"dtype": torch.float32})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    for name in ("--steps", "--prompts-per-step", "--num-generations", "--max-tokens", "--lora-rank"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--lora-alpha", type=float, required=True)
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM")
    trainer = TimedGRPOTrainer(model=args.model, reward_funcs=task_reward, args=grpo_config(args),
                               train_dataset=dataset(args.data), peft_config=lora,
                               callbacks=[MetricsSink(args.output / "metrics.jsonl")])
    trainer.train()


if __name__ == "__main__":
    main()
