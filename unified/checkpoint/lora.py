"""LoRA adapters on the shared model, saved and loaded in peft's format.

An adapter hangs off one of our linears as its `lora` submodule: ColumnLinear and RowLinear add its
output in their forward, MLA's replicated down-projections (plain nn.Linear) through a forward hook.
Base parameter names never change, so the loader, the exporter and training checkpoints see the same
model, and a model without adapters runs exactly as before.

Targets are HF projection names. Which HF projections one of our linears fuses (q|k|v, gate|up), their
sizes and their tensor-parallel split come from the checkpoint name map (hf_names), the table the loader
reads weights with. A fused linear holds one (A, B) pair per targeted projection, B's rows placed where
that projection's rows sit in the fused output, so each pair is exactly peft's LoRA on that projection:
out += B A dropout(x) * alpha / rank, with A kaiming-uniform and B zero at the start.

Tensor parallel: on a column linear A is replicated and B split by output rows like the base weight;
the rank-r activations A x pass through copy-to-region, whose backward sums A's gradient over the ranks.
On a row linear A is split by input columns like the base weight and the partial A x are all-reduced
before the replicated B. Adapters are always made from full (tensor-parallel size 1) tensors, fresh
ones drawn on the CPU so ranks seeded alike draw alike, and sliced by the loader's own slicing, so a
rank holds exactly the rows and columns of the base weight it holds; saving gathers them the way HF
export does. Where KV heads are fewer than ranks, a replicated head's B is replicated too, and (as for
the base weight) its copies get only their own rank's gradient.

Routed MoE experts get no adapters. MLA's cached latent attention uses kv_b_proj's matrix itself; it
asks the layer for `effective_weight()`, which folds the adapter in.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from torch import nn

from unified.checkpoint.hf_names import Param, parameter_map
from unified.checkpoint.loader import FullTensors, _gather_part, _read_part, _tp_rank_size
from unified.errors import UserError
from unified.model.parallel_layers import ColumnLinear, RowLinear, _mark_split
from unified.runtime.comm import collective

log = logging.getLogger(__name__)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
           "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's key prefix in front of the HF model's module path
# peft options that change what an adapter computes or holds; we implement the plain form only.
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none",
                "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None}


class LoraAdapter(nn.Module):
    """out[rows of p] += B_p A_p dropout(x) * alpha / rank for each targeted HF projection p of one linear.

    `segments` is the linear's local output layout, (projection, rows) in order, targeted or not."""

    def __init__(self, segments: list[tuple[str, int]], pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 alpha: float, dropout: float, parallel: str | None, group):
        super().__init__()
        self.segments = segments
        self.A = nn.ParameterDict({name: nn.Parameter(a) for name, (a, _) in pairs.items()})  # [rank, in]
        self.B = nn.ParameterDict({name: nn.Parameter(b) for name, (_, b) in pairs.items()})  # [rows, rank]
        self.rank = next(iter(self.A.values())).shape[0]
        self.alpha, self.p = alpha, dropout
        self.scaling = alpha / self.rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.parallel, self.group = parallel, group  # "column" | "row" | None (replicated); group None: one rank
        self.handles: list = []  # hooks that go when the adapter does
        self.active = True  # off: the linear computes its base weight alone (see adapters_disabled)

    def _a(self) -> torch.Tensor:
        return torch.cat([self.A[name] for name, _ in self.segments if name in self.A])  # [rank * pairs, in]

    def _b(self) -> torch.Tensor:
        """[out, rank * pairs]: each B in its projection's rows and its A's columns, zeros elsewhere."""
        return torch.block_diag(*(self.B[name] if name in self.B else self.B[next(iter(self.B))].new_zeros(rows, 0)
                                  for name, rows in self.segments))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return x.new_zeros(())
        h = F.linear(self.dropout(x), self._a())  # [..., rank * pairs]
        if self.group is not None and self.parallel == "row":
            with collective("tp_all_reduce", h):
                h = reduce_from_tensor_model_parallel_region(h, group=self.group)  # sum of the input slices' parts
        elif self.group is not None:
            h = copy_to_tensor_model_parallel_region(h, group=self.group)  # backward: A's gradient summed over ranks
        return F.linear(h, self._b()) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """What the adapter adds to this rank's slice of the base weight: [out, in] local, in float32."""
        return (self._b().float() @ self._a().float()) * self.scaling


