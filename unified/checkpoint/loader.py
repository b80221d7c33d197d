"""Loading an HF checkpoint folder into our model, and exporting our model back to HF layout.

The model is built directly on the target device with uninitialised storage, then every parameter is
filled from the checkpoint; a tensor-parallel rank reads only its slice of each tensor (`param_sources`
says which, for any rank: the pre-sharding converter uses it too), an expert-parallel rank only its
experts, a pipeline stage only its layers. A pre-sharded folder (manifest.json) is read by
presharded_loader instead: each rank maps its own file. Nothing is left uninitialised: a parameter the
checkpoint does not cover is an error.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from unified.checkpoint.hf_config import model_config_from_hf, read_hf_config
from unified.checkpoint.hf_names import Param, parameter_map
from unified.checkpoint.hf_vision_names import in_checkpoint_layout
from unified.checkpoint.manifest import is_presharded
from unified.checkpoint.prefetch import prefetched
from unified.checkpoint.presharded_loader import RankFile, fill_from_rank_file, open_rank_file
from unified.checkpoint.quantized import dequantizing, quantization_config, stored_int4_group
from unified.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint, save_safetensors
from unified.model.config import ModelConfig
from unified.model.multimodal import VisionLanguageModel
from unified.model.transformer import CausalLM
from unified.runtime import check_layout, current_layout, layout_world

# Files that travel with the weights: tokenizer, chat template, generation defaults, image processor.
SIDECAR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
                 "preprocessor_config.json", "processor_config.json")
MAPPED_WHILE_LOADING = 64 << 20  # checkpoint bytes a loading rank keeps mapped at most (besides one read ahead)


@dataclass
class LoadedModel:
    model: CausalLM  # a VisionLanguageModel for vision-language checkpoints
    config: ModelConfig
    hf_config: object  # the transformers config the checkpoint was read with
    path: Path


def _tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _ep_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


class FullTensors(dict):
    """Whole tensors by HF name, read the way the loader reads a checkpoint (so `_read_part` slices them)."""

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self[name].shape)

    def get_slice(self, name: str) -> torch.Tensor:
        return self[name]


def part_sizes(param: Param, local_row: int, tp: int) -> tuple[list[int], list[int], list[int | None]]:
    """For one row of `param` holding `local_row` entries along its cat_dim on a rank of `tp`: each HF
    part's (whole length, this rank's length, heads: None unless the part is split by heads)."""
    names = len(param.rows[0])
    full = list(param.sizes) if param.sizes else [local_row * tp // names] * names
    heads = [None if not param.unit else n // param.unit for n in full]
    local = [n // tp if h is None or h >= tp else param.unit for n, h in zip(full, heads)]
    return full, local, heads


@dataclass(frozen=True)
class Shard:
    """Which slice of the model one rank holds: its tensor- and expert-parallel rank and group size. (Its
    pipeline stage decides which parameters it has at all: unified.model.transformer.stage_holds.)"""
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


def current_shard() -> Shard:
    return Shard(*_tp_rank_size(), *_ep_rank_size())


@dataclass(frozen=True)
class PartSlice:
    """What a rank reads of one HF tensor: all of it (`dim` None), or `length` entries from `start` along `dim`."""
    name: str
    dim: int | None = None
    start: int = 0
    length: int = 0


def part_slice(ckpt: SafetensorsCheckpoint, name: str, split: int | None, rank: int, size: int,
               unit: int | None = None) -> PartSlice:
    if split is None or size == 1:
        return PartSlice(name)
    full = ckpt.shape(name)
    if unit and full[split] // unit < size:  # fewer heads than ranks: this rank's head, replicated
        length = unit
        start = rank * (full[split] // unit) // size * unit
    elif full[split] % size:
        raise CheckpointError(f"tensor {name!r} ({ckpt.file_of(name).name}) has {full[split]} rows along "
                              f"dimension {split}, which tensor parallel size {size} does not divide")
    else:
        length = full[split] // size
        start = rank * length
    return PartSlice(name, split, start, length)


def read_part(ckpt: SafetensorsCheckpoint, part: PartSlice) -> torch.Tensor:
    """Only the bytes of the slice are read (a lazy safetensors view indexed by the slice)."""
    if part.dim is None:
        return ckpt.get(part.name)
    view, end = ckpt.get_slice(part.name), part.start + part.length
    return view[part.start:end] if part.dim == 0 else view[:, part.start:end]


def _read_part(ckpt: SafetensorsCheckpoint, name: str, split: int | None, rank: int, size: int,
               unit: int | None = None) -> torch.Tensor:
    return read_part(ckpt, part_slice(ckpt, name, split, rank, size, unit))


def param_sources(ckpt: SafetensorsCheckpoint, param: Param, shard: Shard) -> list[list[PartSlice]]:
    """The HF slices `shard`'s copy of `param` is made of: per row (one per local expert), its parts in order."""
    rows = param.rows
    if param.is_experts:
        local = len(rows) // shard.ep_size
        rows = rows[shard.ep_rank * local:(shard.ep_rank + 1) * local]
    return [[part_slice(ckpt, n, param.split, shard.tp_rank, shard.tp_size, param.unit) for n in row] for row in rows]


