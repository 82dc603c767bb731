#!/bin/bash
# One device-machine session for the CUDA backward pass: install the carried
# libportattn_cuda.so (built here, sm_90, ignored path .bwdbuild/), rebuild the
# per-Python binding, then the stages named in the arguments. Logs go to $OUT.
#   tests      tests/gpu/test_cuda_backward.py (PYTEST_ARGS adds options)
#   sanitize   compute-sanitizer memcheck + racecheck on sanitize_cuda_backward.py
#   bench      bench/bench_backward.py (BENCH_ARGS adds options, e.g. --quick)
#   train      bench/train_check.py
set -o pipefail
export PYTHONPATH=$PWD:$PWD/bench PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
cp .bwdbuild/libportattn_cuda.so portattn/backends/cuda/ || exit 1
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1 || exit 1
python3 -c "from portattn.backends.cuda import _C; print(_C.build_config())" || exit 1
for stage in "$@"; do
  case "$stage" in
    tests)
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu/test_cuda_backward.py -q -p no:cacheprovider \
        $PYTEST_ARGS 2>&1 | tee "$OUT/pytest_cuda_backward.log" | grep -v "^$" | tail -40 ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout 200 compute-sanitizer --tool $tool python3 tests/gpu/sanitize_cuda_backward.py 2>&1 \
          | tee "$OUT/sanitize_bwd_$tool.log" | tail -4
      done ;;
    bench)
      timeout ${BENCH_TIMEOUT:-400} python3 bench/bench_backward.py --out "$OUT" $BENCH_ARGS 2>&1 \
        | tee "$OUT/bench_backward.log" | tail -40 ;;
    train)
      timeout 200 python3 bench/train_check.py --out "$OUT" 2>&1 | tee "$OUT/train_check.log" | tail -3 ;;
  esac
done
