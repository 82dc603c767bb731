#!/bin/bash
# Session 17 call 9. O = 66478de's library (hd256 backward, one Q / dO stage); S = O + dO / delta on their own
# full / empty barriers, released after the step's dV (Traits::kSplitQdo). (1) every Hopper backward test on S;
# (2) hd256 / hd192 forward+backward, O / S interleaved, 3 rounds.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s17/libs3.tar.xz -C /tmp/libs && cp /tmp/libs/S/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in O S; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
(cd /tmp/t_S && PYTHONPATH=/tmp/t_S timeout 200 python3 -m pytest -q -x tests/gpu/test_cuda_hopper_backward.py -p no:cacheprovider 2>&1 | tail -1 | sed "s/^/S: /" | tee $OUT/tests_S.txt)
echo "tests done at $((SECONDS - T0)) s"
for r in 1 2 3; do
  for v in O S; do
    [ $((SECONDS - T0)) -gt 530 ] && break 2
    impls=portattn; [ $r = 1 ] && [ $v = S ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 80 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 256,192 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c9.tgz . && rm -rf ./* && mv /tmp/c9.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
