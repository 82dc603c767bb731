#!/bin/bash
# Session 21 call 7 (carry libD0, this): where the hd64 short forward's warps wait, per SASS instruction (ncu source
# page, bench/ncu_sass_stalls.py), ours and cuDNN's kernel, at hd64 512 causal and 1k unmasked.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s21/libD0.tar.xz -C /tmp/libs && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
export PYTHONPATH=$PWD
NCU=$(command -v ncu || ls -d /usr/local/cuda/bin/ncu | tail -1)
mkdir -p $OUT/sass
for cell in 512:1 1024:0; do
  IFS=: read seq causal <<< "$cell"
  for who in fwd:hopper_fwd fwd_cudnn:fprop; do
    mode=${who%%:*}; regex=${who#*:}
    name=hd64_s${seq}_c${causal}_$mode
    PORTATTN_NCU_HEAD_DIM=64 PORTATTN_NCU_SEQLEN=$seq PORTATTN_NCU_CAUSAL=$causal timeout 120 $NCU --profile-from-start off --launch-count 1 \
      -k "regex:$regex" --clock-control none --section SourceCounters --section WarpStateStats --import-source no \
      --export /tmp/$name --force-overwrite python3 bench/ncu_profile.py case $mode > $OUT/sass/$name.log 2>&1
    $NCU --import /tmp/$name.ncu-rep --page source --csv --print-source sass > /tmp/$name.csv 2>> $OUT/sass/$name.log
    python3 bench/ncu_sass_stalls.py /tmp/$name.csv 60 > $OUT/sass/$name.txt 2>&1
    gzip -c /tmp/$name.csv > $OUT/sass/$name.csv.gz
    echo "$name at $((SECONDS - T0)) s"; head -5 $OUT/sass/$name.txt
  done
done
echo "all done at $((SECONDS - T0)) s"
