#!/bin/bash
# Session 19 call 10. G / C2 as in call 9. (1) every Hopper forward test on C2; (2) hd64 forward 2k / 4k / 8k, G / C2,
# 3 rounds; (3) the sanitizers on C2 (bench/gpu_suite.sh sanitize).
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s19/libs9.tar.xz -C /tmp/libs && cp /tmp/libs/C2/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in G C2; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
(cd /tmp/t_C2 && PYTHONPATH=/tmp/t_C2 timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_forward.py -p no:cacheprovider 2>&1 | tail -3 > $OUT/tests_C2_fwd.txt; echo "C2: $(tail -1 $OUT/tests_C2_fwd.txt)")
for r in 1 2 3; do
  for v in G C2; do
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 40 python3 bench/bench_attention.py --grid-only --seqlens 2048,4096,8192 --head-dims 64 --impls portattn --out $OUT/ab/fwd_${v}_r$r > $OUT/ab/fwd_${v}_r$r.log 2>&1)
    echo "fwd $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
OUT=$OUT/suite PORTATTN_COMMIT=c295147-C2 bash bench/gpu_suite.sh sanitize 2>&1 | tail -14
cd $OUT && tar czf /tmp/c10.tgz . && rm -rf ./* && mv /tmp/c10.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
