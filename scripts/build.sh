#!/usr/bin/env bash
# Builds libfusible, fusible._C, the gtest binary and the C++ examples in build/main (incremental),
# packs the wheel into build/dist, and installs that wheel into .venv: the tests run what a user
# installs (scripts/wheel_check.sh installs the same wheel into a fresh venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
start=$(date +%s)
echo "[build] building with $CMAKE_BUILD_PARALLEL_LEVEL jobs into build/main (first build: several minutes)"
rm -rf build/dist
"$PYTHON" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -q -w build/dist \
  -C build-dir=build/main -C cmake.define.FUSIBLE_BUILD_TESTS=ON \
  -C cmake.define.FUSIBLE_BUILD_EXAMPLES=ON ${FUSIBLE_PIP_ARGS:-} .
"$PYTHON" -m pip install --disable-pip-version-check --no-deps --force-reinstall -q build/dist/fusible-*.whl
echo "[build] done in $(( $(date +%s) - start )) s"
