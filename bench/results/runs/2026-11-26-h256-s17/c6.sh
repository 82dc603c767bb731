#!/bin/bash
# Session 17 call 6: the hd256 Hopper backward (head dim split over two CTAs). (1) The Hopper backward tests (their
# grids now include 256) and the hd256 dispatch test; (2) hd256 training grid against the sm80+ path, SDPA flash
# and cuDNN.
export PYTHONUNBUFFERED=1
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
export PYTHONPATH=$PWD:$PWD/bench
mkdir -p $OUT/latest
timeout 300 python3 -m pytest -q -x tests/gpu/test_cuda_hopper_backward.py "tests/gpu/test_cuda_hopper_forward.py::test_dispatch_serves_hd256_forward_and_training_on_hopper" "tests/gpu/test_cuda_hopper_forward.py::test_dispatch_serves_padded_head_dims_on_hopper_where_a_pass_has_them" -p no:cacheprovider -k "256 or hd256 or padded" 2>&1 | tail -25 | tee $OUT/tests_hd256.txt
echo "hd256 tests done at $((SECONDS - T0)) s"
PORTATTN_COMMIT=h256 timeout 200 python3 bench/bench_attention.py --backward --grid-only --head-dims 256 --impls portattn,portattn_sm80,sdpa_flash,sdpa_cudnn --name cuda_fwd_bwd_hd256 --out $OUT/latest 2>&1 | tail -16
echo "hd256 grid done at $((SECONDS - T0)) s"
timeout $((580 - SECONDS + T0)) python3 -m pytest -q tests/gpu/test_cuda_hopper_backward.py -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/tests_bwd_all.txt
echo "all backward tests done at $((SECONDS - T0)) s"
cd $OUT && tar czf /tmp/c6.tgz . && rm -rf ./* && mv /tmp/c6.tgz $OUT/
