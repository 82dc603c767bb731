#!/bin/bash
# Session 17 call 4 (library: cda530b's, F). (1) Head dim 256 training grid (Hopper forward + sm80+ backward) next to
# SDPA flash / cuDNN: refreshes latest/cuda_fwd_bwd_hd256 (last measured before the hd256 Hopper forward existed).
# (2) racecheck, the suite's command, three runs side by side, each keeping every report (--save + a log):
# where is the intermittent warning?
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s17/libs2.tar.xz -C /tmp/libs F && cp /tmp/libs/F/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
export PYTHONPATH=$PWD:$PWD/bench
mkdir -p $OUT/latest $OUT/race
PORTATTN_COMMIT=48d7195 timeout 200 python3 bench/bench_attention.py --backward --grid-only --head-dims 256 --impls portattn,portattn_sm80,sdpa_flash,sdpa_cudnn --name cuda_fwd_bwd_hd256 --out $OUT/latest 2>&1 | tail -40
echo "hd256 grid done at $((SECONDS - T0)) s"
for i in 1 2 3; do
  (timeout 330 compute-sanitizer --tool racecheck --print-limit 10000 --save /tmp/race_$i.san python3 tests/gpu/sanitize_cuda.py > /tmp/race_$i.log 2>&1; echo "race $i rc=$? at $((SECONDS - T0)) s: $(grep 'RACECHECK SUMMARY' /tmp/race_$i.log)") &
done
wait
for i in 1 2 3; do
  grep -i "^========= .*\(warning\|error\).*:" /tmp/race_$i.log | sed 's/0x[0-9a-f]*/X/g' | sort | uniq -c > $OUT/race/kinds_$i.txt
  grep -n -i -B3 -A40 "warning" /tmp/race_$i.log | head -300 > $OUT/race/warnings_$i.txt
  gzip -c /tmp/race_$i.log > $OUT/race/race_$i.log.gz
  [ -s /tmp/race_$i.san ] && gzip -c /tmp/race_$i.san > $OUT/race/race_$i.san.gz
done
head -5 $OUT/race/kinds_*.txt; wc -l $OUT/race/warnings_*.txt
cd $OUT && tar czf /tmp/c4.tgz . && rm -rf ./* && mv /tmp/c4.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
