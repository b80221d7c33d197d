"""The shared model wrapped for training by DeepSpeed: ZeRO stage, offload, precision, optimizer, schedule.

`TrainingModel` puts the loss inside one module forward, so that ZeRO-3 gathers every weight the loss
reads (the tied embedding used as the head included). The loss is the sum of token losses scaled so that,
after DeepSpeed divides by the accumulation steps and averages over data-parallel ranks, the gradient
is that of the mean over every target token of the whole optimizer step, whatever the number of
targets in each rank's rows; a curve is then the same on one rank and on many.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from unified.config.schema import TrainConfig
from unified.errors import UserError
from unified.model.forward_context import forward_context
from unified.model.transformer import CausalLM
from unified.runtime.host_memory import release_freed_host_memory
from unified.train.data import IGNORE
from unified.train.packing import Batch, PackedAttention


class TrainingModel(nn.Module):
    def __init__(self, model: CausalLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                segments: torch.Tensor, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of the cross-entropy of every target token in the micro-batch. Images (vision-language models)
        are encoded here, so the tower and projector get gradients when they train; with the language model
        frozen, backward still runs through it to reach them."""
        from megatron.core import parallel_state

        images = {}
        if pixel_values is not None:
            images["image_embeds"] = self.model.encode_images(pixel_values, image_grid_thw)  # [image tokens, H]
        with forward_context(PackedAttention(segments)):
            hidden = self.model(input_ids, positions, **images)  # [B, L, H]
        keep = targets != IGNORE
        hidden, targets = hidden[keep], targets[keep]  # [N, H], [N]: the head runs on target positions only
        logits = self.model.vocab_parallel_logits(hidden).float()  # [N, V / tp]
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return F.cross_entropy(logits, targets, reduction="sum")
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits, targets).sum()


class MegatronGroups:
    """megatron-core's parallel_state in the shape DeepSpeed asks of an `mpu`; `data_parallel_group`
    replaces its data-parallel group (when only some of the world's ranks train)."""

    def __init__(self, data_parallel_group=None):
        self._data_parallel_group = data_parallel_group

    def get_data_parallel_group(self, *args, **kwargs):
        if self._data_parallel_group is not None:
            return self._data_parallel_group
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group(*args, **kwargs)

    def get_data_parallel_world_size(self, *args, **kwargs) -> int:
        return torch.distributed.get_world_size(self.get_data_parallel_group())

    def get_data_parallel_rank(self, *args, **kwargs) -> int:
        return torch.distributed.get_rank(self.get_data_parallel_group())

    def __getattr__(self, name):
        from megatron.core import parallel_state

        return getattr(parallel_state, name)

    def get_model_parallel_rank(self) -> int:
        return torch.distributed.get_rank(self.get_model_parallel_group())

    def get_model_parallel_world_size(self) -> int:
        return torch.distributed.get_world_size(self.get_model_parallel_group())


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine, linear or constant down to `min_lr_ratio`."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


WANDB_MODES = ("offline", "online", "disabled")
TRAINABLE = ("all", "vision", "projector")


def check_train_config(cfg: TrainConfig) -> None:
    """Every option a user can get wrong, checked before anything is loaded."""
    if cfg.zero_stage not in (None, 0, 1, 2, 3):
        raise UserError(f"train.zero_stage={cfg.zero_stage} is not a ZeRO stage; choose 0, 1, 2 or 3")
    if cfg.schedule not in ("cosine", "linear", "constant"):
        raise UserError(f"train.schedule={cfg.schedule!r} is unknown; choose cosine, linear or constant")
    if cfg.offload_params and cfg.zero_stage not in (None, 3):
        raise UserError("train.offload_params needs train.zero_stage=3 (only ZeRO-3 partitions parameters)")
    if cfg.offload_optimizer and cfg.zero_stage == 0:
        raise UserError("train.offload_optimizer needs train.zero_stage 1, 2 or 3")
    if cfg.wandb not in WANDB_MODES:
        raise UserError(f"train.wandb={cfg.wandb!r} is unknown; choose {', '.join(WANDB_MODES)}")
    if cfg.trainable not in TRAINABLE:
        raise UserError(f"train.trainable={cfg.trainable!r} is unknown; choose {', '.join(TRAINABLE)}")
    if cfg.trainable != "all" and cfg.lora.rank > 0:
        raise UserError(f"train.trainable={cfg.trainable} and LoRA (train.lora.rank={cfg.lora.rank}) both choose "
                        "what trains; use one of them")
    for name in ("micro_batch_size", "gradient_accumulation_steps", "seq_len", "epochs"):
        if getattr(cfg, name) < 1:
            raise UserError(f"train.{name}={getattr(cfg, name)} must be at least 1")
    for name, low, high in (("lr", 0.0, math.inf), ("max_grad_norm", 0.0, math.inf), ("weight_decay", 0.0, math.inf),
                            ("min_lr_ratio", 0.0, 1.0), ("warmup_steps", 0, math.inf), ("lora.rank", 0, math.inf),
                            ("lora.dropout", 0.0, 0.999)):
        value = functools.reduce(getattr, name.split("."), cfg)
        if not (math.isfinite(value) and low <= value <= high):
            raise UserError(f"train.{name}={value} must be "
                            + (f"between {low:g} and {high:g}" if math.isfinite(high) else f"at least {low:g}"))
    if cfg.lora.rank > 0 and not cfg.lora.alpha > 0:
        raise UserError(f"train.lora.alpha={cfg.lora.alpha}: LoRA scales its adapters by alpha / rank, so give a "
                        f"positive alpha (twice the rank is common)")


