#!/usr/bin/env bash
# Sets up, builds, then trains the demo model (examples/python/train_mlp.py) on CUDA when present,
# else CPU, and runs the same model from C++.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/build.sh
.venv/bin/python examples/python/train_mlp.py "$@"
echo "[demo] the same model from C++:"
build/main/train_mlp 200
