#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer: builds libfusible, fusible._C and the gtest binary
# in build/sanitize (CPU only: the CUDA kernels run under compute-sanitizer, scripts/gpu_sanitize.sh),
# then runs the gtest binary and the pytest suite under them (the ASan runtime preloaded into
# Python). Fails on any ASan or UBSan report, and on any direct leak whose allocation stack passes
# through our code (libfusible, fusible._C) other than a Python object's: Python and torch keep
# memory until exit by design (Python objects alive at exit are not freed, nor what they own: the
# indirect leaks), so those are not ours to report. Logs in build/sanitize/logs.
#   bash scripts/sanitize.sh [pytest args...]     (default: the whole tests/python suite)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(command -v "${PY:-$PWD/.venv/bin/python}")
BUILD=build/sanitize
LOGS=$PWD/$BUILD/logs
rm -rf "$LOGS" && mkdir -p "$LOGS"
start=$(date +%s)

# vptr checks need the RTTI of every class across torch's libraries, which were built without
# UBSan; the other UB checks are local to our code.
flags="-fsanitize=address,undefined -fno-sanitize=vptr -fno-omit-frame-pointer -g1 -O0"
# Reports go to a file per process and the script decides (below): the exit code is shared by
# errors and leaks, and Python's own leaks must not fail a run. A process that an error stopped
# is caught by its missing summary line.
export ASAN_OPTIONS="detect_leaks=1:exitcode=0:log_path=$LOGS/asan:protect_shadow_gap=0:detect_odr_violation=0"
export LSAN_OPTIONS="report_objects=0:max_leaks=0"
export UBSAN_OPTIONS="print_stacktrace=1:log_path=$LOGS/ubsan"
# The build runs the test binary to list its tests: the same runtime options apply. Build type
# None: no flags of its own (an empty one becomes Release in CMakeLists.txt, whose -O3 then comes
# after the -O0 above and triples the compile time).
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DFUSIBLE_CUDA=OFF -DFUSIBLE_BUILD_EXAMPLES=OFF -DPython_EXECUTABLE="$PY" >"$LOGS/../configure.log" 2>&1 &&
  cmake --build "$BUILD" -j "$(nproc)" >"$LOGS/../build.log" 2>&1
build_rc=$?
if [ $build_rc -ne 0 ]; then
  tail -30 "$LOGS/../build.log"
  echo "[sanitize] build failed"
  exit 1
fi
echo "[sanitize] built in $(( $(date +%s) - start )) s"
rm -f "$LOGS"/*  # reports from the build's test listing are not runs

echo "[sanitize] gtest"
"$BUILD/fusible_tests" --gtest_brief=1 >"$LOGS/gtest.txt" 2>&1
gtest_rc=$?
tail -3 "$LOGS/gtest.txt"

echo "[sanitize] pytest"
cp -r python_bindings/fusible/. "$BUILD/python/fusible/"
# The ASan runtime must come first, and libstdc++ with it: python does not link libstdc++, and
# ASan's exception interceptor finds no __cxa_throw to forward to otherwise. PYTHONMALLOC=malloc
# lets ASan see Python's allocations.
preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
# FUSIBLE_SANITIZE: the tensor-parallel tests run two ranks, not also four (test_tensor_parallel.py).
(cd tests/python && FUSIBLE_SANITIZE=1 PYTHONPATH="$PWD/../../$BUILD/python" LD_PRELOAD="$preload" PYTHONMALLOC=malloc \
  "$PY" -m pytest -q -p no:cacheprovider "${@:-.}") >"$LOGS/pytest.txt" 2>&1
pytest_rc=$?
tail -1 "$LOGS/pytest.txt"

# Reports: any ASan error or UBSan runtime error, and direct leaks through our code that Python's
# allocator did not make (frame #1 in CPython's own sources). Not seen: a leak whose stack the fast
# unwinder cuts off inside torch's libraries (built without frame pointers: a tensor allocated by
# ATen), and a Python object our bindings keep a reference to too many (Python's allocator made
# it); the long-run test counts live Python objects for the latter.
errors=$(grep -l -E "ERROR: AddressSanitizer|runtime error:" "$LOGS"/asan.* "$LOGS"/ubsan.* 2>/dev/null)
ours=$(awk 'function flush() {
              if (block != "" && !python && block ~ /libfusible|fusible\/_C\.|fusible::/) print block
              block = ""
            }
            FNR == 1 {flush()}
            /^Direct leak/ {flush(); block=$0; python=0; next}
            /^Indirect leak/ {flush(); next}
            block != "" && /^ +#1 / && / (Objects|Python|Modules)\/[A-Za-z_]+\.c:/ {python=1}
            block != "" && /^$/ {flush(); next}
            block != "" {block = block "\n" $0}
            END {flush()}' "$LOGS"/asan.* 2>/dev/null)
leaks_all=$(cat "$LOGS"/asan.* 2>/dev/null | grep -c -E "^(Direct|Indirect) leak")
echo "[sanitize] done in $(( $(date +%s) - start )) s: gtest rc=$gtest_rc, pytest rc=$pytest_rc," \
  "leak reports $leaks_all (ours: $(printf '%s' "$ours" | grep -c -E '^(Direct|Indirect) leak'))"
status=0
if [ -n "$errors" ]; then
  echo "[sanitize] reports in: $errors"
  for f in $errors; do grep -m1 -A25 -E "ERROR: AddressSanitizer|runtime error:" "$f"; done
  status=1
fi
if [ -n "$ours" ]; then
  echo "[sanitize] leaks through fusible:"
  printf '%s\n' "$ours" | head -60
  status=1
fi
grep -q "PASSED" "$LOGS/gtest.txt" && ! grep -q "FAILED" "$LOGS/gtest.txt" || { echo "[sanitize] gtest did not pass"; status=1; }
tail -1 "$LOGS/pytest.txt" | grep -q " passed" && ! tail -1 "$LOGS/pytest.txt" | grep -q "failed" ||
  { echo "[sanitize] pytest did not pass"; status=1; }
[ $gtest_rc -ne 0 ] || [ $pytest_rc -ne 0 ] && status=1
exit $status
