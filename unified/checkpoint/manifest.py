"""The layout of a pre-sharded checkpoint folder (written by `unified recipe=convert`), and its manifest.

A folder holds config.json and the tokenizer files of the HF checkpoint it came from, one safetensors file per
model-parallel rank, named by the rank's coordinates (`shard_file`): `shard-pp<P>-tp<T>-ep<E>.safetensors`
with three-digit pipeline stage, tensor-parallel rank and expert-parallel rank; data-parallel replicas of
one coordinate read the same file. HF tensors the model does not use (a tied head stored anyway, multi-token
prediction layers) are kept verbatim in `unmapped.safetensors` for the conversion back; no rank reads it.

manifest.json (FORMAT, VERSION) records:
- `layout`: {tensor, pipeline, expert}; `quantization`: None or the quantization_config of the stored weights.
- `shards`: per file its coordinates, `bytes`, and
  - `params`: our parameters it holds, in load order: `shape` (this rank's), `global_shape` (unsharded),
    `dtype`, `stacked`/`cat_dim`, and `rows`: per row (one per local expert) the HF parts concatenated along
    `cat_dim`, each {name, shape (whole HF tensor), dtype, dim, start, length}: rows `start` to
    `start + length` along `dim` of that HF tensor (`dim` None: all of it). This is the slice the rank holds.
  - `tensors`: what the file stores (a parameter's own name; with quantization also its `_scale`, ...):
    `dtype`, `shape`, `offsets` [begin, end) in bytes from the start of the file, and the `sha256` and
    `xxh3_128` digests of those bytes (unified/checkpoint/digests.py).
- `unmapped`: the same `tensors` record for unmapped.safetensors (or None).
- `source`: the HF files, each with its tensor names in file order, and whether an index named them.
"""
from __future__ import annotations

import json
from pathlib import Path

from unified.checkpoint.safetensors_io import CheckpointError
from unified.errors import UserError
from unified.runtime.layout import Layout

FORMAT = "unified-presharded"
VERSION = 1
MANIFEST = "manifest.json"
UNMAPPED = "unmapped.safetensors"


def shard_file(pipeline: int, tensor: int, expert: int) -> str:
    return f"shard-pp{pipeline:03d}-tp{tensor:03d}-ep{expert:03d}.safetensors"


def is_presharded(directory: Path) -> bool:
    return (Path(directory) / MANIFEST).is_file()


def write_manifest(directory: Path, manifest: dict) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION, **manifest}, indent=1))


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not readable JSON ({err}); copy it again from where the folder was "
                              f"converted, or convert the HF checkpoint again (recipe=convert)") from err
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("version"), int):
        raise CheckpointError(f"{path} is not a pre-sharded checkpoint manifest (format {manifest.get('format')!r})")
    if manifest["version"] > VERSION:
        raise CheckpointError(f"{path} has format version {manifest['version']}; this code reads up to {VERSION}: "
                              f"update unified, or convert the HF checkpoint again with this version")
    _check_fields(path, manifest)
    return manifest


def _check_fields(path: Path, manifest: dict) -> None:
    """The manifest's own structure (each shard's records are checked against its file by presharded_loader)."""
    def broken(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}; the manifest was edited or damaged: copy it again from where the "
                               f"folder was converted, or convert again (recipe=convert)")

    layout = manifest.get("layout")
    if not isinstance(layout, dict) or set(layout) != {"tensor", "pipeline", "expert"} or not all(
            isinstance(v, int) and v >= 1 for v in layout.values()):
        raise broken(f"'layout' must give tensor, pipeline and expert as positive integers (got {layout!r})")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not all(isinstance(e, dict) and {"file", "bytes", "params", "tensors"} <= set(e)
                                               for e in shards):
        raise broken("'shards' must list each file with its file, bytes, params and tensors")
    source = manifest.get("source")
    if not isinstance(source, dict) or not isinstance(source.get("files"), dict) or "index" not in source:
        raise broken("'source' must record the HF files (files, index)")


def manifest_layout(manifest: dict) -> Layout:
    return Layout(**manifest["layout"])


def layout_overrides(layout: Layout) -> str:
    return f"parallel.tensor={layout.tensor} parallel.pipeline={layout.pipeline} parallel.expert={layout.expert}"


def check_manifest_layout(directory: Path, manifest: dict, layout: Layout) -> None:
    held = manifest_layout(manifest)
    if held != layout:
        raise LayoutMismatch(
            f"{directory} is pre-sharded for the layout [{held}] only, but this run's layout is [{layout}]: run with "
            f"{layout_overrides(held)} (on a multiple of {held.tensor * held.pipeline * held.expert} ranks), or "
            f"load the HF checkpoint it came from, or convert that again for this layout (unified recipe=convert "
            f"model=<HF dir> output=<dir> {layout_overrides(layout)}); `unified recipe=convert model={directory} "
            f"output=<dir>` writes the HF checkpoint back")


def shard_entry(directory: Path, manifest: dict, pipeline: int, tensor: int, expert: int) -> dict:
    name = shard_file(pipeline, tensor, expert)
    for shard in manifest["shards"]:
        if shard["file"] == name:
            return shard
    raise CheckpointError(f"{Path(directory) / MANIFEST} lists no file {name} for pipeline stage {pipeline}, "
                          f"tensor rank {tensor}, expert rank {expert}; the manifest is incomplete: convert again")


class LayoutMismatch(UserError, ValueError):
    pass
