#!/bin/bash
# The `profile` stage of bench/run_all.sh: Nsight Compute on one launch of each kernel
# under study, at issue #6's largest point (B=1, H=16, seqlen 16k, hd 128, bf16, not causal;
# bench/tools/ncu_profile.py runs it, with only the call under study inside the profiler range):
#   fwd        the Hopper forward (regex:hopper)              -> $OUT/ncu_fwd.txt
#   bwd        the Hopper backward, if present (regex:hopper_bwd) -> $OUT/ncu_bwd_hopper.txt
#   bwd_sm80   the sm80+ backward, path forced (regex:bwd_kernel) -> $OUT/ncu_bwd_sm80.txt
#   bwd_fa4, bwd_cudnn  flash-attn-4's / SDPA cuDNN's main backward kernel (regex:BackwardSm90 / bprop)
#   fwd_cudnn  SDPA cuDNN's forward kernel (regex:fprop)
# Each: .txt (short summary, also printed), _details.txt (ncu's section text), _raw.csv,
# .ncu-rep (open in the Nsight Compute GUI) and .log. Clocks are left to the GPU
# (--clock-control none) so durations match the benchmark's conditions.
#   usage: bash bench/tools/ncu_stage.sh [fwd] [bwd] [bwd_sm80]   (default: all three)
# Env: OUT (default /tmp/out), NCU (the ncu binary), NCU_TIMEOUT (s per kernel, default 120).
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NCU=${NCU:-$(command -v ncu || ls -d /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)}
if [ -z "$NCU" ] || [ ! -x "$NCU" ]; then
  echo "profile: no ncu on this machine (set NCU=/path/to/ncu)" | tee "$OUT/ncu_fwd.txt"
  exit 0
fi
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats"
# Tensor-pipe use (wgmma and mma.sync are separate pipes on sm90) and the stall breakdown.
# ncu does not expand wildcards in --metrics, so every stall reason is named; base names
# without a suffix let ncu collect whichever roll-ups the metric has.
STALLS="barrier branch_resolving dispatch_stall drain gmma imc_miss lg_throttle long_scoreboard math_pipe_throttle membar mio_throttle misc no_instruction not_selected selected short_scoreboard sleeping tex_throttle wait"
METRICS="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,sm__inst_executed_pipe_tensor_op_hmma.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum"
# The shared-memory wavefronts by kind: op_gmma counts the tensor cores' operand reads (they are
# part of the LSU data pipe's shared-memory wavefronts, ~73% of them in the hd128 backward), op_ld / op_st the
# loads and stores.
METRICS="$METRICS,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"
for reason in $STALLS; do METRICS="$METRICS,smsp__average_warp_latency_issue_stalled_$reason"; done

profile() {  # name mode regex title
  local name=$1 mode=$2 regex=$3 title=$4 report="$OUT/ncu_$1"
  local run=("$NCU" --profile-from-start off --launch-skip 0 --launch-count 1 -k "regex:$regex"
             $SECTIONS --clock-control none --export "$report" --force-overwrite)
  echo "== profile $name: ${run[*]} --metrics <tensor pipe + stalls> python3 bench/tools/ncu_profile.py case $mode" > "$report.log"
  timeout "${NCU_TIMEOUT:-120}" "${run[@]}" --metrics "$METRICS" python3 bench/tools/ncu_profile.py case "$mode" >> "$report.log" 2>&1
  if grep -qiE "==ERROR==.*metric|failed to find metric|invalid metric" "$report.log"; then
    # A metric this ncu version does not know fails the whole run: retry with the sections only.
    echo "== retry without --metrics" >> "$report.log"
    timeout "${NCU_TIMEOUT:-120}" "${run[@]}" python3 bench/tools/ncu_profile.py case "$mode" >> "$report.log" 2>&1
  fi
  if [ -s "$report.ncu-rep" ]; then
    "$NCU" --import "$report.ncu-rep" --page raw --csv > "$report"_raw.csv 2>> "$report.log"
    "$NCU" --import "$report.ncu-rep" --page details > "$report"_details.txt 2>> "$report.log"
  fi
  {
    python3 bench/tools/ncu_profile.py summarize "$report"_raw.csv --title "$title" --mode "$mode"
    grep -m1 "ncu_profile case" "$report.log"
    grep -m2 -E "==(ERROR|WARNING)==" "$report.log"
    grep -m1 "retry without" "$report.log"
  } > "$report.txt" 2>&1
  cat "$report.txt"
}

# PORTATTN_NCU_HEAD_DIM (default 128), PORTATTN_NCU_SEQLEN (16384) and PORTATTN_NCU_CAUSAL (0) pick the
# case (bench/tools/ncu_profile.py: batch = 16384 / seqlen, hidden 2048); the titles name it.
HD=${PORTATTN_NCU_HEAD_DIM:-128}
SEQ=${PORTATTN_NCU_SEQLEN:-16384}
MASK=$([ "${PORTATTN_NCU_CAUSAL:-0}" = 1 ] && echo causal || echo full)
BATCH=$((16384 / SEQ)); [ "$BATCH" -ge 1 ] || BATCH=1
BATCH=${PORTATTN_NCU_BATCH:-$BATCH}  # (bench/tools/ncu_profile.py reads the same two overrides)
HEADS=${PORTATTN_NCU_HEADS:-$((2048 / HD))}
SHAPE="hd$HD s$SEQ B$BATCH H$HEADS $MASK"
SUFFIX=$([ "$HD" = 128 ] || echo "_hd$HD")
for what in ${@:-fwd bwd bwd_sm80}; do
  case "$what" in
    fwd) profile "fwd$SUFFIX" fwd hopper "Hopper forward, $SHAPE" ;;
    bwd)
      # Not built yet in every tree: skip the (slow) ncu launch when the library has no such kernel.
      if grep -qa hopper_bwd portattn/backends/cuda/libportattn_cuda.so 2>/dev/null; then
        profile "bwd_hopper$SUFFIX" bwd hopper_bwd "Hopper backward, $SHAPE"
      else
        echo "== Hopper backward: none in this build (no hopper_bwd symbol in libportattn_cuda.so)" | tee "$OUT/ncu_bwd_hopper.txt"
      fi ;;
    bwd_sm80) profile "bwd_sm80$SUFFIX" bwd_sm80 bwd_kernel "sm80+ backward (cuda forced), $SHAPE" ;;
    # The peers' main backward kernels on the same case (flash-attn-4: bench/tools/fa4_stage.sh installs it).
    bwd_fa4) profile "bwd_fa4$SUFFIX" bwd_fa4 BackwardSm90 "flash-attn-4 backward, $SHAPE" ;;
    bwd_cudnn) profile "bwd_cudnn$SUFFIX" bwd_cudnn bprop "SDPA cuDNN backward, $SHAPE" ;;
    # SDPA cuDNN's forward on the same case: the peer of the forward's short cells (issue #11).
    fwd_cudnn) profile "fwd_cudnn$SUFFIX" fwd_cudnn fprop "SDPA cuDNN forward, $SHAPE" ;;
    *) echo "profile: unknown kernel '$what' (fwd, bwd, bwd_sm80, bwd_fa4, bwd_cudnn, fwd_cudnn)" ;;
  esac
done
