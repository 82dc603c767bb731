#!/bin/bash
# Session 21 call 2 (carry .whl/a, libD0, this). HEAD's library (D0: SASS-identical to e64ef0a).
# (1) stash flash-attn-4's first third; (2) every gpu test at HEAD; (3) ncu's shared-memory metrics on the
# hd128 backward's main kernel (ours, cuDNN) at 2k unmasked: which counters see the wgmma operand reads.
export PYTHONUNBUFFERED=1
T0=$SECONDS
bash bench/fa4_stage.sh stash .whl/a
mkdir -p /tmp/libs && tar xJf .abB/s21/libD0.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
mkdir -p $OUT/c2
NCU=$(command -v ncu || ls -d /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
echo "ncu: $NCU"
$NCU --version | tail -1 > $OUT/c2/ncu_version.txt
$NCU --query-metrics > $OUT/c2/metrics_all.txt 2>&1
grep -iE "^(l1tex__data|l1tex__m_|smsp__.*shared|sm__.*shared|sm__.*gmma|smsp__.*gmma|l1tex__.*shared|sm__pipe|smsp__sass_inst_executed_op_shared|sm__sass_.*shared|smsp__inst_executed_op_.*shared|l1tex__.*gmma|sm__.*tma|l1tex__.*tma)" $OUT/c2/metrics_all.txt | awk '{print $1}' | sort -u > $OUT/c2/metrics_smem.txt
wc -l $OUT/c2/metrics_smem.txt
EXTRA=$(paste -sd, $OUT/c2/metrics_smem.txt)
export PYTHONPATH=$PWD
for who in bwd:hopper_bwd bwd_cudnn:bprop; do
  mode=${who%%:*}; regex=${who#*:}
  PORTATTN_NCU_SEQLEN=2048 timeout 150 $NCU --profile-from-start off --launch-count 1 -k "regex:$regex" --clock-control none \
    --metrics "$EXTRA" --csv --page raw python3 bench/ncu_profile.py case $mode > $OUT/c2/smem_$mode.csv 2> $OUT/c2/smem_$mode.log
  echo "ncu $mode rc=$? at $((SECONDS - T0)) s"; tail -2 $OUT/c2/smem_$mode.log
done
PORTATTN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo head) timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rs > $OUT/c2/gpu_tests.log 2>&1
tail -1 $OUT/c2/gpu_tests.log
echo "tests done at $((SECONDS - T0)) s"
cd $OUT && tar czf /tmp/c2.tgz c2 && rm -rf ./c2 && mv /tmp/c2.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
