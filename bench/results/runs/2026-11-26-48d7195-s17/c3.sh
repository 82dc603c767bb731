#!/bin/bash
# Session 17 call 3. F = cda530b's library; the Hopper backward (bf16 hd64 / hd128) with some of a step's LSE / delta
# columns read before the wait they feed (PORTATTN_HOPPER_BWD_LSE_EARLY_COLS / _DELTA_EARLY_COLS; the LSE only in
# kernels without a mask): L4D4 = 4 / 4, L8D4 = 8 / 4, D4 = 0 / 4. (1) Hopper backward tests on L8D4 and L4D4;
# (2) grid 512-16k hd128/hd64 forward+backward, builds interleaved, 3 rounds.
export PYTHONUNBUFFERED=1
T0=$SECONDS
V="F L4D4 L8D4 D4"
mkdir -p /tmp/libs && tar xJf .abB/s17/libs2.tar.xz -C /tmp/libs && cp /tmp/libs/F/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in $V; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
for v in L8D4 L4D4; do
(cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v timeout 100 python3 -m pytest -q -x tests/gpu/test_cuda_hopper_backward.py -p no:cacheprovider 2>&1 | tail -1 | sed "s/^/$v: /" | tee $OUT/tests_$v.txt)
echo "tests $v done at $((SECONDS - T0)) s"
done
for r in 1 2 3; do
  for v in $V; do
    [ $((SECONDS - T0)) -gt 540 ] && break 2
    impls=portattn; [ $r = 1 ] && [ $v = F ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 60 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128,64 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c3.tgz . && rm -rf ./* && mv /tmp/c3.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
