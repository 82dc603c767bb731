#!/bin/bash
# Session 19 call 12. H = e64ef0a's library; X2 = H with the hd64 bf16 forward TU built
# -DPORTATTN_HOPPER_FWD_HD64_CAUSAL_XTILE=2 (the cross-tile phase also for hd64 causal calls of 4097-8192 keys).
# (1) hd64 Hopper forward tests on X2; (2) hd64 forward 4k / 8k, H / X2, 3 rounds.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s19/libs12.tar.xz -C /tmp/libs && cp /tmp/libs/H/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in H X2; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
(cd /tmp/t_X2 && PYTHONPATH=/tmp/t_X2 timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_forward.py -k "64 and not 640" -p no:cacheprovider 2>&1 | tail -3 > $OUT/tests_X2_fwd.txt; echo "X2: $(tail -1 $OUT/tests_X2_fwd.txt)")
for r in 1 2 3; do
  for v in H X2; do
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 40 python3 bench/bench_attention.py --grid-only --seqlens 4096,8192 --head-dims 64 --impls portattn --out $OUT/ab/fwd_${v}_r$r > $OUT/ab/fwd_${v}_r$r.log 2>&1)
    echo "fwd $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c12.tgz . && rm -rf ./* && mv /tmp/c12.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
