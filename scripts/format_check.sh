#!/usr/bin/env bash
# Fails when a C++/CUDA file differs from clang-format's output (.clang-format: Google, 100 cols)
# or Python code fails ruff (lint and format, settings in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
py_dirs="python_bindings tests/python examples bench"
if [ -x .venv/bin/ruff ]; then
  .venv/bin/ruff check $py_dirs
  .venv/bin/ruff format --check $py_dirs
  echo "[format] ruff: clean"
fi
if ! command -v clang-format >/dev/null; then
  echo "[format] clang-format not found: C++ check skipped"
  exit 0
fi
files=$(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'tests/cpp/*' 'python_bindings/*.cpp' \
  'python_bindings/*.h' 'examples/*.cpp')
clang-format --dry-run --Werror $files
echo "[format] clang-format: clean"
