#!/bin/bash
# Session 20 call 4. D0 = HEAD tree rebuilt (hd64 / hd128 bf16 backward TUs); M = D0 with PORTATTN_HOPPER_BWD_DQ_MBAR=1
# (the bulk-dQ hand-off on mbarriers: each consumer warp arrives on full[b], waits on empty[b], so the two consumers
# are no longer held for each other there; flash-attn-4 hands each warpgroup its own half); MW = M + 80-query hd128.
# (1) every Hopper backward test on M, hd128 backward tests on MW; (2) fwd+bwd grids hd128 + hd64, rounds interleaved.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s20/libs4.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in D0 M MW; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
(cd /tmp/t_M && PYTHONPATH=/tmp/t_M timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_M_bwd.txt; tail -1 $OUT/tests_M_bwd.txt)
(cd /tmp/t_MW && PYTHONPATH=/tmp/t_MW timeout 60 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -k "128" -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_MW_bwd128.txt; tail -1 $OUT/tests_MW_bwd128.txt)
echo "tests done at $((SECONDS - T0)) s"
for r in 1 2 3; do
  for v in D0 M MW; do
    [ $((SECONDS - T0)) -gt 540 ] && break 2
    impls=portattn; [ $r = 1 ] && [ $v = D0 ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 70 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128,64 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c4.tgz . && rm -rf ./* && mv /tmp/c4.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
