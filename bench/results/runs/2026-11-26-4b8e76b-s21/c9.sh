#!/bin/bash
# Session 21 call 9 (carry libD0, libZ, this). Z = D0 + the accumulators zeroed by bwd_preprocess instead of a memset
# (Note [portattn backward zeroing]). (1) every gpu test on Z; (2) forward+backward grids D0 / Z, three interleaved rounds;
# (3) kernel breakdown of one step on each; (4) many short sequences, each once.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && for v in D0 Z; do tar xJf .abB/s21/lib$v.tar.xz -C /tmp/libs; done
cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
V="D0 Z"
for v in $V; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/c9/ab
(cd /tmp/t_Z && PYTHONPATH=/tmp/t_Z timeout 280 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rs > $OUT/c9/gpu_tests_Z.log 2>&1; tail -1 $OUT/c9/gpu_tests_Z.log)
echo "tests done at $((SECONDS - T0)) s"
for r in 1 2 3; do
  for v in $V; do
    [ $((SECONDS - T0)) -gt 470 ] && break 2
    impls=portattn; [ $r = 1 ] && [ $v = D0 ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 70 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128,64 --impls $impls --out $OUT/c9/ab/grid_${v}_r$r > $OUT/c9/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
for v in $V; do
  [ $((SECONDS - T0)) -gt 540 ] && break
  (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 30 python3 bench/bench_breakdown.py --points 128:1024:causal,128:2048:causal,64:512:causal --out $OUT/c9/breakdown_$v > $OUT/c9/breakdown_$v.log 2>&1)
  echo "breakdown $v rc=$? at $((SECONDS - T0)) s"
done
for v in $V; do
  [ $((SECONDS - T0)) -gt 560 ] && break
  (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 30 python3 bench/bench_short.py --head-dims 64,16 --impls portattn --out $OUT/c9/ab/short_${v}_r1 > $OUT/c9/ab/short_${v}_r1.log 2>&1)
  echo "short $v rc=$? at $((SECONDS - T0)) s"
done
find $OUT/c9 -name "*.png" -delete
cd $OUT && tar czf /tmp/c9.tgz c9 && rm -rf c9 && mv /tmp/c9.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
