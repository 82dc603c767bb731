#!/bin/bash
# Session 21 call 4 (carry .whl/c, libD0, this, commit): flash-attn-4 installed; ncu shared-memory wavefronts of its
# hd128 backward at 2k unmasked (as call 3 for ours and cuDNN); the grid with SDPA flash, cuDNN and flash-attn-4 in one
# process (gpu_suite.sh bench): bench/results/latest/hopper_bench.md at HEAD (kernels SASS-identical to e64ef0a).
export PYTHONUNBUFFERED=1
T0=$SECONDS
C=$(cat .abB/s21/commit)
mkdir -p /tmp/libs && tar xJf .abB/s21/libD0.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
bash bench/fa4_stage.sh stash .whl/c && eval "$(bash bench/fa4_stage.sh install)"
echo "PYTHONPATH=$PYTHONPATH"
mkdir -p /tmp/c4
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
PYTHONPATH=$PWD:$PYTHONPATH PORTATTN_NCU_SEQLEN=2048 timeout 150 $NCU --profile-from-start off --launch-count 1 -k "regex:BackwardSm90" --clock-control none \
    --metrics "$M" --csv --page raw python3 bench/ncu_profile.py case bwd_fa4 > /tmp/c4/smem_bwd_fa4.csv 2> /tmp/c4/smem_bwd_fa4.log
echo "ncu fa4 rc=$? at $((SECONDS - T0)) s"; grep ERROR /tmp/c4/smem_bwd_fa4.log | head -3
PORTATTN_COMMIT=$C PORTATTN_PACK=1 BENCH_ARGS="--backward --grid-only --impls portattn,sdpa_flash,sdpa_cudnn,fa4" bash bench/gpu_suite.sh bench 2>&1 | tail -70
mv /tmp/c4 $OUT/ && cd $OUT && tar czf /tmp/c4.tgz c4 && rm -rf c4 && mv /tmp/c4.tgz $OUT/
ls $OUT
echo "all done at $((SECONDS - T0)) s"
