#!/bin/bash
# Session 20 call 6. P = the tree's full build (PORTATTN_CUDA_ARCHS=90): every kernel of the forward, backward and
# decode paths launched with programmatic dependent launch (pdl.cuh), waiting for the previous grid at its top.
# A/B in one library: PORTATTN_PDL=1 (default) against PORTATTN_PDL=0 (plain launches), rounds interleaved.
# (1) the PDL test, CUDA-graph and decode tests; (2) fwd+bwd grids hd64 + hd128, three rounds; many short sequences.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/bench
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s20/libs6.tar.xz -C /tmp/libs && cp /tmp/libs/P/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
mkdir -p $OUT/ab
timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_cuda_pdl.py tests/gpu/test_cuda_graphs.py tests/gpu/test_cuda_decode.py -p no:cacheprovider 2>&1 | tail -15 > $OUT/tests_pdl.txt; tail -1 $OUT/tests_pdl.txt
echo "tests done at $((SECONDS - T0)) s"
for r in 1 2 3; do
  for v in 1 0; do
    [ $((SECONDS - T0)) -gt 480 ] && break 2
    impls=portattn; [ $r = 1 ] && [ $v = 1 ] && impls=portattn,sdpa_cudnn
    PORTATTN_PDL=$v timeout 70 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128,64 --impls $impls --out $OUT/ab/grid_pdl$v\_r$r > $OUT/ab/grid_pdl$v\_r$r.log 2>&1
    echo "grid pdl$v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
for r in 1 2; do
  for v in 1 0; do
    [ $((SECONDS - T0)) -gt 540 ] && break 2
    PORTATTN_PDL=$v timeout 60 python3 bench/bench_short.py --impls portattn --out $OUT/ab/short_pdl$v\_r$r > $OUT/ab/short_pdl$v\_r$r.log 2>&1
    echo "short pdl$v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c6.tgz . && rm -rf ./* && mv /tmp/c6.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