def resolve_zero_stage(cfg: TrainConfig, dp_size: int) -> int:
    """The ZeRO stage to run: the configured one, or by default 1 where there is something to partition."""
    if cfg.zero_stage is not None:
        return cfg.zero_stage
    return 3 if cfg.offload_params else 1 if dp_size > 1 or cfg.offload_optimizer else 0


def deepspeed_config(cfg: TrainConfig, dtype: torch.dtype, dp_size: int) -> dict:
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "train_batch_size": cfg.micro_batch_size * cfg.gradient_accumulation_steps * dp_size,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # a torch optimizer: no JIT-compiled DeepSpeed op needed
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 1 << 30,
        # Every rank always saves under the same tag; DeepSpeed's check of that is an all-reduce over the
        # whole world, which an RLHF run's rollout ranks (no DeepSpeed engine of their own) could not join.
        "checkpoint": {"tag_validation": "Ignore"},
    }
    # Always explicit: DeepSpeed clips at 1.0 when the key is absent. fp32 without ZeRO: `micro_step` clips.
    config["gradient_clipping"] = cfg.max_grad_norm if cfg.zero_stage != 0 or dtype != torch.float32 else 0.0
    if cfg.offload_optimizer:  # offloaded state is stepped by DeepSpeed's CPU Adam, which it builds itself
        config["optimizer"] = {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay}}
    return config


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]


def initialize(model: CausalLM, cfg: TrainConfig, dtype: torch.dtype, dp_size: int, total_steps: int,
               objective: nn.Module | None = None, data_parallel_group=None):
    """Returns the DeepSpeed engine around `objective`, a module holding `model` whose forward computes
    the loss (by default `TrainingModel(model)`, the token cross-entropy). `data_parallel_group`: the
    training ranks, when they are not the whole world's data-parallel group."""
    import deepspeed

    wrapped = objective if objective is not None else TrainingModel(model)
    if cfg.zero_stage == 3 and model.lm_head is None and model.embed is not None:
        deepspeed.zero.register_external_parameter(wrapped, model.embed.weight)  # the tied head reads it
    config = deepspeed_config(cfg, dtype, dp_size)
    groups = _param_groups(wrapped, cfg.weight_decay)
    optimizer = None if "optimizer" in config else torch.optim.AdamW(groups, lr=cfg.lr)
    if optimizer is not None and _on_host(model):  # (see backward_and_step) ZeRO frees the gradients it flattened
        optimizer.register_step_pre_hook(_release_before_update)
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps, cfg))  # noqa: E731
    engine, *_ = deepspeed.initialize(model=wrapped, optimizer=optimizer, model_parameters=groups,
                                      lr_scheduler=schedule, config=config,
                                      mpu=MegatronGroups(data_parallel_group))
    if cfg.zero_stage == 0 and dp_size == 1:  # one data-parallel rank: no gradient all-reduce (a flat copy for nothing)
        engine.enable_backward_allreduce = False
    return engine


def micro_step(engine, batch: Batch, loss_scale: float, max_grad_norm: float = 0.0) -> torch.Tensor:
    """Forward and backward of one micro-batch, and the optimizer step at an accumulation boundary; returns
    the micro-batch's unscaled token-loss sum."""
    loss_sum = engine(batch.input_ids, batch.positions, batch.targets, batch.segments, batch.pixel_values,
                      batch.image_grid_thw)
    backward_and_step(engine, loss_sum * loss_scale, max_grad_norm)
    return loss_sum.detach()


def backward_and_step(engine, loss: torch.Tensor, max_grad_norm: float = 0.0) -> None:
    """engine.backward and engine.step, clipping where DeepSpeed would not. Training on the host, the freed
    activations go back to the system before the step: glibc keeps freed blocks under its mmap threshold (up to
    32 MiB) in its heap, and the step's large buffers (flat float32 gradients, AdamW's temporaries) are mappings
    of their own, so without it the step's peak holds the step's buffers on top of every activation of the
    micro-batch, as if both were alive. Likewise at the end of backward, before DeepSpeed reduces what is left in
    its gradient bucket (ZeRO-3's reduce-scatter makes a flat copy of it)."""
    if loss.requires_grad and _on_host(engine.module):
        loss.register_hook(_release_after_backward)
    engine.backward(loss)
    if not engine.is_gradient_accumulation_boundary():
        engine.step()  # (DeepSpeed counts the micro-batch)
        return
    if max_grad_norm > 0 and not engine.gradient_clipping():
        engine.grad_norm = clip_gradients(engine, max_grad_norm)
    if _on_host(engine.module):
        release_freed_host_memory()
    engine.step()


def _release_before_update(*_) -> None:
    release_freed_host_memory()


def _release_after_backward(_grad: torch.Tensor) -> None:
    """A hook on the loss, the first gradient of backward: queues the release for when autograd is done."""
    torch.autograd.Variable._execution_engine.queue_callback(_release_before_update)


def _on_host(module: nn.Module) -> bool:
    return next(module.parameters()).device.type == "cpu"


def clip_gradients(engine, max_norm: float) -> float:
    """Clips the (reduced) fp32 gradients to `max_norm` as DeepSpeed does without ZeRO, and returns their
    norm before clipping, which its engine computes but does not keep in that case."""
    from deepspeed.runtime.utils import clip_grad_norm_

    return float(clip_grad_norm_(engine.module.parameters(), max_norm, mpu=MegatronGroups()))


def grad_norm(engine) -> float | None:
    """The last optimizer step's gradient norm before clipping (None when nothing clips at ZeRO stage 0)."""
    norm = getattr(engine, "grad_norm", None) if engine.gradient_clipping() == 0 else engine.get_global_grad_norm()
    return None if norm is None else float(norm)
