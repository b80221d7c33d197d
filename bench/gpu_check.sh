#!/usr/bin/env bash
# One prepared check of the CUDA path for a borrowed GPU machine (see bench/gpu_check.py for the sections).
#
#   here:          bench/gpu_wheels.sh                      # once: .whl/ (wheels + tokenizer), git-ignored
#                  bench/gpu_check.sh --dry-run             # the same sections on this CPU, tiny sizes
#   GPU machine:   bash bench/gpu_check.sh                  # with .whl carried; figures land in $OUT
#
# On the GPU machine the script uses that machine's own python3 (torch, Triton, CUDA) and installs only the
# carried wheels, into /tmp/site, without touching its packages.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
if [[ "${1:-}" == "--dry-run" ]]; then
    PY=.venv/bin/python
else
    PY=python3
    [[ -d .whl ]] || { echo "no .whl/ here: run bench/gpu_wheels.sh on the development machine and carry .whl" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 2
    export PYTHONPATH=/tmp/site
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export UNIFIED_CACHE_DIR=${UNIFIED_CACHE_DIR:-/tmp/unified-cache}
"$PY" bench/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
