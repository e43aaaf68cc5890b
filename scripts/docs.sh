#!/usr/bin/env bash
# Builds the HTML documentation into build/docs with Sphinx, warnings as errors. The API reference
# is read from the fusible package installed in .venv (build it first: scripts/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import sphinx, myst_parser" 2>/dev/null; then
  echo "[docs] sphinx or myst-parser missing from .venv: run scripts/setup_env.sh" >&2
  exit 1
fi
.venv/bin/python -m sphinx -W --keep-going -b html docs build/docs "$@"
echo "[docs] built: build/docs/index.html"
