#!/usr/bin/env bash
# Creates .venv/ with the pinned packages of requirements.txt (idempotent: quick when already done)
# and makes sure GoogleTest is present. The torch download is several GB the first time.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] .venv is up to date"
else
  if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
  fi
  echo "[setup] installing pinned packages (torch==2.11.0 is several GB the first time)"
  .venv/bin/python -m pip install --disable-pip-version-check -r requirements.txt
  echo "$want" >"$stamp"
fi

if ! compgen -G "/usr/lib/*/cmake/GTest/GTestConfig.cmake" >/dev/null &&
   ! compgen -G "/usr/lib/cmake/GTest/GTestConfig.cmake" >/dev/null; then
  echo "[setup] GoogleTest not found: installing libgtest-dev"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libgtest-dev; else
    sudo apt-get update -qq && sudo apt-get install -y -qq libgtest-dev; fi
fi
