#!/bin/bash
# Session 20 call 9: deferred dK (PORTATTN_HOPPER_BWD_DEFER_DK=1, the hd128 bf16 backward TU): step t's dK = dS^T Q
# issued in step t + 1 behind S^T and dP^T, both operands from shared memory, so it runs in the window where both
# warpgroups exponentiate (call 7's timeline). D0 = call 8's D0 (SASS-identical to HEAD); DK; TDK = DK + timeline.
# (1) hd128 backward tests on DK; (2) timeline; (3) fwd+bwd grids hd128, three rounds.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s20/libs9.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in D0 DK TDK; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab $OUT/timeline
(cd /tmp/t_DK && PYTHONPATH=/tmp/t_DK timeout 90 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -k "128" -p no:cacheprovider 2>&1 | tail -15 > $OUT/tests_DK_bwd128.txt; tail -1 $OUT/tests_DK_bwd128.txt)
(cd /tmp/t_TDK && PYTHONPATH=/tmp/t_TDK timeout 60 python3 bench/bwd_timeline.py --seqlen 2048 --out $OUT/timeline/TDK_s2048.json > $OUT/timeline/TDK_s2048.txt 2>&1; sed -n 2,16p $OUT/timeline/TDK_s2048.txt)
echo "tests, timeline done at $((SECONDS - T0)) s"
for r in 1 2 3; do
  for v in D0 DK; do
    [ $((SECONDS - T0)) -gt 330 ] && break 2
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 50 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128 --impls portattn --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c9.tgz . && rm -rf ./* && mv /tmp/c9.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
