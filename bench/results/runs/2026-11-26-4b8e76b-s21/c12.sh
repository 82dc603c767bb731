#!/bin/bash
# Session 21 call 12 (carry libD0, libZ2, this): many short sequences at hd16 (bench_short.py), D0 and Z2 in turns,
# three fresh processes each: is call 11's hd16 50-row causal forward+backward (0.93 ms against 0.28 in session 20)
# the zeroing change or the process?
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && for v in D0 Z2; do tar xJf .abB/s21/lib$v.tar.xz -C /tmp/libs; done
cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in D0 Z2; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/c12
for r in 1 2 3; do
  for v in D0 Z2; do
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 40 python3 bench/bench_short.py --head-dims 16 --impls portattn,portattn_sm80,sdpa_cudnn --out $OUT/c12/short_${v}_r$r > $OUT/c12/short_${v}_r$r.log 2>&1)
    echo "$v r$r rc=$? at $((SECONDS - T0)) s: $(grep -m2 '50 causal\|50 full' $OUT/c12/short_${v}_r$r.log | tr '\n' ' ')"
  done
done
find $OUT -name "*.png" -delete
cd $OUT && tar czf /tmp/c12.tgz c12 && rm -rf c12 && mv /tmp/c12.tgz $OUT/
