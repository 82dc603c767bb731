#!/bin/bash
# Session 19 call 11 (the final library: the cross-tile phase for hd64 causal calls of 1025-4096 keys, both dtypes):
# every gpu test (bench/gpu_suite.sh tests); the hd64 / hd128 grid with SDPA cuDNN, medians of three processes.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/bench
T0=$SECONDS
C=$(cat .abB/s19/commit)
mkdir -p /tmp/libs && tar xJf .abB/s19/libH.tar.xz -C /tmp/libs && cp /tmp/libs/H/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
PORTATTN_COMMIT=$C PORTATTN_PACK=1 bash bench/gpu_suite.sh tests 2>&1 | tail -8
mkdir -p $OUT/grid3
PORTATTN_COMMIT=$C timeout 300 python3 bench/bench_attention.py --backward --grid-only --processes 3 --impls portattn,sdpa_cudnn --out $OUT/grid3 2>&1 | tail -30
find $OUT -name "*.png" -delete
echo "all done at $((SECONDS - T0)) s"
