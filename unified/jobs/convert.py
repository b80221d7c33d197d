"""`unified recipe=convert model=<HF dir|name> output=<dir> parallel.tensor=T parallel.pipeline=P
parallel.expert=E [engine.quantization=int8|int4|fp8 [engine.quantize_lm_head=true]]`: pre-shards an HF
checkpoint for that layout (one file per model-parallel rank, see unified/checkpoint/manifest.py), which
`model=<dir>` then loads under the same layout. `model=<pre-sharded dir> output=<dir>` with no parallel.*
writes the HF checkpoint back. Runs in one process, on no accelerator.
"""
from __future__ import annotations

from pathlib import Path

from unified.checkpoint.builtin import resolve_model
from unified.checkpoint.manifest import is_presharded, layout_overrides, manifest_layout, read_manifest
from unified.checkpoint.presharded import convert_to_hf, convert_to_presharded
from unified.errors import UserError
from unified.runtime.layout import Layout

METHODS = ("int8", "int4", "fp8")


def run(cfg) -> None:
    if not cfg.output:
        raise UserError("recipe=convert needs output=<folder> for the converted checkpoint")
    source, target = resolve_model(cfg.model), Path(cfg.output)
    layout = Layout(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.expert)
    method = cfg.engine.quantization
    if method is not None and method not in METHODS:
        raise UserError(f"recipe=convert quantizes with engine.quantization={'|'.join(METHODS)} (got {method!r})")
    if is_presharded(source):
        held = manifest_layout(read_manifest(source))
        if layout != Layout() or method is not None:
            raise UserError(f"model={source} is pre-sharded ({layout_overrides(held)}); converting it back to an HF "
                            f"checkpoint takes no parallel.* and no engine.quantization: drop them, or convert the HF "
                            f"checkpoint for the other layout")
        count = convert_to_hf(source, target)
        print(f"wrote the HF checkpoint of {source} ({count} tensors) to {target}")
        return
    manifest = convert_to_presharded(source, target, layout, method, cfg.engine.quantize_lm_head)
    total = sum(s["bytes"] for s in manifest["shards"])
    print(f"pre-sharded {source} for [{layout}] into {len(manifest['shards'])} files ({total / 2 ** 20:.1f} MiB"
          f"{f', {method}' if manifest['quantization'] else ''}) in {target}; load it with model={target} "
          f"{layout_overrides(layout)} on a multiple of {layout.tensor * layout.pipeline * layout.expert} ranks")
