"""The `profile` stage's two halves (driven by bench/tools/ncu_stage.sh):

  python bench/tools/ncu_profile.py case {fwd,fwd_cudnn,bwd,bwd_sm80,bwd_fa4,bwd_cudnn}   the program ncu runs
  python bench/tools/ncu_profile.py summarize RAW.csv --title T --flops F   ncu's raw page -> a short text

The case is B=1, H=16, seqlen 16k, hd 128, bf16, not causal (issue #6's largest point).
Everything before the one profiled call (imports, dispatch, self-check, a full warm-up
step, and for the backward cases the forward) runs outside cudaProfilerStart/Stop, so
`ncu --profile-from-start off` sees only the call under study; bwd_sm80 forces the sm80+
path (`cuda`) so its backward kernel can be compared with the Hopper one; bwd_fa4 and bwd_cudnn profile
flash-attn-4's and SDPA cuDNN's backward on the same case.
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import sys

# PORTATTN_NCU_HEAD_DIM=64 profiles the hd64 shape of the same grid (hidden 2048: 32 heads).
# PORTATTN_NCU_SEQLEN=512 (and PORTATTN_NCU_CAUSAL=1) profiles a shorter point of the grid: the batch
# keeps the 16k tokens (batch = 16384 / seqlen), as bench_attention.py's grid does.
# PORTATTN_NCU_BATCH / PORTATTN_NCU_HEADS override those two, for shapes off the grid (bench_short.py's many short
# sequences: batch 512, 16 heads).
_HEAD_DIM = int(os.environ.get("PORTATTN_NCU_HEAD_DIM", "128"))
_SEQLEN = int(os.environ.get("PORTATTN_NCU_SEQLEN", "16384"))
CASE = dict(batch=int(os.environ.get("PORTATTN_NCU_BATCH", max(1, 16384 // _SEQLEN))),
            heads=int(os.environ.get("PORTATTN_NCU_HEADS", 2048 // _HEAD_DIM)), seqlen=_SEQLEN, head_dim=_HEAD_DIM,
            causal=os.environ.get("PORTATTN_NCU_CAUSAL", "0") == "1")


def case_flops(mode: str) -> float:
    forward = 4 * CASE["batch"] * CASE["heads"] * CASE["seqlen"] ** 2 * CASE["head_dim"] / (2 if CASE["causal"] else 1)
    return forward if mode.startswith("fwd") else 2.5 * forward


def run_case(mode: str) -> None:
    import torch

    import portattn

    if mode == "bwd_sm80":
        portattn.force_backend("cuda")
    shape = (CASE["batch"], CASE["seqlen"], CASE["heads"], CASE["head_dim"])
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=mode != "fwd") for _ in range(3))
    dout = torch.randn_like(q)

    def forward():
        return portattn.flash_attn_func(q, k, v, causal=CASE["causal"])

    if mode == "fwd_cudnn":
        # The peer a user compares with on an H100: SDPA's cuDNN kernel on the same case, in SDPA's
        # (batch, heads, seqlen, head_dim) layout, so the profiled range holds that one kernel.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=CASE["causal"])
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=CASE["causal"])
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        print(f"ncu_profile case {mode}: {CASE}, SDPA cuDNN", flush=True)
        return
    if mode in ("bwd_fa4", "bwd_cudnn"):
        # The backward peers on the same case: flash-attn-4's (bench/tools/fa4_stage.sh installs it on the
        # device) and SDPA's cuDNN, each profiled over its own backward only, as ours is.
        if mode == "bwd_fa4":
            from flash_attn.cute import flash_attn_func as fa4_func

            def peer():
                out = fa4_func(q, k, v, causal=CASE["causal"])
                return out[0] if isinstance(out, tuple) else out
            grads = (q, k, v)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
            dout = dout.transpose(1, 2).contiguous()

            def peer():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=CASE["causal"])
            grads = (qt, kt, vt)
        torch.autograd.grad(peer(), grads, dout)
        out = peer()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        torch.autograd.grad(out, grads, dout)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"ncu_profile case {mode}: {CASE}", flush=True)
        return
    if mode == "fwd":
        with torch.no_grad():
            forward()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            forward()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
    else:
        torch.autograd.grad(forward(), (q, k, v), dout)
        out = forward()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    from portattn import dispatch

    bits = dispatch.feature_bits(-1, -1, 0.0, False, 0.0, False, False, backward=mode != "fwd")
    chosen = dispatch.DISPATCHER.backend_for(q.device, q.dtype, CASE["head_dim"], bits).name
    print(f"ncu_profile case {mode}: {CASE}, portattn backend {chosen}", flush=True)


# ---- summary of ncu's raw page ------------------------------------------------------------
HEADLINE = (  # (label, metric) in the order printed; absent ones are skipped
    ("duration", "gpu__time_duration.sum"),
    ("SM clock", "smsp__cycles_elapsed.avg.per_second"),
    ("compute throughput (% peak)", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("memory throughput (% peak)", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM throughput (% peak)", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("issue slots busy (%)", "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    ("tensor pipe, wgmma cycles (% active)", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    # (ncu 2025.3 reports no ..._gmma_cycles_active on sm90; its hmma counters count the wgmma too: the hmma
    # instruction count equals the wgmma count in every Hopper kernel profiled.)
    ("tensor pipe cycles, hmma counter (% active)", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("wgmma instructions", "sm__inst_executed_pipe_tensor_op_gmma.sum"),
    # The sm80+ backward's suspected limits: shared-memory wavefronts (ldmatrix / st.shared)
    # against the LSU pipe's peak, and issued instructions in total.
    ("shared-memory wavefronts (% peak)", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed"),
    ("shared-memory bank conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"),
    ("shared-memory wavefronts", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"),
    ("  of which wgmma operand reads", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum"),
    ("  of which loads", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"),
    ("  of which stores", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"),
    ("instructions executed", "smsp__inst_executed.sum"),
    ("tensor-pipe instructions, hmma counter", "sm__inst_executed_pipe_tensor_op_hmma.sum"),
    ("grid", "launch__grid_size"),
    ("block", "launch__block_size"),
    ("registers / thread", "launch__registers_per_thread"),
    ("dynamic shared / block", "launch__shared_mem_per_block_dynamic"),
    ("theoretical occupancy (%)", "sm__maximum_warps_per_active_cycle_pct"),
    ("achieved occupancy (%)", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("waves / SM", "launch__waves_per_multiprocessor"),
)
# Stall breakdowns: per-reason cycles between a warp's issues, two normalisations.
STALL_PATTERNS = (
    ("warp latency per issue (cycles)", re.compile(r"^smsp__average_warp_latency_issue_stalled_(\w+?)(\.ratio)?$")),
    ("warps stalled per issue", re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")),
)


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def read_raw(path: str):
    """ncu --page raw --csv: a header row, a units row, then one row per profiled kernel."""
    with open(path, newline="") as handle:
        rows = [row for row in csv.reader(handle) if row]
    start = next((i for i, row in enumerate(rows) if "Kernel Name" in row or "ID" in row[:2]), None)
    if start is None or len(rows) < start + 3:
        return None, None, []
    names, units = rows[start], rows[start + 1]
    return names, units, [dict(zip(names, row)) for row in rows[start + 2:]]


def summarize(path: str, title: str, work: float) -> str:
    try:
        names, units, kernels = read_raw(path)
    except OSError as error:
        return f"== {title}: no ncu data ({error})"
    if not kernels:
        return f"== {title}: ncu profiled no kernel (the regex matched none, or ncu failed: see the .log)"
    unit_of = dict(zip(names, units))
    lines = []
    for kernel in kernels:
        name = kernel.get("Kernel Name", "?")
        lines.append(f"== {title}: {name[:140]}")
        for label, metric in HEADLINE:
            if kernel.get(metric, "") != "":
                lines.append(f"   {label:42s} {kernel[metric]} {unit_of.get(metric, '')}".rstrip())
        duration, unit = _number(kernel.get("gpu__time_duration.sum")), unit_of.get("gpu__time_duration.sum", "")
        scale = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0}.get(unit)
        if duration and scale and work:
            lines.append(f"   {'TFLOP/s at this duration':42s} {work / (duration * scale) / 1e12:.0f}")
        for label, pattern in STALL_PATTERNS:
            stalls = []
            for metric, value in kernel.items():
                match = pattern.match(metric)
                number = _number(value)
                if match and number:
                    stalls.append((number, match.group(1)))
            if stalls:
                top = sorted(stalls, reverse=True)[:8]
                lines.append(f"   stalls, {label}: " + ", ".join(f"{reason} {value:.2f}" for value, reason in top))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    case = sub.add_parser("case", help="run the profiled program")
    case.add_argument("mode", choices=("fwd", "fwd_cudnn", "bwd", "bwd_sm80", "bwd_fa4", "bwd_cudnn"))
    summary = sub.add_parser("summarize", help="print a short summary of ncu's raw csv page")
    summary.add_argument("raw_csv")
    summary.add_argument("--title", default="kernel")
    summary.add_argument("--mode", choices=("fwd", "fwd_cudnn", "bwd", "bwd_sm80", "bwd_fa4", "bwd_cudnn"), default="fwd",
                         help="which case's FLOPs turn the duration into TFLOP/s")
    args = parser.parse_args()
    if args.command == "case":
        run_case(args.mode)
    else:
        print(summarize(args.raw_csv, args.title, case_flops(args.mode)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
