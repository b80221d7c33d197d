#!/usr/bin/env bash
# Sets up (see setup.sh, setup_browser.sh) and runs the whole test suite offline, on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/setup_browser.sh  # Debian's chromium, for the playground's browser test
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
