#!/bin/bash
# The integrated GPU run (one device call): rebuild the per-Python binding against the
# carried libportattn_cuda.so (built on the dev machine: `python3 portattn/backends/cuda/build.py`,
# Python-independent), then the stages named in the arguments. $OUT mirrors bench/results/
# (bench/results/README.md): the tables each stage answers with go to $OUT/latest/, logs, sanitizer
# output, profiles and the report to $OUT/runs/<date>-<commit>/; `cp -r $OUT/. bench/results/` files them.
#   tests     every `gpu`-marked test (forward, backward, reference on GPU) -> gpu_tests.log
#   sanitize  compute-sanitizer memcheck + racecheck + initcheck on the small forward/backward cases (adversarial
#             cu_seqlens/seqused_k included), synccheck on the Hopper ones
#   overhead  bench/bench_overhead.py (host overhead, self-check cost)
#   report    portattn-report, --selftest and the quickstart example -> report.txt
#   bench     bench/bench_attention.py $BENCH_ARGS (default --backward): portattn, the sm80+ path forced,
#             SDPA flash/cuDNN, FlexAttention, flash-attn-4 (if installed: bench/fa4_stage.sh), fwd and
#             fwd+bwd -> hopper_bench.{json,md,png}; the grid stops at --budget-s (300 s), tables still written
#   profile   bench/ncu_stage.sh: ncu on one launch each of the Hopper forward, Hopper backward (if any)
#             and sm80+ backward at hd128 s16k -> ncu_fwd.txt, ncu_bwd_hopper.txt, ncu_bwd_sm80.txt
#   determinism  bench/bench_backward.py --determinism: deterministic=True vs default, hd128 4k/8k/16k
#   train     bench/train_check.py (loss curves, portattn vs SDPA from one initialisation)
# Set PORTATTN_COMMIT to the commit under test (the device copy has no .git; it names the run folder). A PYTHONPATH
# already set (flash-attn-4's, from bench/fa4_stage.sh install) is kept. PORTATTN_PACK=1 packs everything the
# stages wrote into $OUT/results.tgz (and removes the loose files): the device tool returns a limited number of
# files per call, and two session-10 calls lost some (`tar xzf results.tgz -C bench/results/` files it).
set -o pipefail
export PYTHONPATH=$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
COMMIT=${PORTATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
LATEST=$OUT/latest                           # the current table per question
RUN=$OUT/runs/$(date -u +%Y-%m-%d)-$COMMIT   # this run's logs, sanitizer output, profiles, report
mkdir -p "$LATEST" "$RUN"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee "$RUN/report.txt"
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1 || exit 1
for stage in "$@"; do
  start=$SECONDS
  case "$stage" in
    tests)
      timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rs 2>&1 | tee "$RUN/gpu_tests.log" | tail -8 ;;
    sanitize)
      # SANITIZE_KERNELS=<substring> restricts memcheck / racecheck / initcheck to the kernels whose names contain it.
      only=${SANITIZE_KERNELS:+--kernel-name kns=$SANITIZE_KERNELS}
      # initcheck (reads of device memory nobody wrote) runs without torch's caching allocator,
      # so every workspace is a fresh cudaMalloc the tool tracks as uninitialised; with the
      # cache, recycled blocks count as written.
      for tool in memcheck racecheck initcheck; do
        echo "== $tool ${SANITIZE_KERNELS:+(kernels matching $SANITIZE_KERNELS)}" >> "$RUN/sanitize.log"
        envs="" filter=$only
        # initcheck never takes the kernel filter: a kernel it does not instrument (torch's
        # reductions, our preprocess) writes memory it never sees written, so every later read
        # of it is reported (session 7: 100 such reports with kns=hopper, 0 without).
        if [ $tool = initcheck ]; then envs="PYTORCH_NO_CUDA_MEMORY_CACHING=1" filter=""; fi
        # racecheck's whole output is kept (racecheck.log.gz): its one intermittent warning (sessions 15-17) has
        # shown up only inside this stage, and its summary line alone does not say where.
        env $envs timeout 300 compute-sanitizer --tool $tool $filter python3 tests/gpu/sanitize_cuda.py > "/tmp/sanitize_$tool.log" 2>&1
        tail -3 "/tmp/sanitize_$tool.log" | tee -a "$RUN/sanitize.log"
        if [ $tool = racecheck ]; then gzip -c "/tmp/sanitize_$tool.log" > "$RUN/racecheck.log.gz"; fi
      done
      # synccheck (barrier misuse) on the Hopper kernels: named barriers, mbarriers, setmaxnreg.
      echo "== synccheck (hopper kernels)" >> "$RUN/sanitize.log"
      timeout 200 compute-sanitizer --tool synccheck --kernel-name kns=hopper python3 tests/gpu/sanitize_cuda.py 2>&1 | tail -3 | tee -a "$RUN/sanitize.log" ;;
    overhead)
      timeout 200 python3 bench/bench_overhead.py --out "$LATEST" 2>&1 | tail -18 ;;
    report)
      { python3 -m portattn; python3 -m portattn --selftest; python3 examples/quickstart.py; } 2>&1 | tee -a "$RUN/report.txt" | tail -12 ;;
    bench)
      timeout ${BENCH_TIMEOUT:-420} python3 bench/bench_attention.py ${BENCH_ARGS:---backward} --out "$LATEST" 2>&1 | tee "$RUN/bench.log" | tail -40 ;;
    profile)
      OUT="$RUN" timeout ${PROFILE_TIMEOUT:-380} bash bench/ncu_stage.sh $PROFILE_KERNELS 2>&1 | tail -45 ;;
    determinism)
      timeout 240 python3 bench/bench_backward.py --determinism --out "$LATEST" 2>&1 | tee "$RUN/determinism.log" | tail -14 ;;
    train)
      timeout 200 python3 bench/train_check.py --out "$LATEST" 2>&1 | tee "$RUN/train_check.log" | tail -3 ;;
  esac
  echo "== stage $stage took $((SECONDS - start)) s"
done
if [ "${PORTATTN_PACK:-0}" = 1 ]; then
  tar czf /tmp/portattn_results.tgz -C "$OUT" latest runs && rm -rf "$LATEST" "$OUT/runs" &&
    mv /tmp/portattn_results.tgz "$OUT/results.tgz" && echo "== packed: $OUT/results.tgz"
fi
