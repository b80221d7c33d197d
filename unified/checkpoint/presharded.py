"""Converting an HF checkpoint folder into a pre-sharded one for a parallel layout, and back.

One process computes every rank's slices, without torch.distributed or an accelerator: the rank's
parameters are those its pipeline stage builds (model.transformer.stage_holds), each sliced and fused by the
loader's own `param_sources`/`assemble` for the rank's tensor- and expert-parallel coordinates, so a file
holds exactly what `load_model` would have read from the HF folder on that rank. It streams: the source is
read tensor slice by tensor slice through lazy safetensors views, each rank's file is written one tensor at
a time (StreamingSafetensorsWriter), one rank after the other; memory holds a few tensors, not the model.
Everything that can be wrong (layout, missing tensors, sizes the layout does not divide) is found from the
headers before the first byte is written.

The way back reads each HF tensor's slices from the rank files that hold them (manifest.json says where)
and writes the HF files the source had, with the same names, order, dtypes and bytes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from unified.checkpoint.hf_config import model_config_from_hf, read_hf_config
from unified.checkpoint.hf_names import Param, parameter_map
from unified.checkpoint.hf_vision_names import in_checkpoint_layout
from unified.checkpoint.loader import SIDECAR_FILES, PartSlice, Shard, assemble, param_sources
from unified.checkpoint.manifest import UNMAPPED, read_manifest, shard_file, write_manifest
from unified.checkpoint.output import check_new_folder
from unified.checkpoint.presharded_loader import RankFile
from unified.checkpoint.quantized import (int4_group, quantization_config, quantization_config_for, quantize_tensor,
                                          quantizes)
from unified.checkpoint.safetensors_io import (DTYPES, INDEX, CheckpointError, SafetensorsCheckpoint,
                                               StreamingSafetensorsWriter)
from unified.errors import UserError
from unified.model.transformer import stage_holds
from unified.runtime.layout import Layout, check_layout

# Room reserved in a file's header for each stored tensor of a quantized parameter: its name plus the longest
# suffix quantize_tensor adds ("_scale_inv"), three times (int4 stores _packed, _scale and _shape).
_QUANTIZED_STAND_INS = ("_scale_inv",) * 3


def _part_shape(ckpt: SafetensorsCheckpoint, part: PartSlice) -> list[int]:
    shape = list(ckpt.shape(part.name))
    if part.dim is not None:
        shape[part.dim] = part.length
    return shape


def _shape(ckpt: SafetensorsCheckpoint, param: Param, rows: list[list[PartSlice]]) -> list[int]:
    """The shape of `param` made of `rows` (assemble's concatenation and stacking, on shapes)."""
    row = _part_shape(ckpt, rows[0][0])
    row[param.cat_dim] = sum(_part_shape(ckpt, p)[param.cat_dim] for p in rows[0])
    return [len(rows), *row] if param.stacked else row


def _dtype(ckpt: SafetensorsCheckpoint, param: Param) -> str:
    dtypes = {ckpt.get_slice(n).get_dtype() for row in param.rows for n in row}
    if len(dtypes) > 1:
        raise CheckpointError(f"the HF tensors of {param.ours} ({', '.join(param.rows[0])}, ...) have different dtypes "
                              f"({', '.join(sorted(dtypes))}); save the checkpoint in one dtype first")
    return dtypes.pop()


def _quantization_name(param: Param) -> str:
    """The HF name `quantizes` judges `param` by: its first part's, or for routed experts the name transformers
    gives a layer's fused experts (so they are quantized where a fused 3-D tensor would be: fp8)."""
    if not param.is_experts:
        return param.rows[0][0]
    layer = param.rows[0][0].split(".experts.")[0]
    return f"{layer}.experts.{'gate_up_proj' if param.ours.endswith('gate_up') else 'down_proj'}"


def _plan(ckpt: SafetensorsCheckpoint, config, layout: Layout) -> dict[tuple[int, int, int], list[tuple]]:
    """Per rank (pipeline, tensor, expert): [(param, its sources, its shape)] in load order. Reads headers only;
    raises on a missing tensor or a size the layout does not divide."""
    params = in_checkpoint_layout(parameter_map(config), config, ckpt.has)
    for param in params:
        for row in param.rows:
            for name in row:
                ckpt.file_of(name)  # names the missing tensor
    plan = {}
    for pp in range(layout.pipeline):
        for tp in range(layout.tensor):
            for ep in range(layout.expert):
                shard = Shard(tp, layout.tensor, ep, layout.expert)
                entries = []
                for param in params:
                    if stage_holds(param.ours, config, pp, layout.pipeline):
                        rows = param_sources(ckpt, param, shard)
                        entries.append((param, rows, _shape(ckpt, param, rows)))
                plan[pp, tp, ep] = entries
    return plan


def _copy_sidecars(source: Path, target: Path) -> None:
    for name in ("config.json", *SIDECAR_FILES):
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)


