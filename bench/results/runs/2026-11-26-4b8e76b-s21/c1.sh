#!/bin/bash
# Session 21 call 1. Softmax reduction chains (Note [portattn softmax reduction chains]): D0 = HEAD's kernels
# (PORTATTN_SOFTMAX_MAX_PARTS=1, SASS-identical to e64ef0a); M2 / M4 / M8 = the row maximum over 2 / 4 / 8
# independent accumulators; M4S4 = M4 with the row sum over 4 as well. Only the hd64 / hd128 bf16 Hopper forward
# TUs differ. (1) Hopper forward tests hd64/hd128 on M4S4; (2) forward grids, rounds interleaved;
# (3) many short sequences hd64 forward, each build once.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s21/libs1.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
V="D0 M2 M4 M8 M4S4"
for v in $V; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/device.txt
(cd /tmp/t_M4S4 && PYTHONPATH=/tmp/t_M4S4 timeout 90 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_forward.py -k "64 or 128" -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_M4S4_fwd.txt; tail -1 $OUT/tests_M4S4_fwd.txt)
echo "fwd tests done at $((SECONDS - T0)) s"
for r in 1 2 3; do
  for v in $V; do
    [ $((SECONDS - T0)) -gt 480 ] && break 2
    impls=portattn; [ $r = 1 ] && [ $v = D0 ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 60 python3 bench/bench_attention.py --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128,64 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
for v in $V; do
  [ $((SECONDS - T0)) -gt 540 ] && break
  (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 40 python3 bench/bench_short.py --head-dims 64 --impls portattn --out $OUT/ab/short_${v}_r1 > $OUT/ab/short_${v}_r1.log 2>&1)
  echo "short $v rc=$? at $((SECONDS - T0)) s"
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c1.tgz . && rm -rf ./* && mv /tmp/c1.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
