#!/usr/bin/env bash
# Makes bench/.venv-trl with TRL (the peer in bench/rlhf.py), apart from .venv so that TRL's dependencies
# (datasets, pandas, pyarrow) never touch ours. torch, transformers, peft and accelerate are pinned to the
# versions in .venv, so the two sides of the bench differ only in the GRPO implementation; reasoning-gym
# scores the completions with our task reward (unified/ is put on the path by the bench, not installed).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
PINS=(torch==2.13.0 transformers==5.25.0 peft==0.21.2 accelerate==1.16.0 reasoning-gym==0.1.25)
[ -x .venv-trl/bin/python ] || "$PYTHON" -m venv .venv-trl
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf '%s\n' "${PINS[@]}" > "$constraints"
.venv-trl/bin/python -m pip install --disable-pip-version-check -q torch==2.13.0
.venv-trl/bin/python -m pip install --disable-pip-version-check -q -c "$constraints" "${PINS[@]}" trl==1.16.0
.venv-trl/bin/python -c "import trl, transformers, peft, torch; print('trl', trl.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__, 'torch', torch.__version__)"
