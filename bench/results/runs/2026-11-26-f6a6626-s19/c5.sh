#!/bin/bash
# Session 19 call 5. T = f6a6626's library; S1 / S5 = T with the hd128 forward TU built with short no-mask calls
# (<= 1024 query rows) of at least 1024 / 512 keys, and long ones from 1024 / 512 keys, on 176-key blocks.
# hd128 forward 512 / 1k / 2k, T / S1 / S5, 3 rounds.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s19/libs5.tar.xz -C /tmp/libs && cp /tmp/libs/T/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in T S1 S5; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
(cd /tmp/t_S5 && PYTHONPATH=/tmp/t_S5 timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_forward.py -k "128" -p no:cacheprovider 2>&1 | tail -3 > $OUT/tests_S5_fwd.txt; tail -1 $OUT/tests_S5_fwd.txt)
for r in 1 2 3; do
  for v in T S1 S5; do
    impls=portattn; [ $r = 1 ] && [ $v = T ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 40 python3 bench/bench_attention.py --grid-only --seqlens 512,1024,2048 --head-dims 128 --impls $impls --out $OUT/ab/fwd_${v}_r$r > $OUT/ab/fwd_${v}_r$r.log 2>&1)
    echo "fwd $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c5.tgz . && rm -rf ./* && mv /tmp/c5.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
