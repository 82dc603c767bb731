#!/bin/bash
# Session 17 call 1. F = cda530b's library; C = F's source + 64-bit descriptor adds and pinned product descriptors
# (PORTATTN_DESC_ADD64 / PORTATTN_DESC_PIN). (1) Hopper forward and backward tests on C; (2) grid 512-16k hd128/hd64,
# forward and forward+backward, F / C interleaved, 3 rounds.
export PYTHONUNBUFFERED=1
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p /tmp/libs && tar xJf .abB/s17/libs1.tar.xz -C /tmp/libs && cp /tmp/libs/C/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in F C; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
(cd /tmp/t_C && PYTHONPATH=/tmp/t_C timeout 240 python3 -m pytest -q -x tests/gpu/test_cuda_hopper_backward.py tests/gpu/test_cuda_hopper_forward.py -p no:cacheprovider 2>&1 | tail -2 | sed "s/^/C: /" | tee $OUT/tests_C.txt)
echo "tests done at $((SECONDS - T0)) s"
for r in 1 2 3; do
  for v in F C; do
    [ $((SECONDS - T0)) -gt 520 ] && break 2
    impls=portattn; [ $r = 1 ] && [ $v = C ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 90 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128,64 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
R=$(ls -d $OUT/ab/grid_C_r* | wc -l)
python3 bench/ab_table.py $OUT/ab grid F C $R > $OUT/ab_F_C.txt 2>&1; cat $OUT/ab_F_C.txt | head -120
cd $OUT && tar czf /tmp/c1.tgz . && rm -rf ./* && mv /tmp/c1.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
