#!/bin/bash
# Session 17 call 2: ncu source counters (SASS with execution counts and stall samples) of our Hopper backward main
# kernel, F = cda530b's library: hd128 2k causal and unmasked; hd64 2k unmasked on F and on C (64-bit descriptor
# adds, which lost 3-4% there in call 1); the hd64 512 causal forward on F.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s17/libs1.tar.xz -C /tmp/libs && cp /tmp/libs/F/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in F C; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
NCU=$(command -v ncu || ls -d /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
prof() {  # name lib head_dim seqlen causal mode regex
  local name=$1 v=$2 hd=$3 s=$4 c=$5 mode=$6 rx=$7
  [ $((SECONDS - T0)) -gt 500 ] && { echo "skip $name"; return; }
  (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench PORTATTN_NCU_HEAD_DIM=$hd PORTATTN_NCU_SEQLEN=$s PORTATTN_NCU_CAUSAL=$c timeout 120 $NCU --profile-from-start off -k regex:$rx --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight --metrics smsp__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum --import-source no --clock-control none --export /tmp/$name python3 bench/ncu_profile.py case $mode > /tmp/$name.log 2>&1)
  echo "$name rc=$? at $((SECONDS - T0)) s: $(tail -1 /tmp/$name.log | cut -c1-150)"
  $NCU --import /tmp/$name.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $OUT/${name}_src.csv.gz
  $NCU --import /tmp/$name.ncu-rep --page raw --csv 2>/dev/null | gzip > $OUT/${name}_raw.csv.gz
  python3 bench/ncu_sass_stalls.py <(zcat $OUT/${name}_src.csv.gz) 12 2>&1 | head -14
}
prof b128_c1_F F 128 2048 1 bwd hopper_bwd_kernel
prof b128_c0_F F 128 2048 0 bwd hopper_bwd_kernel
prof b64_c0_F F 64 2048 0 bwd hopper_bwd_kernel
prof b64_c0_C C 64 2048 0 bwd hopper_bwd_kernel
prof f64_s512_c1_F F 64 512 1 fwd hopper_fwd
cd $OUT && tar czf /tmp/c2.tgz . && rm -rf ./* && mv /tmp/c2.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
