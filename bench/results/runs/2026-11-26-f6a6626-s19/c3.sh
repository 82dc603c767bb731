#!/bin/bash
# Session 19 call 3. O = HEAD's library; N = the tree's build (80-query hd128 backward); NP = N with the hd128 backward
# TUs built -DPORTATTN_HOPPER_BWD_PIPELINE=0 (dQ published right after its staging); NL = N with hd128 bf16 backward
# built -DPORTATTN_HOPPER_BWD_LATE_DK=0; F3 = O with the hd128 forward at 176-key blocks from 2048 keys.
# (1) hd128 fwd+bwd grid O / N / NP / NL, 2 rounds; (2) hd128 2k / 4k forward O / F3, 3 rounds.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s19/libs3.tar.xz -C /tmp/libs && cp /tmp/libs/O/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in O N NP NL F3; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
for r in 1 2; do
  for v in O N NP NL; do
    impls=portattn; [ $r = 1 ] && [ $v = O ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 80 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
for r in 1 2 3; do
  for v in O F3; do
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 40 python3 bench/bench_attention.py --grid-only --seqlens 2048,4096 --head-dims 128 --impls portattn --out $OUT/ab/fwd_${v}_r$r > $OUT/ab/fwd_${v}_r$r.log 2>&1)
    echo "fwd $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c3.tgz . && rm -rf ./* && mv /tmp/c3.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
