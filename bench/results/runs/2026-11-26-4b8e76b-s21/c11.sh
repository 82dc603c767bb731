#!/bin/bash
# Session 21 call 11 (carry libZ2, this, commit): (1) many short sequences refreshed (bench_short.py, every column) at
# HEAD; (2) ncu of the two many-short forward cells below cuDNN (hd64 100 / 300 rows unmasked, batch 512 x 16 heads),
# ours next to cuDNN's kernel.
export PYTHONUNBUFFERED=1
T0=$SECONDS
C=$(cat .abB/s21/commit)
mkdir -p /tmp/libs && tar xJf .abB/s21/libZ2.tar.xz -C /tmp/libs && cp /tmp/libs/Z2/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
export PYTHONPATH=$PWD:$PWD/bench PORTATTN_COMMIT=$C
mkdir -p $OUT/latest $OUT/c11
timeout 240 python3 bench/bench_short.py --out $OUT/latest > $OUT/c11/short.log 2>&1; echo "short rc=$? at $((SECONDS - T0)) s"; tail -3 $OUT/c11/short.log
for seq in 100 300; do
  dir=$OUT/c11/ncu_short_hd64_s${seq}_full; mkdir -p $dir
  OUT=$dir PORTATTN_NCU_HEAD_DIM=64 PORTATTN_NCU_SEQLEN=$seq PORTATTN_NCU_BATCH=512 PORTATTN_NCU_HEADS=16 PORTATTN_NCU_CAUSAL=0 NCU_TIMEOUT=90 \
    bash bench/ncu_stage.sh fwd fwd_cudnn > $dir/stage.log 2>&1
  echo "ncu $seq at $((SECONDS - T0)) s"
done
find $OUT -name "*.ncu-rep" -delete
cd $OUT && tar czf /tmp/c11.tgz latest c11 && rm -rf latest c11 && mv /tmp/c11.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
