#!/bin/bash
# Session 20 call 2. D0 = HEAD's tree rebuilt; W = D0 with the 80-query hd128 backward (WIDE_STEPS=1);
# WL = W with the step's LSE columns read into registers before the S^T wait (LSE_EARLY=2: flash-attn-4's order);
# WLD = WL with the delta columns read before the dP^T wait too (DELTA_EARLY=1);
# L3D = D0 with LSE and delta early in every kernel without softcap (64-query no-mask kernels included; hd64's bulk
# no-mask kernel spills 20 bytes in its loop).
# (1) hd128 backward tests on WLD, hd64 backward tests on L3D; (2) fwd+bwd grids, rounds interleaved.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s20/libs2.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in D0 W WL WLD L3D; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
(cd /tmp/t_WLD && PYTHONPATH=/tmp/t_WLD timeout 80 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -k "128" -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_WLD_bwd128.txt; tail -1 $OUT/tests_WLD_bwd128.txt)
(cd /tmp/t_L3D && PYTHONPATH=/tmp/t_L3D timeout 80 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -k "64 and not 640" -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_L3D_bwd64.txt; tail -1 $OUT/tests_L3D_bwd64.txt)
echo "tests done at $((SECONDS - T0)) s"
for r in 1 2 3; do
  for v in D0 W WL WLD L3D; do
    [ $((SECONDS - T0)) -gt 540 ] && break 2
    hds=128; [ $v = D0 ] || [ $v = L3D ] && hds=128,64
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 60 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims $hds --impls portattn --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c2.tgz . && rm -rf ./* && mv /tmp/c2.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