def _source_record(ckpt: SafetensorsCheckpoint) -> dict:
    from safetensors import safe_open

    files = {}
    for path in ckpt.files:
        with safe_open(str(path), framework="pt") as f:
            files[path.name] = {"tensors": list(f.keys()), "metadata": f.metadata()}
    return {"files": files, "index": (ckpt.directory / INDEX).is_file()}


def convert_to_presharded(source: Path, target: Path, layout: Layout, quantization: str | None = None,
                          quantize_lm_head: bool = False, log=print) -> dict:
    """Writes `target` (see manifest.py) from the HF checkpoint in `source`; returns the manifest."""
    source, target = Path(source), Path(target)
    check_new_folder(target, source)
    hf = read_hf_config(source)
    if quantization_config(hf) is not None:
        raise UserError(f"{source} is already quantized (its config.json has a quantization_config); convert its "
                        f"full-precision original (engine.quantization= quantizes while converting)")
    config = model_config_from_hf(hf)
    check_layout(layout, layout.tensor * layout.pipeline * layout.expert, config)
    ckpt = SafetensorsCheckpoint(source)
    plan = _plan(ckpt, config, layout)
    chosen = {}
    if quantization:
        chosen = {(c, p.ours) for c, entries in plan.items() for p, _, shape in entries
                  if quantizes(_quantization_name(p), tuple(shape), quantization, quantize_lm_head)}
    group = None
    if quantization == "int4" and chosen:
        group = int4_group([shape[-1] for c, entries in plan.items() for p, _, shape in entries if (c, p.ours) in chosen])
    mapped = {n for entries in plan.values() for p, _, _ in entries for row in p.rows for n in row}
    unmapped = [n for n in ckpt.location if n not in mapped]

    target.mkdir(parents=True, exist_ok=True)
    shards = []
    for (pp, tp, ep), entries in plan.items():
        shard, name = Shard(tp, layout.tensor, ep, layout.expert), shard_file(pp, tp, ep)
        room = [n for p, _, _ in entries
                for n in ([p.ours + s for s in _QUANTIZED_STAND_INS] if ((pp, tp, ep), p.ours) in chosen else [p.ours])]
        writer = StreamingSafetensorsWriter(target / name, room)
        params, tensors = {}, {}
        for param, rows, shape in entries:
            tensor = assemble(ckpt, param, shard)
            quantized = ((pp, tp, ep), param.ours) in chosen
            stored = quantize_tensor(param.ours, tensor, quantization, group) if quantized else {param.ours: tensor}
            for stored_name, data in stored.items():
                offsets, digest_of = writer.add(stored_name, data)
                tensors[stored_name] = {"dtype": writer.header[stored_name]["dtype"], "shape": list(data.shape),
                                        "offsets": list(offsets), **digest_of}
            params[param.ours] = {
                "shape": shape, "global_shape": _shape(ckpt, param, param_sources(ckpt, param, Shard())),
                "dtype": _dtype(ckpt, param), "stacked": param.stacked, "cat_dim": param.cat_dim,
                "stored": list(stored),
                "rows": [[{"name": p.name, "shape": list(ckpt.shape(p.name)), "dtype": ckpt.get_slice(p.name).get_dtype(),
                           "dim": p.dim, "start": p.start, "length": p.length} for p in row] for row in rows]}
        size = writer.close()
        shards.append({"file": name, "pipeline": pp, "tensor": tp, "expert": ep, "bytes": size,
                       "params": params, "tensors": tensors})
        log(f"wrote {name}: {len(params)} parameters, {size / 2 ** 20:.1f} MiB")
    manifest = {"layout": {"tensor": layout.tensor, "pipeline": layout.pipeline, "expert": layout.expert},
                "quantization": quantization_config_for(quantization, quantize_lm_head, group or 128) if chosen else None,
                "shards": shards, "unmapped": _write_unmapped(ckpt, unmapped, target), "source": _source_record(ckpt)}
    _copy_sidecars(source, target)
    write_manifest(target, manifest)  # last: a folder without it is not mistaken for a finished one
    return manifest


