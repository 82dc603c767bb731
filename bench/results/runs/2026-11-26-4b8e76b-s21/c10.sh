#!/bin/bash
# Session 21 call 10 (carry libZ2, this). Z2 = Z (call 9) + the memset fallback for preprocess grids too small to clear
# the accumulators (host code only; every kernel SASS-identical to Z's). (1) the backward test files, with the new
# accumulators-start-at-zero tests; (2) memcheck and initcheck on tests/gpu/sanitize_cuda.py and on the new tests.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s21/libZ2.tar.xz -C /tmp/libs && cp /tmp/libs/Z2/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
export PYTHONPATH=$PWD
mkdir -p $OUT/c10
timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_cuda_backward.py tests/gpu/test_cuda_hopper_backward.py -p no:cacheprovider -rs > $OUT/c10/bwd_tests.log 2>&1
tail -1 $OUT/c10/bwd_tests.log; grep -c "accumulators_start_at_zero" $OUT/c10/bwd_tests.log
timeout 120 python3 -m pytest -q -m gpu tests/gpu -k accumulators_start_at_zero -p no:cacheprovider -v > $OUT/c10/zero_tests.log 2>&1; tail -1 $OUT/c10/zero_tests.log
echo "tests done at $((SECONDS - T0)) s"
for tool in memcheck initcheck; do
  envs=""; [ $tool = initcheck ] && envs="PYTORCH_NO_CUDA_MEMORY_CACHING=1"
  env $envs timeout 200 compute-sanitizer --tool $tool python3 tests/gpu/sanitize_cuda.py > /tmp/san_$tool.log 2>&1
  tail -3 /tmp/san_$tool.log > $OUT/c10/sanitize_$tool.txt; cat $OUT/c10/sanitize_$tool.txt
  env $envs timeout 150 compute-sanitizer --tool $tool python3 -m pytest -q -m gpu tests/gpu -k accumulators_start_at_zero -p no:cacheprovider > /tmp/san_zero_$tool.log 2>&1
  tail -3 /tmp/san_zero_$tool.log > $OUT/c10/sanitize_zero_tests_$tool.txt; cat $OUT/c10/sanitize_zero_tests_$tool.txt
  echo "$tool done at $((SECONDS - T0)) s"
done
cd $OUT && tar czf /tmp/c10.tgz c10 && rm -rf c10 && mv /tmp/c10.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
