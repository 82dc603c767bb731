#!/bin/bash
# Session 20 call 5: the tables older than the kernels, on HEAD's library (D0 = bcbc061's tree, kernels as e64ef0a).
# Many short sequences (bench_short.py), the deterministic backward's cost (bench_backward.py --determinism), and the
# peak memory of forward+backward at 32k tokens (bench_backward.py --memory-only, into its own folder).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/bench
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s20/libs4.tar.xz -C /tmp/libs D0 && cp /tmp/libs/D0/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
mkdir -p $OUT/latest $OUT/mem
timeout 200 python3 bench/bench_short.py --out $OUT/latest > $OUT/short.log 2>&1; echo "short rc=$? at $((SECONDS - T0)) s"; tail -3 $OUT/short.log
timeout 240 python3 bench/bench_backward.py --determinism --out $OUT/latest > $OUT/determinism.log 2>&1; echo "determinism rc=$? at $((SECONDS - T0)) s"; tail -3 $OUT/determinism.log
timeout 90 python3 bench/bench_backward.py --memory-only --out $OUT/mem > $OUT/mem.log 2>&1; echo "memory rc=$? at $((SECONDS - T0)) s"; tail -8 $OUT/mem/cuda_fwd_bwd.md
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/device.txt
cd $OUT && tar czf /tmp/c5.tgz . && rm -rf ./* && mv /tmp/c5.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
