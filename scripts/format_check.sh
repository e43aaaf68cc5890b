#!/usr/bin/env bash
# Fails when a C++/CUDA file differs from clang-format's output (.clang-format: Google, 100 cols).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  echo "[format] clang-format not found: skipped"
  exit 0
fi
files=$(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'tests/cpp/*' 'python_bindings/*.cpp' \
  'python_bindings/*.h' 'examples/*.cpp')
clang-format --dry-run --Werror $files
echo "[format] clang-format: clean"
