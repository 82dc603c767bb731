#!/bin/bash
# One device-machine session for the CUDA backend: rebuild the per-Python
# binding against the carried libportattn_cuda.so, then the stages named in
# the arguments (tests, sanitize, bench, benchquick). Logs go to $OUT.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -2 || exit 1
python3 -c "from portattn.backends.cuda import _C; print(_C.build_config())" || exit 1
for stage in "$@"; do
  case "$stage" in
    tests)
      timeout 300 python3 -m pytest tests/gpu/test_cuda_forward.py -q -p no:cacheprovider \
        --maxfail=40 2>&1 | tee "$OUT/pytest_cuda_forward.log" | grep -v "^$" | tail -45 ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout 60 compute-sanitizer --tool $tool python3 tests/gpu/sanitize_cuda_forward.py 2>&1 \
          | tee "$OUT/sanitize_$tool.log" | tail -4
      done ;;
    bench)
      timeout 400 python3 bench/bench_attention.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60 ;;
    benchquick)
      timeout 120 python3 bench/bench_attention.py --quick --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -50 ;;
  esac
done
# Tuning A/B: a second library under .devbuild/B (same symbols), grid only, kernel only.
if [ -f .devbuild/B/libportattn_cuda.so ] && [[ " $* " == *" abtest "* ]]; then
  cp .devbuild/B/libportattn_cuda.so portattn/backends/cuda/libportattn_cuda.so
  timeout 200 python3 bench/bench_attention.py --grid-only --kernel-only --head-dims 64 --tag _B \
    --out "$OUT" 2>&1 | grep -E "^hd" | tee "$OUT/bench_B.log"
fi
