#!/usr/bin/env bash
# Differential fuzzing (issue 17): random op chains against the unfused float64 reference, random
# seeds for N minutes; one line per failure (its seed and chain), then a summary (cases, failures,
# cases per fusion). Exits non-zero on any failure. --seed S replays one case verbosely.
#   scripts/fuzz.sh --minutes 5 [--device cpu|cuda]
#   scripts/fuzz.sh --seed 1234 [--device cuda] [--minimize]
# Python: .venv/bin/python, or PY=python3 (with PYTHONPATH at a build's python folder).
# The fixed-seed CI slice is tests/python/test_fuzz.py; the generator is tests/python/fuzz_chains.py.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
PY=${PY:-$root/.venv/bin/python}
cd "$root/tests/python"  # fuzz_chains imports op_specs and conftest from here
exec "$PY" -m fuzz_chains "$@"
