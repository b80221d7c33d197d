#!/usr/bin/env bash
# Prepares .whl/ for bench/gpu_check.sh: the pure-Python (and cp312 manylinux) wheels of our dependencies that
# the borrowed CUDA machine lacks (it has its own Python 3.12, torch, Triton and transformers, and no network),
# plus the SmolLM2 tokenizer files the check's random-weight chat models borrow. Run here, after setup.sh;
# .whl/ is git-ignored and travels with the check (`carry: [".whl"]`), 64 MiB at most.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(.venv/bin/python -m pip)
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl && mkdir -p .whl/tokenizer
# Exactly the versions this venv runs, built for CPython 3.12 on x86-64 Linux.
NAMES=(megatron-core hydra-core omegaconf pydantic pydantic_core annotated-types typing-inspection hjson gguf
       transformers huggingface_hub kernels typing_extensions httpx2 httpcore2 click hf-xet tomlkit truststore idna
       anyio fastapi starlette uvicorn annotated-doc xxhash)
SPECS=()
for name in "${NAMES[@]}"; do SPECS+=("$name==$(version "$name")"); done
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${SPECS[@]}"
# Published as source only: built here into universal wheels (DeepSpeed's ops compile at run time).
DS_BUILD_OPS=0 "${PIP[@]}" wheel -q --no-deps --no-build-isolation -w .whl \
    "deepspeed==$(version deepspeed)" "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
tokenizer=$(.venv/bin/python -c "from unified.checkpoint.builtin import resolve_model; print(resolve_model('smollm2'))")
cp "$tokenizer"/{tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} .whl/tokenizer/
du -sh .whl
