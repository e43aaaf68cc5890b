#!/usr/bin/env bash
# Builds libfusible, fusible._C, the gtest binary and the C++ examples in build/main (incremental),
# and installs the Python package into .venv so `import fusible` works from any folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
start=$(date +%s)
echo "[build] building with $CMAKE_BUILD_PARALLEL_LEVEL jobs into build/main (first build: several minutes)"
"$PYTHON" -m pip install --disable-pip-version-check --no-build-isolation --no-deps -q \
  -C build-dir=build/main -C cmake.define.FUSIBLE_BUILD_TESTS=ON \
  -C cmake.define.FUSIBLE_BUILD_EXAMPLES=ON ${FUSIBLE_PIP_ARGS:-} .
echo "[build] done in $(( $(date +%s) - start )) s"
