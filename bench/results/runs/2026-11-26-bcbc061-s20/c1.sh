#!/bin/bash
# Session 20 call 1. D0 = HEAD's tree rebuilt (hd64/hd128 bf16 Hopper TUs); D2 = D0 with PORTATTN_DESC_ADD64=2
# (descriptors as 64-bit adds, the stage base kept opaque: UIADD3.64 with immediates, as flash-attn-4's SASS);
# WA = D2 with the 80-query hd128 backward (PORTATTN_HOPPER_BWD_WIDE_STEPS=1).
# (1) hd128 backward tests on WA, forward tests on D2; (2) fwd+bwd grids hd128+hd64, D0 / D2 / WA, rounds interleaved.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s20/libs1.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in D0 D2 WA; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
(cd /tmp/t_WA && PYTHONPATH=/tmp/t_WA timeout 110 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -k "128" -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_WA_bwd128.txt; tail -1 $OUT/tests_WA_bwd128.txt)
echo "bwd tests done at $((SECONDS - T0)) s"
(cd /tmp/t_D2 && PYTHONPATH=/tmp/t_D2 timeout 60 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_forward.py -k "64 or 128" -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_D2_fwd.txt; tail -1 $OUT/tests_D2_fwd.txt)
echo "fwd tests done at $((SECONDS - T0)) s"
for r in 1 2 3; do
  for v in D0 D2 WA; do
    [ $((SECONDS - T0)) -gt 520 ] && break 2
    impls=portattn; [ $r = 1 ] && [ $v = D0 ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 75 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128,64 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c1.tgz . && rm -rf ./* && mv /tmp/c1.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