def _write_unmapped(ckpt: SafetensorsCheckpoint, names: list[str], target: Path) -> dict | None:
    if not names:
        return None
    writer, tensors = StreamingSafetensorsWriter(target / UNMAPPED, names), {}
    for name in names:
        data = ckpt.get(name)
        offsets, digest_of = writer.add(name, data)
        tensors[name] = {"dtype": writer.header[name]["dtype"], "shape": list(data.shape), "offsets": list(offsets),
                         **digest_of}
    return {"file": UNMAPPED, "bytes": writer.close(), "params": {}, "tensors": tensors}


def convert_to_hf(source: Path, target: Path, log=print) -> int:
    """Writes the HF checkpoint that the pre-sharded folder `source` was converted from into `target` (for a
    folder converted with quantization, the dequantized weights in the source's dtypes). Returns the tensor count."""
    source, target = Path(source), Path(target)
    check_new_folder(target, source)
    manifest = read_manifest(source)
    quantization = manifest.get("quantization")
    pieces: dict[str, list[tuple]] = {}
    for entry in manifest["shards"]:
        rank_file = RankFile(source, entry, verify=True, quantization=quantization)
        for ours, record in entry["params"].items():
            for row_index, row in enumerate(record["rows"]):
                offset = 0
                for part in row:
                    along = part["length"] if part["dim"] is not None else part["shape"][record["cat_dim"]]
                    row_at = row_index if record["stacked"] else None
                    pieces.setdefault(part["name"], []).append((rank_file, ours, row_at, record["cat_dim"], offset,
                                                                along, part))
                    offset += along
    unmapped = RankFile(source, manifest["unmapped"], verify=True) if manifest.get("unmapped") else None
    target.mkdir(parents=True, exist_ok=True)
    weight_map, total, cache = {}, 0, {}
    for file_name, record in manifest["source"]["files"].items():
        writer = StreamingSafetensorsWriter(target / file_name, record["tensors"], record["metadata"])
        for name in record["tensors"]:
            tensor = unmapped.get(name) if name not in pieces and unmapped else _whole(name, pieces.get(name), cache)
            writer.add(name, tensor)
            weight_map[name], total = file_name, total + tensor.numel() * tensor.element_size()
        writer.close()
        log(f"wrote {file_name}: {len(record['tensors'])} tensors")
    if manifest["source"]["index"]:
        (target / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    _copy_sidecars(source, target)
    return len(weight_map)


def _whole(name: str, pieces: list[tuple] | None, cache: dict) -> torch.Tensor:
    """HF tensor `name` put together from the rank-file slices that hold it (replicas read once)."""
    if not pieces:
        raise CheckpointError(f"no shard of the pre-sharded folder holds {name!r}, which manifest.json lists among the "
                              f"source's tensors; the folder is incomplete: convert again")
    part = pieces[0][-1]
    whole = torch.empty(part["shape"], dtype=DTYPES[part["dtype"]])
    missing = torch.ones(part["shape"][part["dim"]] if part["dim"] is not None else 1, dtype=torch.bool)
    for rank_file, ours, row, cat_dim, offset, along, part in pieces:
        span = slice(part["start"], part["start"] + part["length"]) if part["dim"] is not None else slice(0, 1)
        if not missing[span].any():
            continue  # a replica of a slice already placed
        if cache.get("key") != (rank_file.path, ours):  # consecutive parts of one parameter: read it once
            cache.update(key=(rank_file.path, ours), tensor=rank_file.param(ours))
        local = cache["tensor"] if row is None else cache["tensor"][row]
        piece = local.narrow(cat_dim, offset, along)
        (whole if part["dim"] is None else whole.narrow(part["dim"], part["start"], part["length"])).copy_(piece)
        missing[span] = False
    if missing.any():
        raise CheckpointError(f"the shards of the pre-sharded folder hold only part of {name!r}; the folder is "
                              f"incomplete: convert again")
    return whole
