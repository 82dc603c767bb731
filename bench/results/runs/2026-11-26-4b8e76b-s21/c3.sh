#!/bin/bash
# Session 21 call 3 (carry .whl/b, libD0, this): stash flash-attn-4's second third; ncu shared-memory
# wavefronts by kind (op_gmma = the tensor cores' operand reads) on the hd128 backward's main kernel, 2k unmasked.
export PYTHONUNBUFFERED=1
T0=$SECONDS
bash bench/fa4_stage.sh stash .whl/b
mkdir -p /tmp/libs && tar xJf .abB/s21/libD0.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
mkdir -p $OUT/c3
NCU=$(command -v ncu || ls -d /usr/local/cuda/bin/ncu | tail -1)
M=""
for b in l1tex__data_pipe_lsu_wavefronts l1tex__data_pipe_lsu_wavefronts_mem_shared l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma \
  l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st l1tex__data_pipe_lsu_wavefronts_mem_shared_op_misc \
  l1tex__data_pipe_lsu_wavefronts_mem_shared_op_atom l1tex__data_pipe_lsu_wavefronts_mem_shared_cmd_read l1tex__data_pipe_lsu_wavefronts_mem_shared_cmd_write \
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_gmma l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld \
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st l1tex__lsu_writeback_active_mem_shared l1tex__lsu_writeback_active_mem_shared_op_gmma \
  l1tex__lsuin_requests_op_gmma l1tex__data_bank_reads l1tex__data_bank_writes; do
  M="$M,$b.sum,$b.avg.pct_of_peak_sustained_elapsed"
done
M="${M#,},gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
export PYTHONPATH=$PWD
for who in bwd:hopper_bwd bwd_cudnn:bprop; do
  mode=${who%%:*}; regex=${who#*:}
  PORTATTN_NCU_SEQLEN=2048 timeout 120 $NCU --profile-from-start off --launch-count 1 -k "regex:$regex" --clock-control none \
    --metrics "$M" --csv --page raw python3 bench/ncu_profile.py case $mode > $OUT/c3/smem_$mode.csv 2> $OUT/c3/smem_$mode.log
  echo "ncu $mode rc=$? at $((SECONDS - T0)) s"; grep ERROR $OUT/c3/smem_$mode.log | head -3
done
cd $OUT && tar czf /tmp/c3.tgz c3 && rm -rf ./c3 && mv /tmp/c3.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
