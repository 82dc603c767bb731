#!/bin/bash
# One device call for the opt-in Hopper forward kernel (csrc/hopper_fwd_*.cu):
# rebuild the per-Python binding with PORTATTN_CUDA_HOPPER=1 against a library
# built on the dev machine and carried in .portattn_build/hopper_carry/
#   PORTATTN_CUDA_ARCHS=90 PORTATTN_HEADDIMS=64,128 PORTATTN_CUDA_HOPPER=1 \
#     python3 -c "...build.build('<dir>/_C<suffix>', ...)"   (then copy <dir>/libportattn_cuda.so)
# then the correctness grid and the timing table against SDPA cuDNN; logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PORTATTN_CUDA_HOPPER=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/device.txt"
cp .portattn_build/hopper_carry/libportattn_cuda.so portattn/backends/cuda/ || exit 1
python3 portattn/backends/cuda/build.py --binding-only --build-temp /tmp/b 2>&1 | tail -1 || exit 1
PYTHONPATH=$PWD timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -v -p no:cacheprovider -rs \
  -k "not timing" tests/gpu/test_cuda_hopper_forward.py > "$OUT/hopper_tests.log" 2>&1
echo "pytest exit $?"
grep -v " PASSED" "$OUT/hopper_tests.log" | tail -40
PYTHONPATH=$PWD:$PWD/tests:$PWD/tests/gpu timeout "${TIMING_TIMEOUT:-60}" \
  python3 tests/gpu/test_cuda_hopper_forward.py 2>&1 | tee "$OUT/hopper_timing.md" | tail -16
