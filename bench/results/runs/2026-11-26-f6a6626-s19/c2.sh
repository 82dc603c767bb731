#!/bin/bash
# Session 19 call 2. O = HEAD's library; N = the tree's build (80-query hd128 backward without the dV wait, the new
# dQ swizzle key); N64 = N with the hd128 backward TUs built -DPORTATTN_HOPPER_BWD_WIDE_STEPS=0 (64-query steps, new key).
# (1) every Hopper backward test on N; (2) hd128 fwd+bwd grid O / N / N64, 2 rounds; hd64 O / N one round;
# (3) ncu of the hd128 2k unmasked backward main kernel on O and N.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s19/libs2.tar.xz -C /tmp/libs && cp /tmp/libs/O/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in O N N64; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
(cd /tmp/t_N && PYTHONPATH=/tmp/t_N timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_N.txt; tail -2 $OUT/tests_N.txt)
echo "tests done at $((SECONDS - T0)) s"
for r in 1 2; do
  for v in O N N64; do
    impls=portattn; [ $r = 1 ] && [ $v = O ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 80 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
for v in O N; do
  (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 80 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 64 --impls portattn --out $OUT/ab/g64_${v}_r1 > $OUT/ab/g64_${v}_r1.log 2>&1)
  echo "g64 $v rc=$? at $((SECONDS - T0)) s"
done
NCU=$(command -v ncu || ls -d /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
prof() {  # name lib head_dim seqlen causal mode regex
  local name=$1 v=$2 hd=$3 s=$4 c=$5 mode=$6 rx=$7
  [ $((SECONDS - T0)) -gt 480 ] && { echo "skip $name"; return; }
  (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench PORTATTN_NCU_HEAD_DIM=$hd PORTATTN_NCU_SEQLEN=$s PORTATTN_NCU_CAUSAL=$c timeout 100 $NCU --profile-from-start off -k regex:$rx --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --metrics smsp__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum --import-source no --clock-control none --export /tmp/$name python3 bench/ncu_profile.py case $mode > /tmp/$name.log 2>&1)
  echo "$name rc=$? at $((SECONDS - T0)) s: $(tail -1 /tmp/$name.log | cut -c1-150)"
  $NCU --import /tmp/$name.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $OUT/${name}_src.csv.gz
  $NCU --import /tmp/$name.ncu-rep --page raw --csv 2>/dev/null | gzip > $OUT/${name}_raw.csv.gz
  python3 bench/ncu_sass_stalls.py <(zcat $OUT/${name}_src.csv.gz) 12 2>&1 | head -16
}
prof b128_c0_N N 128 2048 0 bwd hopper_bwd_kernel
prof b128_c0_O O 128 2048 0 bwd hopper_bwd_kernel
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c2.tgz . && rm -rf ./* && mv /tmp/c2.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
