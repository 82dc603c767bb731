#!/bin/bash
# Session 21 call 6 (carry libD0, this): ncu (sections, stalls, shared-memory wavefronts by kind) on every grid cell where
# the medians put portattn below SDPA cuDNN (runs/2026-11-26-4b8e76b-s21/grid3), ours next to cuDNN's kernel:
# forward hd64 512 / 1k both masks, 2k causal, hd128 512 both masks; forward+backward hd128 1k causal (the backward).
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s21/libD0.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
ROOT=$OUT
for cell in 64:512:1:fwd 64:512:0:fwd 64:1024:1:fwd 64:1024:0:fwd 64:2048:1:fwd 128:512:1:fwd 128:512:0:fwd 128:1024:1:bwd; do
  IFS=: read hd seq causal what <<< "$cell"
  dir=$ROOT/ncu/hd${hd}_s${seq}_$([ $causal = 1 ] && echo causal || echo full)
  mkdir -p $dir
  OUT=$dir PORTATTN_NCU_HEAD_DIM=$hd PORTATTN_NCU_SEQLEN=$seq PORTATTN_NCU_CAUSAL=$causal NCU_TIMEOUT=90 \
    bash bench/ncu_stage.sh $what ${what}_cudnn > $dir/stage.log 2>&1
  echo "$cell done at $((SECONDS - T0)) s"
  [ $((SECONDS - T0)) -gt 520 ] && break
done
find $ROOT/ncu -name "*.ncu-rep" -delete
cd $ROOT && tar czf /tmp/c6.tgz ncu && rm -rf ncu && mv /tmp/c6.tgz $ROOT/
echo "all done at $((SECONDS - T0)) s"
