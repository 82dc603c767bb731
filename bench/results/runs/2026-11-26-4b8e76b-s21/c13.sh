#!/bin/bash
# Session 21 call 13 (carry libZ4, this): the final library (Z4 = Z2 + the alignment guard, host code only; kernels
# SASS-identical): the two backward test files and the zeroing tests.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/libs && tar xJf .abB/s21/libZ4.tar.xz -C /tmp/libs && cp /tmp/libs/Z4/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
export PYTHONPATH=$PWD
timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_cuda_backward.py tests/gpu/test_cuda_hopper_backward.py tests/gpu/test_adversarial_bounds.py -p no:cacheprovider -rs > $OUT/bwd_tests_Z4.log 2>&1
tail -1 $OUT/bwd_tests_Z4.log