def _add_lora(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + module.lora(args[0])


def _projections(param: Param) -> list[str]:
    """HF module paths of the projections one of our linears fuses, in output order."""
    return [name.removesuffix(".weight") for name in param.rows[0]]


def _short(projection: str) -> str:
    return projection.rsplit(".", 1)[-1]


def _linears(model: nn.Module) -> dict[str, tuple[nn.Module, Param]]:
    """This stage's linears that hold HF projections: module name -> (the module, its name-map entry)."""
    modules = dict(model.named_modules())
    out = {}
    for param in parameter_map(model.config):
        name = param.ours.removesuffix(".weight")
        if not param.stacked and isinstance(modules.get(name), (ColumnLinear, RowLinear, nn.Linear)):
            out[name] = (modules[name], param)
    return out


def _full_shape(host: nn.Module, param: Param) -> tuple[list[int], int]:
    """(rows of each projection, input features) at tensor-parallel size 1."""
    out, inp = (host.out_features, host.in_features) if isinstance(host, nn.Linear) else (host.output_size,
                                                                                           host.input_size)
    parts = len(param.rows[0])
    return (list(param.sizes) if param.sizes else [out // parts] * parts), inp


def _adapter(host: nn.Module, param: Param, full: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float,
             dropout: float) -> LoraAdapter:
    """full: HF projection -> (A [rank, in], B [rows, rank]) at tensor-parallel size 1; this rank keeps its slice."""
    split = isinstance(host, (ColumnLinear, RowLinear)) and host.tp_group.size() > 1
    tp_rank, tp_size = _tp_rank_size() if split else (0, 1)
    a_split, b_split = (1 if param.split == 1 else None), (0 if param.split == 0 else None)
    like = dict(device=host.weight.device, dtype=host.weight.dtype, memory_format=torch.contiguous_format, copy=True)
    rows, _ = _full_shape(host, param)
    segments, pairs = [], {}
    for projection, n in zip(_projections(param), rows):
        a, b = full.get(projection, (None, torch.empty(n, 0, device="meta")))
        b = _read_part(FullTensors(b=b), "b", b_split, tp_rank, tp_size, param.unit)
        segments.append((_short(projection), b.shape[0]))
        if a is not None:
            pairs[_short(projection)] = (_read_part(FullTensors(a=a), "a", a_split, tp_rank, tp_size).to(**like),
                                         b.to(**like))
    parallel = "column" if isinstance(host, ColumnLinear) else "row" if isinstance(host, RowLinear) else None
    adapter = LoraAdapter(segments, pairs, alpha, dropout, parallel, host.tp_group if split else None)
    if parallel is not None:  # split like the base weight, so gradient norms sum it over the ranks
        for matrix in (adapter.B if parallel == "column" else adapter.A).values():
            _mark_split(matrix, dim=0 if parallel == "column" else 1)
    return adapter


def _attach(model: nn.Module, name: str, host: nn.Module, adapter: LoraAdapter) -> None:
    host.lora = adapter
    if not isinstance(host, (ColumnLinear, RowLinear)):  # MLA's replicated down-projections
        adapter.handles.append(host.register_forward_hook(_add_lora))


def _adapted(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "lora", None), LoraAdapter)]


def _detach(host: nn.Module) -> None:
    for handle in host.lora.handles:
        handle.remove()
    del host.lora  # out of the submodules, so the layer's `self.lora is None` check is a plain attribute read
    if isinstance(host, (ColumnLinear, RowLinear)):
        host.lora = None


def has_adapters(model: nn.Module) -> bool:
    return bool(_adapted(model))


def _check_no_adapters(model: nn.Module) -> None:
    if _adapted(model):
        raise UserError("the model already has LoRA adapters; merge_lora(model) first to add another")


def _freeze_base(model: nn.Module) -> list[nn.Parameter]:
    params = [p for m in _adapted(model) for p in m.lora.parameters()]
    ids = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in ids)
    log.info(lora_summary(model))
    return params


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model alone while inside: the reference policy of RLHF under LoRA, with no second copy."""
    adapters = [host.lora for host in _adapted(model)]
    for adapter in adapters:
        adapter.active = False
    try:
        yield model
    finally:
        for adapter in adapters:
            adapter.active = True


def lora_summary(model: nn.Module) -> str:
    """One line: trainable (adapter) parameters against all of this rank's parameters."""
    adapted = _adapted(model)
    trainable = sum(p.numel() for m in adapted for p in m.lora.parameters())
    total = sum(p.numel() for p in model.parameters())
    return (f"LoRA: {trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.3f}%) "
            f"in {len(adapted)} adapted linears")


