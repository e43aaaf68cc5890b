#!/usr/bin/env bash
# On a GPU machine (its own torch, no network): builds against that torch with 16 jobs, runs every
# test (CUDA ones included) and the benchmarks, writes full logs to $OUT, and prints a summary last.
#   OUT=/some/dir bash scripts/gpu_check.sh
# STAGES picks a subset (default all but rows), for device calls with a time limit:
#   STAGES=build,test ...   then   STAGES=sanitize,bench ...
# STAGES=rows runs the FP8 / model rows (large MLP profiled, MoE with host times, the small
# MLP's host time, gpt_medium beside eager and compile) in one run.
set -uo pipefail
STAGES=${STAGES:-build,test,sanitize,bench}
stage() { [[ ",$STAGES," == *",$1,"* ]]; }
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu_check}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
PY=$(command -v python3)
# Build with the compiler whose libstdc++ the Python process loads: a newer compiler's headers
# instantiate std:: templates that then clash with the older runtime (a crash in iostreams).
compiler=""
[ -x /usr/bin/g++ ] && compiler="-DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++"
gtest_src=""
[ -d .device_shared/googletest ] && gtest_src="-DFUSIBLE_GTEST_SOURCE_DIR=$PWD/.device_shared/googletest"

t0=$(date +%s)
build_rc=skipped
if stage build; then
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PY" $gtest_src $compiler \
    >"$OUT/configure.log" 2>&1 && cmake --build build/gpu -j 16 >"$OUT/build.log" 2>&1
  build_rc=$?
fi
build_s=$(( $(date +%s) - t0 ))
# The Python package: sources beside the built libraries.
cp -r python_bindings/fusible/. build/gpu/python/fusible/ 2>/dev/null
export PYTHONPATH=$PWD/build/gpu/python

if stage test; then
  ctest --test-dir build/gpu -j 8 --output-on-failure >"$OUT/ctest.log" 2>&1
  # (The CUDA long run runs once, below, where its figures are printed.)
  (cd tests/python && PYTHONUNBUFFERED=1 "$PY" -m pytest -q -rs -p no:cacheprovider . \
    --deselect "test_long_run.py::test_memory_and_live_objects_stay_flat_over_a_long_run[cuda]") \
    >"$OUT/pytest.log" 2>&1
  # The long run's figures (memory and live objects before and after), printed with -s.
  (cd tests/python && "$PY" -m pytest -q -s -p no:cacheprovider test_long_run.py -k cuda) >"$OUT/long_run.log" 2>&1
  PY="$PY" bash scripts/fuzz.sh --minutes "${FUZZ_MINUTES:-1}" --device cuda >"$OUT/fuzz.log" 2>&1
  "$PY" examples/python/train_mlp.py --steps 200 >"$OUT/demo.log" 2>&1
  build/gpu/train_mlp 200 >"$OUT/demo_cpp.log" 2>&1
fi
stage sanitize && OUT="$OUT" bash scripts/gpu_sanitize.sh >"$OUT/sanitize.log" 2>&1
if stage bench; then
  BENCH_OUT="$OUT" "$PY" bench/bench_mlp.py --profile >"$OUT/bench.log" 2>&1
  (cd bench && BENCH_OUT="$OUT" "$PY" bench_small_host.py) >>"$OUT/bench.log" 2>&1
  "$PY" bench/plot_ratios.py "$OUT/latest.json" "$OUT/ratios.png" >>"$OUT/bench.log" 2>&1
  BENCH_OUT="$OUT" "$PY" bench/bench_init.py >>"$OUT/bench.log" 2>&1
  "$PY" bench/bench_host_overhead.py --device cuda --stat min >>"$OUT/bench.log" 2>&1
fi
if stage rows; then
  # gpt_medium's default batch (24) does not fit an 80 GB card.
  batch=""
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  [ "${mib:-0}" -lt 100000 ] && batch="--batch 12"
  BENCH_OUT="$OUT" "$PY" bench/bench_mlp.py --parts large --profile --reps 20 >"$OUT/rows_mlp.log" 2>&1
  BENCH_OUT="$OUT" "$PY" bench/bench_moe.py --reps 20 --host >"$OUT/rows_moe.log" 2>&1
  BENCH_OUT="$OUT" "$PY" bench/bench_fp8_small_host.py --rounds 5 >"$OUT/rows_small.log" 2>&1
  BENCH_OUT="$OUT" "$PY" bench/bench_model.py --sizes gpt_medium $batch --reps 6 --warmup 2 \
    --variants eager,compile,fusible,fp8_current,fp8_delayed >"$OUT/rows_gpt.log" 2>&1
fi

echo "== gpu_check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
echo "build: rc=$build_rc in ${build_s}s (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
[ "$build_rc" != 0 ] && [ "$build_rc" != skipped ] && grep -E "error" "$OUT/build.log" | head -20
if stage test; then
  echo "ctest: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
  grep -E "^\s+[0-9]+ - .*(Failed|Exception)" "$OUT/ctest.log" | head -10
  echo "pytest: $(tail -1 "$OUT/pytest.log")"
  grep -E "^FAILED" "$OUT/pytest.log" | head -10
  echo "fuzz (CUDA): $(grep -m1 "^fuzz:" "$OUT/fuzz.log")"
  grep -m1 "^long run" "$OUT/long_run.log"
  grep -E "^FAIL " "$OUT/fuzz.log" | head -5
  echo "demo: $(tail -1 "$OUT/demo.log")"
  echo "demo (C++): $(tail -1 "$OUT/demo_cpp.log")"
fi
stage sanitize && { echo "compute-sanitizer:"; cat "$OUT/sanitize.log"; }
stage bench && { echo "bench:"; grep -v "^-\|^ " "$OUT/bench.log" | tail -40; }
if stage rows; then
  for f in mlp moe small gpt; do echo "rows ($f):"; grep -v "^-\|^ " "$OUT/rows_$f.log" | tail -14; done
fi