def assemble(ckpt: SafetensorsCheckpoint, param: Param, shard: Shard) -> torch.Tensor:
    """`shard`'s copy of `param`, read from the HF checkpoint: parts concatenated, rows stacked."""
    rows = [torch.cat([_weight_part(ckpt, p) for p in row], dim=param.cat_dim) if len(row) > 1
            else _weight_part(ckpt, row[0]) for row in param_sources(ckpt, param, shard)]
    return torch.stack(rows) if param.stacked else rows[0]


def _weight_part(ckpt: SafetensorsCheckpoint, part: PartSlice) -> torch.Tensor:
    """`read_part`, refusing a weight still in a quantized form (integers or float8: no quantization_config said
    how to read it, or its scale is missing), whose values would otherwise be copied as if they were the weights."""
    tensor = read_part(ckpt, part)
    if not tensor.is_floating_point() or tensor.element_size() == 1:
        raise CheckpointError(f"{part.name!r} ({ckpt.file_of(part.name).name}) is stored as {tensor.dtype}, a "
                              f"quantized form, but nothing in {ckpt.directory} says how to read it: config.json has "
                              f"no quantization_config for it, or the scale tensor beside it is missing; the "
                              f"checkpoint is incomplete: re-export it")
    return tensor


def _check_head(path: Path, hf, found: int | None, wanted: int | None) -> None:
    """The checkpoint's head (an LM head, or a classifier's `found` labels) is the one asked for."""
    kind = ", ".join(getattr(hf, "architectures", None) or [hf.model_type])
    if wanted is None and found is not None:
        raise CheckpointError(f"{path} holds a sequence classifier ({kind}): it scores text and has no LM head to "
                              f"generate with; point model= at a causal LM (a reward model goes in rlhf.reward_model=)")
    if wanted is not None and found is None:
        raise CheckpointError(f"{path} holds {kind}, not a sequence classifier; this needs an HF "
                              f"*ForSequenceClassification checkpoint (e.g. LlamaForSequenceClassification) with "
                              f"num_labels={wanted}")
    if found != wanted:
        raise CheckpointError(f"{path} holds {kind} with num_labels={found} (config.json), but num_labels={wanted} "
                              f"is needed here; use a checkpoint trained with num_labels={wanted}")


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               progress: Callable[[int, int], None] | None = None, num_labels: int | None = None,
               verify_checksums: bool = True) -> LoadedModel:
    """From an HF checkpoint folder or a pre-sharded one (recipe=convert; it holds manifest.json).
    `progress(done, total)` is called after each model tensor is filled (servers report it while starting).
    `num_labels` None asks for a causal LM; a number, for a sequence classifier with that many outputs.
    `verify_checksums`: a pre-sharded folder's tensors are checked against their checksums as they are read
    (unified/checkpoint/digests.py)."""
    path = Path(path)
    hf = read_hf_config(path)
    config = model_config_from_hf(hf)
    _check_head(path, hf, config.num_labels, num_labels)
    presharded = is_presharded(path)
    source = None if presharded else dequantizing(SafetensorsCheckpoint(path), hf)  # reads the headers only
    layout = current_layout()
    check_layout(layout, layout_world(), config)  # before reading any weight
    if presharded:
        source = open_rank_file(path, layout, verify_checksums)
    with torch.device(device):
        model = VisionLanguageModel(config, dtype) if config.vision else CausalLM(config, dtype)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        if isinstance(source, RankFile):
            filled = fill_from_rank_file(source, targets, progress)
        else:
            filled = _fill_from_hf(source, in_checkpoint_layout(parameter_map(config), config, source.has), targets,
                                   path, progress)
    unfilled = [n for n in dict(model.named_parameters()) if n not in filled]
    if unfilled and isinstance(source, RankFile):
        raise CheckpointError(f"{source.path} holds no {', '.join(unfilled[:3])}{' ...' if len(unfilled) > 3 else ''} "
                              f"(manifest.json), which the model built from {path / 'config.json'} has; the folder is "
                              f"incomplete: convert again")
    assert not unfilled, f"parameters not covered by the HF name map: {unfilled}"
    model.int4_group = stored_int4_group(hf)
    stored = source.quantization if isinstance(source, RankFile) else quantization_config(hf)
    model.quantized_source = stored is not None
    model.eval()
    return LoadedModel(model, config, hf, path)


