"""`recipe=sft` and `recipe=lora`: fine-tune the shared model and write a servable checkpoint.

The run: runtime and process groups, the model loaded exactly as serving loads it, the data planned
into steps (see packing), DeepSpeed around the model, then steps until `steps` (or the epochs) are done,
saving resumable checkpoints on the way. A vision-language model trains on image+text lines; with
`train.trainable` = vision or projector only that part of it trains (the language model frozen). At the end `output` holds a merged HF-layout checkpoint that
`recipe=serve model=<output>` serves, and for LoRA `<output>/adapter` holds the adapter alone.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from unified.errors import UserError
from unified.runtime.memory_report import log_against_plan
from unified.train import checkpoint
from unified.train.engine import check_train_config, resolve_zero_stage
from unified.train.packing import RowStream, collate
from unified.train.progress import StepRecord, TrainLog

log = logging.getLogger(__name__)
CHECKPOINTS = "checkpoints"
ADAPTER = "adapter"


@dataclass
class TrainResult:
    output: Path
    history: list[StepRecord]  # rank 0's record of every step (empty on other ranks)
    trainable_parameters: int


def _check_run(cfg) -> Path:
    if not cfg.data:
        raise UserError("training needs data: unified recipe=sft data=<train.jsonl> output=<dir> [model=...]")
    if not cfg.output:
        raise UserError("training needs output=<dir> for checkpoints and the fine-tuned model")
    if cfg.steps is not None and cfg.steps < 1:
        raise UserError(f"steps={cfg.steps} must be at least 1")
    check_train_config(cfg.train)
    if cfg.parallel.pipeline > 1 or cfg.parallel.expert > 1:
        raise UserError("training runs tensor and data parallel (and ZeRO); pipeline and expert parallel "
                        "training are not supported yet: use parallel=single or parallel=tp2")
    return Path(cfg.output)


def _check_kv_heads(config, tp: int) -> None:
    if tp > 1 and config.mla is None and config.num_kv_heads % tp:
        raise UserError(f"training with tensor parallel size {tp} needs it to divide the {config.num_kv_heads} KV "
                        f"heads (serving replicates them, but the replicas would drift apart in training); use "
                        f"parallel.tensor={max(d for d in range(1, tp) if config.num_kv_heads % d == 0)}")


def _check_sequence_parallel(config, tc, tp: int) -> None:
    if not tc.sequence_parallel:
        return
    if tp < 2:
        raise UserError("train.sequence_parallel splits the sequence over tensor-parallel ranks; it needs "
                        "parallel.tensor of 2 or more")
    if config.mla is not None or config.moe is not None or tc.lora.rank > 0:
        raise UserError("train.sequence_parallel supports dense attention models with full fine-tuning; turn it "
                        "off for MLA, MoE or LoRA runs")


def _image_support(config, path: Path, data: str):
    """How the data's image parts become model input, or None for a text-only model."""
    if config.vision is None:
        return None
    from unified.train.data import ImageSupport
    from unified.vision import processor_for

    return ImageSupport(processor_for(path), config.image_token_id, Path(data).parent)


def _check_images(config, examples, tc) -> None:
    with_images = sum(e.pixel_values is not None for e in examples)
    if with_images and config.mrope_section:
        raise UserError(f"training {config.vision.kind} on images needs M-RoPE positions, which training does not "
                        "compute yet; LLaVA-layout models train on images (text-only lines train this model)")
    if tc.trainable != "all" and with_images < len(examples):
        raise UserError(f"train.trainable={tc.trainable} trains only the image path, but {len(examples) - with_images} "
                        f"of {len(examples)} examples have no image; give every line an image part or train all")


def _freeze_all_but(model, trainable: str) -> None:
    """train.trainable: the vision tower and projector (vision) or the projector alone; the rest is frozen."""
    if trainable == "all":
        return
    vision = getattr(model, "vision", None)
    if vision is None:
        raise UserError(f"train.trainable={trainable} trains the vision side, but the model is text-only; "
                        "use train.trainable=all (or LoRA)")
    keep = vision if trainable == "vision" else vision.projector if hasattr(vision, "projector") else vision.merger
    for param in model.parameters():
        param.requires_grad_(False)
    for param in keep.parameters():
        param.requires_grad_(True)


def _sum_partial_grads(model, tc) -> None:
    """Replicated weights whose tensor-parallel ranks each see part of the work get the sum of the ranks'
    gradients: qk-norms (shared by heads the ranks split) and, with sequence parallel, every weight used
    on the split sequence."""
    from megatron.core import parallel_state

    from unified.model import sequence_parallel
    from unified.model.norm import RMSNorm
    from unified.model.parallel_layers import RowLinear

    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1:
        return
    params = {id(p): p for p in model.parameters() if getattr(p, "partial_grad_over_tp", False)}
    if tc.sequence_parallel:
        model.sequence_parallel = True
        params |= {id(m.weight): m.weight for m in model.modules() if isinstance(m, RMSNorm)}
        params |= {id(m.bias): m.bias for m in model.modules() if isinstance(m, RowLinear) and m.bias is not None}
    sequence_parallel.sum_partial_grads([p for p in params.values() if p.requires_grad], group)


