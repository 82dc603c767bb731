"""A/B of the Hopper backward's two dQ paths (PORTATTN_HOPPER_BWD_DQ: atomic | bulk), one process.

Both paths are compiled into every build; `_C.hopper_bwd_dq_mode` switches between them between
calls (Note [portattn hopper bulk dQ] in csrc/hopper_bwd_kernel.cuh). Through the public API
(`portattn.flash_attn_func`, bf16, dispatch must choose cuda-sm90), on the issue's grid (16k tokens,
hidden 2048: hd 64 x 32 heads, hd 128 x 16 heads; seqlen 1k-16k, batch = 16k / seqlen; causal and
not), for each point and mode: the forward alone and forward+backward, medians of CUDA-event timings
with the modes interleaved (A B A B ...) so clock and thermal drift hit both alike. Prints a markdown
table: TFLOP/s of forward+backward and of the backward (fwd+bwd minus fwd) per mode, and bulk/atomic.
Gradients of the two modes are compared first (they differ only by fp32 summation order).

  python bench/hopper_bwd_ab.py [--seqlens 1024,2048,4096,8192,16384] [--head-dims 64,128] [--reps 30]
"""
from __future__ import annotations

import argparse
import statistics

import torch

import portattn
from portattn.backends.cuda import _C

MODES = ("atomic", "bulk")
TOKENS, HIDDEN = 16384, 2048


def _event_ms(fn):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def _point(head_dim, seqlen, causal, reps):
    heads, batch = HIDDEN // head_dim, TOKENS // seqlen
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    dout = torch.randn_like(q)
    chosen = portattn.explain(q, k, v, causal=causal).chosen
    assert chosen == "cuda-sm90", f"dispatch chose {chosen}, not the Hopper path"

    def forward():
        with torch.no_grad():
            portattn.flash_attn_func(q, k, v, causal=causal)

    def training_step():
        for x in (q, k, v):
            x.grad = None
        portattn.flash_attn_func(q, k, v, causal=causal).backward(dout)

    grads = {}
    for mode in MODES:  # correctness first: the two paths agree to fp32 summation order
        _C.hopper_bwd_dq_mode(mode)
        training_step()
        grads[mode] = [x.grad.float().clone() for x in (q, k, v)]
    for name, a, b in zip(("dq", "dk", "dv"), grads["atomic"], grads["bulk"]):
        scale = a.abs().max().item()
        err = (a - b).abs().max().item()
        assert err <= 2 * 2**-8 * scale, f"{name}: bulk differs from atomic by {err:.3g} (max {scale:.3g})"

    times = {(mode, what): [] for mode in MODES for what in ("fwd", "step")}
    for mode in MODES:  # warm-up, both modes
        _C.hopper_bwd_dq_mode(mode)
        for _ in range(3):
            training_step()
    for _ in range(reps):
        for mode in MODES:
            _C.hopper_bwd_dq_mode(mode)
            times[(mode, "fwd")].append(_event_ms(forward))
            times[(mode, "step")].append(_event_ms(training_step))
    flops_fwd = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    row = {}
    for mode in MODES:
        fwd = statistics.median(times[(mode, "fwd")])
        step = statistics.median(times[(mode, "step")])
        row[mode] = (3.5 * flops_fwd / step / 1e9, 2.5 * flops_fwd / max(step - fwd, 1e-6) / 1e9, step)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    before = _C.hopper_bwd_dq_mode()
    print(f"# {torch.cuda.get_device_name()}, bf16, {TOKENS} tokens, hidden {HIDDEN}; "
          f"PORTATTN_HOPPER_BWD_DQ at start: {before}\n")
    print("| hd | seqlen | causal | fwd+bwd atomic TFLOP/s | fwd+bwd bulk | bwd atomic | bwd bulk | "
          "step ms atomic | step ms bulk | bulk / atomic (fwd+bwd speed) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    try:
        for head_dim in (int(x) for x in args.head_dims.split(",")):
            for seqlen in (int(x) for x in args.seqlens.split(",")):
                for causal in (False, True):
                    r = _point(head_dim, seqlen, causal, args.reps)
                    a, b = r["atomic"], r["bulk"]
                    print(f"| {head_dim} | {seqlen} | {causal} | {a[0]:.0f} | {b[0]:.0f} | {a[1]:.0f} | "
                          f"{b[1]:.0f} | {a[2]:.3f} | {b[2]:.3f} | {a[2] / b[2]:.3f} |", flush=True)
    finally:
        _C.hopper_bwd_dq_mode(before if before != "invalid" else "atomic")


if __name__ == "__main__":
    main()
