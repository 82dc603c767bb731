#!/bin/bash
# Session 20 call 8: the bulk-dQ copies. Call 7's timeline: the reducing warp's copy of a step's dQ tile takes as long
# as the step (4046 of 4170 cycles at hd128 2k), and it waits ~45 cycles for the next tile: the copies, one in flight
# at a time, pace the step. D0 = HEAD's tree rebuilt; I2 = two copies in flight (PORTATTN_HOPPER_BWD_DQ_INFLIGHT=2: a
# step's buffer released once the next step's copy is issued and this one has read it); P4 = each step's copy as 4
# bulk operations of 16 rows (one group); I2P4 = both. TI2 / TP4: I2 / I2P4 with the hd128 timeline.
# (1) every Hopper backward test on I2P4, the hd128 ones on I2; (2) timelines; (3) fwd+bwd grids, three rounds.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s20/libs8.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in D0 I2 P4 I2P4 TI2 TP4; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab $OUT/timeline
(cd /tmp/t_I2P4 && PYTHONPATH=/tmp/t_I2P4 timeout 130 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -p no:cacheprovider 2>&1 | tail -15 > $OUT/tests_I2P4_bwd.txt; tail -1 $OUT/tests_I2P4_bwd.txt)
(cd /tmp/t_I2 && PYTHONPATH=/tmp/t_I2 timeout 60 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -k "128 or 64" -p no:cacheprovider 2>&1 | tail -15 > $OUT/tests_I2_bwd.txt; tail -1 $OUT/tests_I2_bwd.txt)
for v in TI2 TP4; do (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v timeout 60 python3 bench/bwd_timeline.py --seqlen 2048 --out $OUT/timeline/${v}_s2048.json > $OUT/timeline/${v}_s2048.txt 2>&1); sed -n 2,16p $OUT/timeline/${v}_s2048.txt; done
echo "tests, timelines done at $((SECONDS - T0)) s"
for r in 1 2 3; do
  for v in D0 I2 P4 I2P4; do
    [ $((SECONDS - T0)) -gt 520 ] && break 2
    impls=portattn; [ $r = 1 ] && [ $v = D0 ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 70 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128,64 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c8.tgz . && rm -rf ./* && mv /tmp/c8.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
