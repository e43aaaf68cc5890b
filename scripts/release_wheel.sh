#!/usr/bin/env bash
# A release wheel and source distribution into dist/: CUDA kernels for Ampere (8.0), Ada (8.9),
# Hopper (9.0a), Blackwell (10.0, 12.0) plus PTX for newer GPUs, built against the environment's
# torch (the one the wheel will require). Each feature is gated at run time by the GPU's compute
# capability (fusible.fp8_available() and friends say what runs). Usage, in a venv with torch and
# the build tools (scripts/setup_env.sh makes one):
#   bash scripts/release_wheel.sh            # TORCH_CUDA_ARCH_LIST overrides the list
# The wheel is tagged linux_x86_64 (for direct distribution; PyPI needs a manylinux tag, e.g. from
# auditwheel with torch's libraries excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-"8.0;8.9;9.0a;10.0;12.0+PTX"}
want=$(grep -E '^torch==' requirements.txt | cut -d= -f3)
have=$("$PYTHON" -c "import torch; print(torch.__version__.split('+')[0])")
[ "$have" = "$want" ] || { echo "[release] the environment has torch $have, the wheel pins $want"; exit 1; }
rm -rf dist && mkdir -p dist
echo "[release] wheel for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST into dist/"
"$PYTHON" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -w dist \
  -C build-dir=build/release .
echo "[release] source distribution into dist/"
"$PYTHON" -c "from scikit_build_core.build import build_sdist; build_sdist('dist')"
ls -l dist
