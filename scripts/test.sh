#!/usr/bin/env bash
# Sets up, builds (library and docs), then runs every test: ctest (GoogleTest) and pytest (the
# docs' examples included). CUDA tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/format_check.sh
bash scripts/build.sh
bash scripts/docs.sh  # the documentation, warnings as errors (its examples run in pytest)
echo "[test] ctest"
.venv/bin/ctest --test-dir build/main --output-on-failure -j "$(nproc)" | tee build/ctest.log
echo "[test] pytest"
(cd tests/python && ../../.venv/bin/python -m pytest -q -rs -p no:cacheprovider . ) | tee build/pytest.log
echo "[test] the wheel in a fresh venv"
bash scripts/wheel_check.sh | tee build/wheel_check.log
echo "[test] summary"
grep -E "tests passed|tests failed" build/ctest.log | tail -1
tail -1 build/pytest.log