def apply_lora(model: nn.Module, cfg) -> list[nn.Parameter]:
    """Adds fresh adapters (`cfg`: unified.config.schema.LoraConfig) and freezes the base parameters;
    returns the adapters' parameters, the only trainable ones."""
    if cfg.rank < 1:
        raise UserError(f"train.lora.rank={cfg.rank}: LoRA needs a rank of at least 1")
    if not 0 <= cfg.dropout < 1:
        raise UserError(f"train.lora.dropout={cfg.dropout} must be in [0, 1)")
    unknown = sorted(set(cfg.targets) - set(TARGETS))
    if unknown:
        raise UserError(f"train.lora.targets has {unknown}, which are not projections LoRA can adapt; "
                        f"choose among {list(TARGETS)}")
    if cfg.experts and model.config.moe is not None:
        raise UserError("LoRA on routed MoE experts is not supported yet; set train.lora.experts=false (shared "
                        "experts and dense MLPs are adapted through gate_proj, up_proj and down_proj)")
    _check_no_adapters(model)
    linears = _linears(model)
    chosen = {name: [p for p in _projections(param) if _short(p) in cfg.targets]
              for name, (_, param) in linears.items()}
    chosen = {name: projections for name, projections in chosen.items() if projections}
    if not chosen:
        present = sorted({_short(p) for _, param in linears.values() for p in _projections(param)} & set(TARGETS))
        raise UserError(f"train.lora.targets {list(cfg.targets)} names no projection of this "
                        f"{model.config.family} model; it has {present}")
    for name, projections in chosen.items():
        host, param = linears[name]
        rows, inp = _full_shape(host, param)
        full = {}
        for projection, n in zip(_projections(param), rows):
            if projection in projections:
                a = torch.empty(cfg.rank, inp, dtype=torch.float32, device="cpu")
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # peft's (and nn.Linear's) default
                full[projection] = (a, torch.zeros(n, cfg.rank, dtype=torch.float32, device="cpu"))
        _attach(model, name, host, _adapter(host, param, full, cfg.alpha, cfg.dropout))
    return _freeze_base(model)


def merge_lora(model: nn.Module) -> int:
    """Folds every adapter into its base weight and removes it (base parameters stay frozen). Returns how
    many linears were merged."""
    adapted = _adapted(model)
    with torch.no_grad():
        for host in adapted:
            host.weight.add_(host.lora.delta_weight().to(host.weight.dtype))
            _detach(host)
    return len(adapted)


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's LoRA matrices under peft's names, whole (tensor-parallel slices gathered: every rank of the
    group must go through all of them), on the model's device."""
    for host, param in _linears(model).values():
        adapter = getattr(host, "lora", None)
        if adapter is None:
            continue
        for projection, n in zip(_projections(param), _full_shape(host, param)[0]):
            if _short(projection) not in adapter.A:
                continue
            a, b = adapter.A[_short(projection)].detach(), adapter.B[_short(projection)].detach()
            if adapter.group is not None and adapter.parallel == "row":
                a = _gather_part(a, 1, None, adapter.group)
            elif adapter.group is not None:
                b = _gather_part(b, 0, n // param.unit if param.unit else None, adapter.group)
            yield f"{PEFT_PREFIX}{projection}.lora_A.weight", a
            yield f"{PEFT_PREFIX}{projection}.lora_B.weight", b


@torch.no_grad()
def write_adapter_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Copies this rank's part of the whole LoRA matrix `name` (peft's name, as `adapter_tensors` gives it)
    into the model's adapter; False where this rank holds no part of it (another pipeline stage)."""
    projection, _, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
    for host, param in _linears(model).values():
        adapter = getattr(host, "lora", None)
        if adapter is None or projection not in _projections(param) or _short(projection) not in adapter.A:
            continue
        tp_rank, tp_size = _tp_rank_size() if adapter.group is not None else (0, 1)
        if kind == "A.weight":
            part = _read_part(FullTensors(a=tensor), "a", 1 if param.split == 1 else None, tp_rank, tp_size)
            adapter.A[_short(projection)].copy_(part)
        else:
            part = _read_part(FullTensors(b=tensor), "b", 0 if param.split == 0 else None, tp_rank, tp_size,
                              param.unit)
            adapter.B[_short(projection)].copy_(part)
        return True
    return False


