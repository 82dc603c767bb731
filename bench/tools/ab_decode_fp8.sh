#!/bin/bash
# The FP8 decode's paths on one GPU (PORTATTN_DECODE_FP8_PATH=regs|regs_deep|smem, Notes [portattn fp8
# register fragments] and [portattn fp8 deep pipeline] in docs/decode.md): build this tree, run the FP8
# decode GPU tests (every kernel case on the three paths, the layout grid reduced on smem), then time the
# paths against each other (bench/tools/ab_decode_fp8.py).
#   usage: bash bench/tools/ab_decode_fp8.sh [build] [test] [ab]   (default: all three, in order)
# Each stage fits one 10-minute device call on a 16-core machine; run them as separate calls there.
# Env: OUT (default /tmp/out), MAX_JOBS (default 16). The A/B's tables: $OUT/ab_decode_fp8.{json,md};
# the test log: $OUT/test_cuda_decode_fp8.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build test ab)
for stage in "${stages[@]}"; do
  case $stage in
    build) MAX_JOBS=${MAX_JOBS:-16} python3 portattn/backends/cuda/build.py ;;
    test) python3 -m pytest -q -rs -x tests/gpu/test_cuda_decode_fp8.py 2>&1 | tee "$OUT/test_cuda_decode_fp8.log" ;;
    ab) python3 bench/tools/ab_decode_fp8.py --out "$OUT" ;;
    *) echo "unknown stage '$stage' (build, test, ab)" >&2; exit 2 ;;
  esac
done
