#!/usr/bin/env bash
# The wheel as a user gets it: a fresh venv with only torch (from pip's cache after setup_env.sh),
# the wheel scripts/build.sh packed into build/dist installed into it, then the quickstart of
# docs/quickstart.md (its Python blocks, on CPU) and `python -m fusible` run from outside the
# checkout. Fails on any error.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
venv=build/wheel-venv
rm -rf "$venv"
"$PY" -m venv "$venv"
torch_pin=$(grep -E '^torch==' requirements.txt)
echo "[wheel] fresh venv: $torch_pin, then $(ls build/dist/fusible-*.whl)"
"$venv/bin/python" -m pip install --disable-pip-version-check -q "$torch_pin"
"$venv/bin/python" -m pip install --disable-pip-version-check -q build/dist/fusible-*.whl
# The source distribution (scikit-build-core's build_sdist, as `python -m build --sdist` calls it)
# holds what a build needs.
rm -rf build/sdist && mkdir -p build/sdist
sdist=build/sdist/$(.venv/bin/python -c \
  "from scikit_build_core.build import build_sdist; print(build_sdist('build/sdist'))" | tail -1)
listing=$(tar -tzf "$sdist")
for member in pyproject.toml CMakeLists.txt cmake/fusibleConfig.cmake.in csrc/fusible.h \
  python_bindings/fusible/_version.py python_bindings/module.cpp; do
  grep -q "^[^/]*/$member\$" <<<"$listing" || { echo "[wheel] $sdist lacks $member"; exit 1; }
done
echo "[wheel] $sdist: $(wc -l <<<"$listing") files"
quickstart=$PWD/docs/quickstart.md
cd "$(mktemp -d)"  # not the checkout: the installed package must be the one imported
"$OLDPWD/$venv/bin/python" - "$quickstart" <<'PY'
import re
import sys

text = open(sys.argv[1]).read()
blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
          if not b.startswith("# requires: cuda")]
namespace = {}
for block in blocks:
    exec(compile(block, sys.argv[1], "exec"), namespace)
import fusible

assert fusible.__file__.startswith(sys.prefix), fusible.__file__
print(f"[wheel] the quickstart's {len(blocks)} Python blocks ran with fusible {fusible.__version__}")
PY
"$OLDPWD/$venv/bin/python" -m fusible
rm -rf "$OLDPWD/$venv"  # several GB