def _gathered(engine, zero_stage: int):
    """Full parameters for export: ZeRO-3 holds only a partition of each on every rank."""
    if zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)


def export_model(engine, loaded, tc, output: Path) -> None:
    """Writes the servable HF checkpoint to `output` (LoRA merged, the adapter beside it in `output/adapter`)."""
    from unified.checkpoint.loader import export_hf

    with _gathered(engine, tc.zero_stage):
        if tc.lora.rank > 0:
            from unified.checkpoint.lora import merge_lora, save_adapter

            save_adapter(loaded.model, output / ADAPTER, base_model=str(loaded.path))  # collective, like export_hf
            merge_lora(loaded.model)
        export_hf(loaded, output)  # every tensor-parallel rank takes part; rank 0 writes
    log.info("wrote the fine-tuned model to %s", output)


def train(cfg) -> TrainResult:
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    from unified.checkpoint import load_model
    from unified.checkpoint.builtin import resolve_model
    from unified.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from unified.runtime import start_runtime
    from unified.train.data import load_examples
    from unified.train.engine import grad_norm, initialize, micro_step

    output = _check_run(cfg)
    tc = cfg.train
    runtime = start_runtime(cfg.device, cfg.parallel, cfg.seed)
    path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = model_config_from_hf(read_hf_config(path))
    examples = load_examples(cfg.data, tokenizer, tc.seq_len, _image_support(config, path, cfg.data))
    _check_images(config, examples, tc)
    _check_kv_heads(config, cfg.parallel.tensor)
    _check_sequence_parallel(config, tc, cfg.parallel.tensor)
    loaded = load_model(path, runtime.device, runtime.dtype)
    model = loaded.model
    model.train()
    model.checkpoint_layers = tc.activation_checkpointing
    lora = tc.lora.rank > 0
    if lora:
        from unified.checkpoint.lora import apply_lora

        apply_lora(model, tc.lora)
    _freeze_all_but(model, tc.trainable)
    partial = lora or tc.trainable != "all"  # checkpoints hold only what trains
    _sum_partial_grads(model, tc)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    micro, accumulation = tc.micro_batch_size, tc.gradient_accumulation_steps
    rows_per_step = micro * dp * accumulation
    stream = RowStream(examples, tc.seq_len, tc.packing, tc.shuffle, cfg.seed)
    steps = cfg.steps or max(1, math.ceil(stream.rows_in_epochs(tc.epochs) / rows_per_step))
    tc.zero_stage = resolve_zero_stage(tc, dp)
    engine = initialize(model, tc, runtime.dtype, dp, steps)

    output.mkdir(parents=True, exist_ok=True)
    checkpoints = output / CHECKPOINTS
    start = checkpoint.resume(engine, checkpoints, runtime.accelerator, partial) if tc.resume else 0
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        log.info("training %s parameters of %s (%.2f%%) for %d steps from step %d; %d examples, %d rows per step",
                 f"{trainable:,}", f"{total:,}", 100 * trainable / total, steps, start, len(examples), rows_per_step)
    report = TrainLog(output, steps, start, rank0, tc.wandb, tc.wandb_project,
                      {"model": str(path), "steps": steps, "dp": dp, "tp": cfg.parallel.tensor,
                       "zero_stage": tc.zero_stage, "lora_rank": tc.lora.rank, "lr": tc.lr,
                       "trainable": tc.trainable})
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dp_group = parallel_state.get_data_parallel_group()
    for step in range(start, steps):
        began = time.perf_counter()
        rows = stream.rows(step * rows_per_step, rows_per_step)
        loss_scale = dp * accumulation / stream.num_targets(rows)
        totals = torch.zeros(2, dtype=torch.float64, device=runtime.device)  # token-loss sum, tokens (NCCL: on the device)
        lr = engine.get_lr()[0]
        for m in range(accumulation):
            mine = rows[(m * dp + dp_rank) * micro:(m * dp + dp_rank + 1) * micro]
            batch = collate(examples, mine, pad_id, cfg.parallel.tensor if tc.sequence_parallel else 1)
            totals[0] += float(micro_step(engine, batch.to(runtime.device), loss_scale, tc.max_grad_norm))
            totals[1] += batch.num_tokens
        torch.distributed.all_reduce(totals, group=dp_group)
        report.step(StepRecord(step + 1, float(totals[0]) / stream.num_targets(rows), lr, grad_norm(engine),
                               int(totals[1]), time.perf_counter() - began))
        if step == start:  # the optimizer's state exists from the first step on
            log_against_plan("after the first training step", runtime.device)
        if tc.save_every and (step + 1) % tc.save_every == 0 and step + 1 < steps:
            checkpoint.save(engine, checkpoints, step + 1, runtime.accelerator, tc.keep_checkpoints, partial)
            report.plot()
    if start < steps:
        checkpoint.save(engine, checkpoints, steps, runtime.accelerator, tc.keep_checkpoints, partial)
    report.close()
    export_model(engine, loaded, tc, output)
    torch.distributed.barrier()
    return TrainResult(output, report.history, trainable)