def _fill_from_hf(ckpt: SafetensorsCheckpoint, params: list[Param], targets: dict[str, torch.Tensor], path: Path,
                  progress: Callable[[int, int], None] | None) -> set[str]:
    """Copies this rank's slice of every parameter it holds (another pipeline stage's are skipped); the
    next parameters are read in a background thread while the current one is copied. The files are unmapped
    after every MAPPED_WHILE_LOADING bytes read, so that the checkpoint pages a rank touched do not stay in
    its resident memory beside the weights they were copied into until the end of the load."""
    shard = current_shard()
    mine = [p for p in params if p.ours in targets]
    mapped = 0
    for done, (param, tensor) in enumerate(prefetched(mine, lambda p: assemble(ckpt, p, shard)), start=1):
        target = targets[param.ours]
        if tuple(tensor.shape) != tuple(target.shape):
            parts = ", ".join(f"{n} {ckpt.shape(n)} in {ckpt.file_of(n).name}" for row in param.rows[:1] for n in row)
            raise CheckpointError(f"shape mismatch: {parts} give {tuple(tensor.shape)} but the model built "
                                  f"from {path / 'config.json'} expects {tuple(target.shape)} for {param.ours}; "
                                  f"config.json and the weights disagree")
        target.copy_(tensor)
        mapped += tensor.numel() * tensor.element_size()
        if mapped >= MAPPED_WHILE_LOADING:
            ckpt.release_mappings()
            mapped = 0
        if progress:
            progress(done, len(mine))
    return {p.ours for p in mine}


def _gather_part(part: torch.Tensor, dim: int, heads: int | None, group) -> torch.Tensor:
    """The whole of one tensor-parallel part from every rank's slice; a part of `heads` heads that the
    ranks replicate (fewer heads than ranks) is rebuilt from one rank per head."""
    size = group.size()
    pieces = [torch.empty_like(part) for _ in range(size)]
    torch.distributed.all_gather(pieces, part.contiguous(), group=group)
    if heads is not None and heads < size:
        pieces = [pieces[min(r for r in range(size) if r * heads // size == h)] for h in range(heads)]
    return torch.cat(pieces, dim=dim)


def hf_tensors(model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """Our parameters under HF names and layouts, one whole tensor at a time on the model's device (views of
    the parameters where nothing had to be gathered). Under tensor parallelism every rank of the group must
    go through all of them (the slices are gathered); each gets the whole tensors."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    for param in parameter_map(model.config):
        if param.ours not in state:
            continue  # another pipeline stage holds it
        tensor = state[param.ours].detach()
        rows = tensor.unbind(0) if param.stacked else [tensor]
        tp = group.size() if param.split is not None else 1
        for names, row in zip(param.rows, rows):
            full, local, heads = part_sizes(param, row.shape[param.cat_dim], tp)
            for name, part, h in zip(names, row.split(local, dim=param.cat_dim), heads):
                yield name, (_gather_part(part, param.split, h, group) if tp > 1 else part)


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """`hf_tensors` as a dict of contiguous host tensors (a collective under tensor parallelism, likewise)."""
    return {name: tensor.contiguous().cpu() for name, tensor in hf_tensors(model)}


def export_hf(loaded: LoadedModel, out_dir: str | Path, max_shard_bytes: int = 5 * 1024 ** 3) -> Path:
    """Writes config.json, safetensors shards and the tokenizer files of the source checkpoint. Under
    tensor parallelism every rank calls it and global rank 0 writes."""
    state = hf_state_dict(loaded.model)
    out_dir = Path(out_dir)
    if torch.distributed.get_rank() != 0:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, out_dir, max_shard_bytes)
    loaded.hf_config.save_pretrained(out_dir)
    for name in SIDECAR_FILES:
        source = loaded.path / name
        if source.is_file() and source.resolve() != (out_dir / name).resolve():
            shutil.copy2(source, out_dir / name)
    return out_dir
