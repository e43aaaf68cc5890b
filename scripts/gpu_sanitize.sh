#!/usr/bin/env bash
# compute-sanitizer (memcheck and racecheck) over the CUDA tests: the gtest CUDA suites and the
# pytest CUDA kernel tests, with PyTorch's caching allocator off so memcheck sees every
# allocation's real bounds (racecheck over pytest: bf16 and fp32 at the two small shapes, for time). Needs a built build/gpu (scripts/gpu_check.sh). Prints one line per run
# and exits non-zero on any reported error.
#   OUT=/some/dir bash scripts/gpu_sanitize.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu_check}
mkdir -p "$OUT"
PY=$(command -v python3)
export PYTHONPATH=$PWD/build/gpu/python PYTORCH_NO_CUDA_MEMORY_CACHING=1
GTEST_FILTER='*Cuda*:*NativeKernels*:*GemmEpilogues*'
status=0
run() {  # name, command...
  local name=$1
  shift
  timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --error-exitcode 9 "$@" >"$OUT/sanitize_$name.log" 2>&1
  local rc=$?
  echo "sanitize $name: rc=$rc; $(grep -E '(ERROR|RACECHECK) SUMMARY' "$OUT/sanitize_$name.log" | tail -1)"
  [ $rc -ne 0 ] && status=1
}
for tool in memcheck racecheck; do
  run "gtest_$tool" --tool "$tool" build/gpu/fusible_tests --gtest_filter="$GTEST_FILTER"
done
# Left out: CUDA-graph capture (it cannot allocate with the caching allocator off) and the
# profiler-based dispatch check (CUPTI does not run under the sanitizer).
run pytest_memcheck --tool memcheck "$PY" -m pytest -q -p no:cacheprovider -x \
  tests/python/test_cuda_kernels.py tests/python/test_dropout.py -k "not graph and not kernels_run"
run pytest_racecheck --tool racecheck "$PY" -m pytest -q -p no:cacheprovider -x \
  tests/python/test_cuda_kernels.py -k "(dtype0 or dtype2) and (shape0 or shape1) and not kernels_run"
# The FP8 cast (shared-memory transpose) and GEMM ops, and FP8 weights (no profiler there).
run pytest_fp8_memcheck --tool memcheck "$PY" -m pytest -q -p no:cacheprovider -x \
  tests/python/test_fp8.py -k "cuda and (Fp8CastOp or Fp8GemmOp or Fp8Weights)"
run pytest_fp8_racecheck --tool racecheck "$PY" -m pytest -q -p no:cacheprovider -x \
  tests/python/test_fp8.py -k "cuda and Fp8CastOp"
exit $status
