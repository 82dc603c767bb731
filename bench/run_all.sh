#!/bin/bash
# Regenerate the tables of bench/results/latest/ at one commit, on one GPU machine.
#
#   bash bench/run_all.sh [OUT] [STAGE ...]      (no stage: every single-GPU table stage below)
#
# OUT: a folder given as the first argument (any argument with a "/" in it) or as $OUT; default
# bench/results/latest. Tables go to OUT itself, through bench/peers.write_results (device, date
# and commit in every table's first lines); each stage's log goes to OUT/logs/<stage>.log.
#
# The binding (portattn/backends/cuda/_C) is rebuilt first against a libportattn_cuda.so built
# elsewhere (`python3 portattn/backends/cuda/build.py`, Python-independent) and carried here.
#
# Stages, with the table each writes and its time bound (TIMEOUT_<STAGE>=seconds overrides a
# stage's timeout, BUDGET_<STAGE>=seconds a grid's budget: the cells after it are n/a, the table
# is still written):
#   tests        every `gpu`-marked test                                 logs/tests.log           300 s
#   sanitize     compute-sanitizer memcheck, racecheck, initcheck on tests/gpu/sanitize_cuda.py,
#                synccheck on its Hopper kernels                         logs/sanitize.log        4 x 300 s
#   report       portattn-report, --selftest, examples/quickstart.py     logs/report.log          120 s
#   bench        bench_attention.py --backward, every peer               hopper_bench             budget 240 s
#   sm80         bench_backward.py, the sm80+ path forced vs SDPA flash  cuda_fwd_bwd             budget 80 s
#   hd256        bench_attention.py --backward --head-dims 256           cuda_fwd_bwd_hd256       budget 50 s
#                (its forward table is also what hd256_forward answered: one run covers both)
#   hd192        bench_attention.py --backward --head-dims 192           cuda_fwd_bwd_hd192       budget 50 s
#   decode       bench_decode.py                                         decode_bench             150 s
#   short        bench_short.py, seqlens 50-300                          short_seq                180 s
#   varlen       bench_varlen.py                                         varlen                   budget 120 s
#   determinism  bench_backward.py --determinism                         determinism              budget 90 s
#   overhead     bench_overhead.py                                       overhead                 150 s
#   train        train_check.py                                          train_check              180 s
#   ring         tools/bench_ring_proxy.py                               ring_proxy               90 s
#   hf           bench_hf_generate.py: transformers generate(), eager and  hf_generate_eager,       budget 2 x 450 s
#                static cache + torch.compile, portattn / SDPA / eager      hf_generate_static
#   conformance  flash-attn's tests/test_flash_attn.py on portattn       flash_attn_conformance   300 s
#                (bench/conformance/run.sh; needs that file: $CONFORMANCE_SRC, default
#                .conformance/test_flash_attn.py; skipped without it; not in the default set)
#   cp           torchrun bench_context_parallel.py (2+ GPUs; not in the default set)
#                                                                        context_parallel_<N>gpu  300 s
#   profile      tools/ncu_stage.sh: ncu of the hd128 s16k kernels -> OUT/profile/ (not a table; not
#                in the default set)                                                              380 s
# The default set's tables take about 20 minutes on one H100; one device command of at most
# 10 minutes takes e.g.
#   bash bench/run_all.sh tests sanitize
#   bash bench/run_all.sh bench sm80 hd256 hd192
#   bash bench/run_all.sh decode short varlen determinism overhead train ring
#
# Environment: PORTATTN_COMMIT names the commit under test (a copied tree without .git; else git's HEAD).
# PYTHONPATH already set (flash-attn-4's, from `eval "$(bash bench/tools/fa4_stage.sh install)"`)
# is kept. PACK=1 tars OUT's tables and logs into OUT/results.tgz and removes the loose files
# (a transfer that returns a few files per command; `tar xzf results.tgz -C bench/results/latest`).
# DRY=1 checks the plumbing on a CPU: no build, the benchmarks' --dry-run (fake timings), stages
# without a dry run skipped, OUT default /tmp/portattn_run_all_dry.
set -o pipefail
if [[ "$1" == */* ]]; then OUT=$1; shift; fi
if [ "${DRY:-0}" = 1 ]; then OUT=${OUT:-/tmp/portattn_run_all_dry}; fi  # fake timings never reach latest/
OUT=${OUT:-$(dirname "$0")/results/latest}
mkdir -p "$OUT/logs" && OUT=$(cd "$OUT" && pwd) || exit 1
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DEFAULT="tests sanitize report bench sm80 hd256 hd192 decode short varlen determinism overhead train ring hf"
STAGES=${*:-$DEFAULT}
export PORTATTN_COMMIT=${PORTATTN_COMMIT:-$(python3 -c "import sys; sys.path.insert(0, 'bench'); import peers; print(peers.commit())" 2>/dev/null || echo unknown)}
LOGS=$OUT/logs
DRY=${DRY:-0}
dry=$([ "$DRY" = 1 ] && echo --dry-run)

if [ "$DRY" != 1 ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee "$LOGS/device.txt"
  python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1 || exit 1
fi
echo "commit $PORTATTN_COMMIT, stages: $STAGES" | tee -a "$LOGS/device.txt"

# limit STAGE DEFAULT_SECONDS: the stage's timeout, TIMEOUT_<STAGE> when set.
limit() { local var="TIMEOUT_${1^^}"; echo "${!var:-$2}"; }
# budget STAGE DEFAULT_SECONDS: the grid's time budget, BUDGET_<STAGE> when set.
budget() { local var="BUDGET_${1^^}"; echo "${!var:-$2}"; }
# run STAGE SECONDS COMMAND...: the command under its timeout, all output to logs/STAGE.log, the tail shown.
run() {
  local stage=$1 seconds=$2; shift 2
  echo "== $stage: $*" > "$LOGS/$stage.log"
  timeout "$(limit "$stage" "$seconds")" "$@" >> "$LOGS/$stage.log" 2>&1
  local rc=$?
  tail -${TAIL:-12} "$LOGS/$stage.log"
  [ $rc = 124 ] && echo "== $stage: stopped at its $(limit "$stage" "$seconds") s timeout"
  [ $rc = 0 ] || FAILED="$FAILED $stage"
  return $rc
}
skip() { echo "== $1: skipped ($2)" | tee "$LOGS/$1.log"; }
grid() {  # bench_attention.py's hd256 / hd192 grids: portattn, the sm80+ path, SDPA flash and cuDNN
  run "hd$1" 75 python3 bench/bench_attention.py --backward --grid-only --head-dims "$1" \
    --impls portattn,portattn_sm80,sdpa_flash,sdpa_cudnn --budget-s "$(budget "hd$1" 50)" --name "cuda_fwd_bwd_hd$1" --out "$OUT" $dry
}

for stage in $STAGES; do
  start=$SECONDS
  case "$stage" in
    tests)
      if [ "$DRY" = 1 ]; then skip tests "DRY=1"; else
        run tests 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rs; fi ;;
    sanitize)
      if [ "$DRY" = 1 ]; then skip sanitize "DRY=1"; else
        : > "$LOGS/sanitize.log"
        # SANITIZE_KERNELS=<substring> restricts memcheck and racecheck to the kernels whose names contain it.
        only=${SANITIZE_KERNELS:+--kernel-name kns=$SANITIZE_KERNELS}
        for tool in memcheck racecheck initcheck; do
          echo "== $tool ${SANITIZE_KERNELS:+(kernels matching $SANITIZE_KERNELS)}" >> "$LOGS/sanitize.log"
          envs="" filter=$only
          # initcheck (reads of device memory nobody wrote) runs without torch's caching allocator, so every
          # workspace is a fresh cudaMalloc the tool tracks as uninitialised (with the cache, recycled blocks
          # count as written); and without the kernel filter: memory written by a kernel it does not
          # instrument (torch's reductions, our preprocess) would read as never written.
          if [ $tool = initcheck ]; then envs="PYTORCH_NO_CUDA_MEMORY_CACHING=1" filter=""; fi
          env $envs timeout "$(limit sanitize 300)" compute-sanitizer --tool $tool $filter python3 tests/gpu/sanitize_cuda.py \
            > "$LOGS/sanitize_$tool.log" 2>&1
          tail -3 "$LOGS/sanitize_$tool.log" | tee -a "$LOGS/sanitize.log"
          # racecheck's whole output is kept: an intermittent warning's summary line alone does not say where.
          if [ $tool = racecheck ]; then gzip -f "$LOGS/sanitize_$tool.log"; else rm -f "$LOGS/sanitize_$tool.log"; fi
        done
        # synccheck (barrier misuse) on the Hopper kernels: named barriers, mbarriers, setmaxnreg.
        echo "== synccheck (hopper kernels)" >> "$LOGS/sanitize.log"
        timeout "$(limit sanitize 300)" compute-sanitizer --tool synccheck --kernel-name kns=hopper \
          python3 tests/gpu/sanitize_cuda.py 2>&1 | tail -3 | tee -a "$LOGS/sanitize.log"
        grep -q "ERROR SUMMARY: [1-9]" "$LOGS/sanitize.log" && FAILED="$FAILED sanitize"
      fi ;;
    report)
      if [ "$DRY" = 1 ]; then skip report "DRY=1"; else
        run report 120 bash -c "python3 -m portattn; python3 -m portattn --selftest; python3 examples/quickstart.py"; fi ;;
    bench)
      run bench 300 python3 bench/bench_attention.py --backward --budget-s "$(budget bench 240)" --out "$OUT" $dry ;;
    sm80)
      run sm80 110 python3 bench/bench_backward.py --impls portattn_sm80,sdpa_flash --no-memory \
        --budget-s "$(budget sm80 80)" --out "$OUT" $dry ;;
    hd256) grid 256 ;;
    hd192) grid 192 ;;
    decode)
      run decode 150 python3 bench/bench_decode.py --out "$OUT" $dry ;;
    short)
      run short 180 python3 bench/bench_short.py --seqlens 50,100,150,200,256,300 --out "$OUT" $dry ;;
    varlen)
      run varlen 160 python3 bench/bench_varlen.py --budget-s "$(budget varlen 120)" --out "$OUT" $dry ;;
    determinism)
      run determinism 130 python3 bench/bench_backward.py --determinism --budget-s "$(budget determinism 90)" --out "$OUT" $dry ;;
    overhead)
      if [ "$DRY" = 1 ]; then skip overhead "no dry run"; else
        run overhead 150 python3 bench/bench_overhead.py --out "$OUT"; fi ;;
    train)
      if [ "$DRY" = 1 ]; then skip train "no dry run"; else
        run train 180 python3 bench/train_check.py --out "$OUT"; fi ;;
    hf)
      # One table per cache mode: each fills most of a 10-minute device command.
      run hf 560 python3 bench/bench_hf_generate.py --modes eager_dynamic --name hf_generate_eager \
        --budget-s "$(budget hf 450)" --out "$OUT" $dry
      run hf 560 python3 bench/bench_hf_generate.py --modes static_compile --name hf_generate_static \
        --budget-s "$(budget hf 450)" --out "$OUT" $dry ;;
    ring)
      run ring 90 python3 bench/tools/bench_ring_proxy.py --out "$OUT" $dry ;;
    conformance)
      src=${CONFORMANCE_SRC:-.conformance/test_flash_attn.py}
      if [ "$DRY" = 1 ]; then skip conformance "DRY=1"
      elif [ ! -f "$src" ]; then skip conformance "no $src: flash-attn's tests/test_flash_attn.py, carried beside the checkout"
      else run conformance 320 env CONFORMANCE_TIMEOUT="$(limit conformance 300)" \
        PORTATTN_CONFORMANCE_SOURCE=tests/test_flash_attn.py bash bench/conformance/run.sh "$src" "$OUT"; fi ;;
    cp)
      gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
      if [ "$DRY" = 1 ] || [ "$gpus" -lt 2 ]; then skip cp "needs 2+ GPUs, $gpus here"; else
        run cp 300 torchrun --nproc_per_node "$gpus" bench/bench_context_parallel.py --out "$OUT"; fi ;;
    profile)
      if [ "$DRY" = 1 ]; then skip profile "DRY=1"; else
        TAIL=45 run profile 380 env OUT="$OUT/profile" bash bench/tools/ncu_stage.sh $PROFILE_KERNELS; fi ;;
    *)
      echo "== unknown stage '$stage'; stages: $DEFAULT conformance cp profile"; exit 2 ;;
  esac
  echo "== stage $stage took $((SECONDS - start)) s" | tee -a "$LOGS/stages.txt"
done

if [ "${PACK:-0}" = 1 ]; then
  # The loose files are removed after packing, except in the checkout's own bench/results/latest.
  tmp=$(mktemp -d)
  tar czf "$tmp/results.tgz" -C "$OUT" --exclude=./results.tgz . && mv "$tmp/results.tgz" "$OUT/results.tgz" &&
    echo "== packed: $OUT/results.tgz"
  rmdir "$tmp"
  if [ "$OUT" != "$PWD/bench/results/latest" ]; then
    find "$OUT" -mindepth 1 -maxdepth 1 ! -name results.tgz -exec rm -rf {} +
  fi
fi
[ -z "$FAILED" ] || { echo "== failed:$FAILED"; exit 1; }
