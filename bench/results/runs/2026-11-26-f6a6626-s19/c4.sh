#!/bin/bash
# Session 19 call 4. O = HEAD's library; T = the tree's build (forward: 176-key blocks from 2048 keys without a mask;
# backward: the 80-query option off, warp 2 walking every key block of its CTA, the new dQ swizzle key);
# K2 / K4 = T with the hd128 / hd64 bf16 backward TUs built -DPORTATTN_HOPPER_BWD_BLOCKS_PER_CTA=2 / 4.
# (1) every Hopper backward test on K2; every Hopper forward test on T; (2) fwd+bwd grids hd128 and hd64,
# O / T / K2 / K4, 2 rounds.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s19/libs4.tar.xz -C /tmp/libs && cp /tmp/libs/T/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in O T K2 K4; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
(cd /tmp/t_K2 && PYTHONPATH=/tmp/t_K2 timeout 130 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_K2_bwd.txt; tail -1 $OUT/tests_K2_bwd.txt)
echo "bwd tests done at $((SECONDS - T0)) s"
(cd /tmp/t_T && PYTHONPATH=/tmp/t_T timeout 130 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_forward.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_T_fwd.txt; tail -1 $OUT/tests_T_fwd.txt)
echo "fwd tests done at $((SECONDS - T0)) s"
for r in 1 2; do
  for v in O T K2 K4; do
    [ $((SECONDS - T0)) -gt 540 ] && break 2
    impls=portattn; [ $r = 1 ] && [ $v = O ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 80 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128,64 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c4.tgz . && rm -rf ./* && mv /tmp/c4.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
