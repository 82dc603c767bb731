#!/bin/bash
# Session 20 call 7: the backward's per-warp timeline (bench/bwd_timeline.py, Note [portattn hopper backward
# timeline]). T64 = HEAD's tree with the hd128 bf16 backward TU built -DPORTATTN_HOPPER_BWD_TIMELINE=1 (the default
# 64-query kernel); T80 = the same with the 80-query option. hd128 bf16, 16k tokens, seqlen 2048 and 8192 unmasked,
# 2048 causal (T64).
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s20/libs7.tar.xz -C /tmp/libs && cp /tmp/libs/T64/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in T64 T80; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/timeline
for v in T64 T80; do
  for s in 2048 8192; do
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v timeout 120 python3 bench/bwd_timeline.py --seqlen $s --out $OUT/timeline/${v}_s$s.json > $OUT/timeline/${v}_s$s.txt 2>&1; echo "$v $s rc=$? at $((SECONDS - T0)) s")
  done
done
(cd /tmp/t_T64 && PYTHONPATH=/tmp/t_T64 timeout 120 python3 bench/bwd_timeline.py --seqlen 2048 --causal --out $OUT/timeline/T64_s2048_causal.json > $OUT/timeline/T64_s2048_causal.txt 2>&1; echo "causal rc=$?")
cat $OUT/timeline/T64_s2048.txt $OUT/timeline/T80_s2048.txt | head -80
cd $OUT && tar czf /tmp/c7.tgz . && rm -rf ./* && mv /tmp/c7.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
