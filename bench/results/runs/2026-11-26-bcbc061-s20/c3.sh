#!/bin/bash
# Session 20 call 3. D0 = HEAD's tree rebuilt (hd64 / hd128 bf16 backward TUs); R = D0 with PORTATTN_HOPPER_BWD_ROTATE_M=1
# (key block n starts its walk over the query blocks at n mod m_blocks and wraps, so the CTAs of one head add dQ into
# different query blocks at once); RW = R with the 80-query hd128 backward.
# (1) every Hopper backward test on R, hd128 backward tests on RW; (2) fwd+bwd grids hd128 + hd64, rounds interleaved.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s20/libs3.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in D0 R RW; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
(cd /tmp/t_R && PYTHONPATH=/tmp/t_R timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_R_bwd.txt; tail -1 $OUT/tests_R_bwd.txt)
(cd /tmp/t_RW && PYTHONPATH=/tmp/t_RW timeout 60 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -k "128" -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_RW_bwd128.txt; tail -1 $OUT/tests_RW_bwd128.txt)
echo "tests done at $((SECONDS - T0)) s"
for r in 1 2 3; do
  for v in D0 R RW; do
    [ $((SECONDS - T0)) -gt 540 ] && break 2
    impls=portattn; [ $r = 1 ] && [ $v = D0 ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 70 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128,64 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c3.tgz . && rm -rf ./* && mv /tmp/c3.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
