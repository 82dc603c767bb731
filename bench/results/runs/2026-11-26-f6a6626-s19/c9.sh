#!/bin/bash
# Session 19 call 9. G = c295147's library (SASS-identical to 8adf95f's); C1 = G with hd64 causal calls of up to 2048
# keys on the short causal schedule (two consumers, the cross-tile phase); C2 = G with the cross-tile phase added
# to hd64's long causal schedule (three consumers, paired walk). (1) hd64 Hopper forward tests on C1 and C2;
# (2) hd64 forward 1k / 2k / 4k, G / C1 / C2, 3 rounds.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s19/libs9.tar.xz -C /tmp/libs && cp /tmp/libs/G/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in G C1 C2; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
for v in C1 C2; do
  (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_forward.py -k "64 and not 640" -p no:cacheprovider 2>&1 | tail -3 > $OUT/tests_${v}_fwd.txt; echo "$v: $(tail -1 $OUT/tests_${v}_fwd.txt)")
done
for r in 1 2 3; do
  for v in G C1 C2; do
    impls=portattn; [ $r = 1 ] && [ $v = G ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 40 python3 bench/bench_attention.py --grid-only --seqlens 1024,2048,4096 --head-dims 64 --impls $impls --out $OUT/ab/fwd_${v}_r$r > $OUT/ab/fwd_${v}_r$r.log 2>&1)
    echo "fwd $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c9.tgz . && rm -rf ./* && mv /tmp/c9.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