def save_adapter(model: nn.Module, out_dir: str | Path, base_model: str | None = None) -> Path:
    """Writes adapter_config.json and adapter_model.safetensors as peft does, so that
    `peft.PeftModel.from_pretrained(hf_model, out_dir)` computes what our model computes. Under tensor
    parallelism every rank calls it (the slices are gathered) and global rank 0 writes."""
    from safetensors.torch import save_file

    if model.stage.size > 1:
        raise UserError("save_adapter does not support pipeline parallelism yet; save from a model loaded "
                        "without it")
    linears = _linears(model)
    tensors = {name: tensor.contiguous().cpu() for name, tensor in adapter_tensors(model)}
    adapters = [host.lora for host, _ in linears.values() if getattr(host, "lora", None) is not None]
    if not adapters:
        raise UserError("the model has no LoRA adapters to save")
    first = adapters[0]
    assert all((a.rank, a.alpha, a.p) == (first.rank, first.alpha, first.p) for a in adapters)
    targets = sorted({name for a in adapters for name in a.A})
    # Same-named projections without an adapter (layers a loaded adapter skipped) must get none in peft either.
    excluded = sorted(p for _, param in linears.values() for p in _projections(param)
                      if _short(p) in targets and f"{PEFT_PREFIX}{p}.lora_A.weight" not in tensors)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "revision": None, "inference_mode": True, "r": first.rank, "lora_alpha": first.alpha,
              "lora_dropout": first.p, "target_modules": targets, "exclude_modules": excluded or None,
              "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None, **_UNSUPPORTED}
    out_dir = Path(out_dir)
    if torch.distributed.get_rank() != 0:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def _read_adapter_config(path: Path) -> dict:
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise UserError(f"{path} is not a LoRA adapter folder: it has no {name}")
    config = json.loads((path / CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA":
        raise UserError(f"{path / CONFIG_FILE} holds a {config.get('peft_type')!r} adapter; only LORA loads here")
    for key, plain in _UNSUPPORTED.items():
        if config.get(key) not in (plain, None, {}, []):
            raise UserError(f"{path / CONFIG_FILE} sets {key}={config[key]!r}; only plain LoRA ({key}={plain!r}) "
                            "is supported")
    return config


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> list[nn.Parameter]:
    """Attaches a peft-format LoRA adapter (ours or peft's) for unmerged serving or to resume training;
    freezes the base parameters and returns the adapters' parameters."""
    from safetensors.torch import load_file

    path = Path(adapter_dir)
    config = _read_adapter_config(path)
    _check_no_adapters(model)
    rank, alpha = config["r"], config["lora_alpha"]
    matrices: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(path / WEIGHTS_FILE).items():
        projection, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not key.startswith(PEFT_PREFIX) or kind not in ("A.weight", "B.weight"):
            raise UserError(f"{path / WEIGHTS_FILE} holds {key!r}, which is not a LoRA A or B matrix of a linear "
                            "layer; only plain LoRA adapters load here")
        matrices.setdefault(projection, {})[kind[0]] = tensor
    linears = _linears(model)
    owner = {p: name for name, (_, param) in linears.items() for p in _projections(param)}
    unknown = sorted(set(matrices) - set(owner))
    if unknown and model.stage.size == 1:  # under pipeline parallel the other stages hold some
        raise UserError(f"{path / WEIGHTS_FILE} adapts {unknown[:3]}{' ...' if len(unknown) > 3 else ''}, which "
                        f"this {model.config.family} model has no linear for (routed MoE experts are not supported)")
    grouped: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for projection, pair in matrices.items():
        if projection not in owner:
            continue
        host, param = linears[owner[projection]]
        rows, inp = _full_shape(host, param)
        n = rows[_projections(param).index(projection)]
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape != (rank, inp) or b.shape != (n, rank):
            found = {k: tuple(v.shape) for k, v in pair.items()}
            raise UserError(f"{path / WEIGHTS_FILE}: {projection} has LoRA matrices {found}; this model with "
                            f"r={rank} needs A {(rank, inp)} and B {(n, rank)}")
        grouped.setdefault(owner[projection], {})[projection] = (a, b)
    for name, full in grouped.items():
        host, param = linears[name]
        _attach(model, name, host, _adapter(host, param, full, alpha, config.get("lora_dropout", 0.0)))
    return _freeze_base(model)
