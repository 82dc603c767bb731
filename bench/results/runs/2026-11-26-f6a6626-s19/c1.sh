#!/bin/bash
# Session 19 call 1. O = HEAD's library; W = O with the hd128 backward TUs built with 80-query steps
# (Note [portattn hopper 80-query steps]); F2 = O with the hd128 forward TU built
# -DPORTATTN_HOPPER_FWD_WIDE_KEYS_MIN=2049 (176-key blocks from 2k keys).
# (0) smoke test of W; (1) hd128 / hd96 Hopper backward tests on W; (2) hd128 fwd+bwd grid O / W, 2 rounds;
# (3) hd128 2k / 4k forward O / F2, 3 rounds.
export PYTHONUNBUFFERED=1
T0=$SECONDS
mkdir -p /tmp/libs && tar xJf .abB/s19/libs1.tar.xz -C /tmp/libs && cp /tmp/libs/O/libportattn_cuda.so portattn/backends/cuda/
python3 portattn/backends/cuda/build.py --binding-only 2>&1 | tail -1
for v in O W F2; do rm -rf /tmp/t_$v && mkdir /tmp/t_$v && cp -r portattn bench tests /tmp/t_$v/ && cp /tmp/libs/$v/libportattn_cuda.so /tmp/t_$v/portattn/backends/cuda/; done
mkdir -p $OUT/ab
cat > /tmp/smoke.py <<'PY'
import torch, math
from portattn import flash_attn_func
from portattn.backends import reference
torch.manual_seed(0)
for (b, s, h, d) in [(2, 1000, 4, 128), (1, 333, 3, 128), (2, 2048, 16, 128), (3, 777, 8, 96)]:
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    o = flash_attn_func(q, k, v)
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    of = torch.nn.functional.scaled_dot_product_attention(qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2)).transpose(1, 2)
    rq, rk, rv = torch.autograd.grad(of, (qf, kf, vf), do.float())
    print((b, s, h, d), "dq %.2e dk %.2e dv %.2e" % tuple((x.float() - y).abs().max().item() for x, y in ((dq, rq), (dk, rk), (dv, rv))), "ref scale", rq.abs().max().item())
PY
(cd /tmp/t_W && PYTHONPATH=/tmp/t_W timeout 60 python3 /tmp/smoke.py 2>&1 | tail -6 | tee $OUT/smoke_W.txt)
(cd /tmp/t_O && PYTHONPATH=/tmp/t_O timeout 60 python3 /tmp/smoke.py 2>&1 | tail -6 | tee $OUT/smoke_O.txt)
echo "smoke done at $((SECONDS - T0)) s"
if grep -q "dq" $OUT/smoke_W.txt; then
(cd /tmp/t_W && PYTHONPATH=/tmp/t_W timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_cuda_hopper_backward.py -k "128 or 96" -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests_W.txt; tail -2 $OUT/tests_W.txt)
echo "tests done at $((SECONDS - T0)) s"
for r in 1 2; do
  for v in O W; do
    impls=portattn; [ $r = 1 ] && [ $v = O ] && impls=portattn,sdpa_cudnn
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 80 python3 bench/bench_attention.py --backward --grid-only --seqlens 512,1024,2048,4096,8192,16384 --head-dims 128 --impls $impls --out $OUT/ab/grid_${v}_r$r > $OUT/ab/grid_${v}_r$r.log 2>&1)
    echo "grid $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
fi
for r in 1 2 3; do
  for v in O F2; do
    [ $((SECONDS - T0)) -gt 540 ] && break 2
    (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench timeout 40 python3 bench/bench_attention.py --grid-only --seqlens 2048,4096 --head-dims 128 --impls portattn --out $OUT/ab/fwd_${v}_r$r > $OUT/ab/fwd_${v}_r$r.log 2>&1)
    echo "fwd $v r$r rc=$? at $((SECONDS - T0)) s"
  done
done
find $OUT/ab -name "*.png" -delete
cd $OUT && tar czf /tmp/c1.tgz . && rm -rf ./* && mv /tmp/c1.tgz $OUT/
echo "all done at $((SECONDS - T0)) s"
