"""Context-parallel throughput: zigzag ring attention (ring-flash-attn on portattn) over N GPUs.

    torchrun --nproc_per_node N bench/bench_context_parallel.py [--tokens 131072,262144,524288]
        [--reps 3] [--variants ring,portattn,portattn+hp,portattn+margin8]
        [--torch-cp cudnn/allgather,cudnn/alltoall] [--profile [--profile-all-ranks]] [--out DIR]

Each rank holds a zigzag shard of one causal sequence (bf16, 16 heads x 128); ring-flash-attn
passes K/V around the ring over NCCL and portattn runs every step's attention. Times the
forward and forward+backward with CUDA events (median of --reps after warm-up, a barrier
before each), once per --variants entry (_variant): "ring" is ring-flash-attn as published
(its own merge of the steps' partial outputs, its fp32 ring of dK/dV accumulators),
"portattn" what portattn.compat.import_ring_flash_attn installs by default (the fused merge,
Note [ring merge]; the zigzag backward of Note [zigzag backward partials]); "+hp" puts the
ring's NCCL communicator on a high-priority stream, "+margin<N>" passes sm_margin=N. On the
same ranks, one GPU's whole call at the per-rank token count (weak-scaling baseline) and at
the total when it fits (strong-scaling baseline). --torch-cp times PyTorch's own context
parallelism (context_parallel with SDPA, a head-tail sharded sequence) beside. Rank 0 prints
and writes <out>/context_parallel_<N>gpu.{json,md} through peers.write_results:

    weak efficiency   = time of one GPU on tokens/N / time of N GPUs on tokens (causal work
                        per GPU is the same when the whole causal call's work is split N ways:
                        a causal call on tokens/N does 1/N^2 of the work, so it is scaled by N)
    strong efficiency = time of one GPU on tokens / (N x time of N GPUs on tokens)

--profile: one more forward+backward step per variant at --profile-tokens (default the first
of --tokens), every rank running it and rank 0 recording it with torch.profiler (CPU and
CUDA activities). Its kernels are put in categories (profile_summary below): attention
kernels, their per-call passes, the merge, other elementwise work of the forward and of the
backward (the backward's fp32 gradient accumulation and casts), and the compute stream's
idle time, split into waiting while an NCCL kernel runs and host gaps (no NCCL kernel
running); and how much of the NCCL kernels' time an attention kernel ran beside. The table
goes into the .md and .json; --trace-dir also keeps the Chrome traces.

--profile-all-ranks: every rank records that step (the profiler started ahead of the barrier,
so the step starts from the barrier on every rank alike) and gathers to rank 0 its
profile_summary and timeline (rank_timeline: the host's start of cp::forward, the first and
last kernel of the compute stream and of NCCL, on the host clock, so comparable between the
ranks of one machine) with the step's CUDA-event time on that rank: "rank_profiles" in the
.json, a per-rank table per variant in the .md. Tells a late host launch, a slow rank, and
NCCL kernels waiting on a late peer apart.

--dry-run: the same plumbing on the CPU over gloo with tiny shapes (timings meaningless).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile

import torch
import torch.distributed as dist

import peers
import portattn  # noqa: F401
from portattn.compat import import_ring_flash_attn

HEADS, HEAD_DIM = 16, 128


def _time_ms(fn, reps, cuda):
    return peers.median_ms(fn, reps, cuda, warmup=2, before=dist.barrier)


def _step(attention, q, k, v, dout, backward):
    def run():
        with torch.profiler.record_function("cp::forward"):
            out = attention(q, k, v, causal=True)
        if backward:
            with torch.profiler.record_function("cp::backward"):
                torch.autograd.grad(out, (q, k, v), dout)
    return run


def _inputs(tokens, device, heads, head_dim, grad=True):
    shape = (1, tokens, heads, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    return q, k, v, torch.randn(shape, device=device, dtype=torch.bfloat16)


# ---- profile ---------------------------------------------------------------------------------

_MERGE_RANGE = "cp::merge"
_PHASES = ("cp::forward", "cp::backward")
# portattn's attention kernels (backends/cuda/csrc), and the per-call passes of its backward.
_ATTENTION = ("fwd_kernel", "bwd_kernel")
_ATTENTION_PASSES = ("bwd_preprocess", "bwd_convert_dq", "bwd_convert_dkv")
CATEGORIES = ("attention kernels", "attention per-call passes", "merge", "other elementwise (fwd)",
              "other elementwise (bwd)", "idle: NCCL kernel running", "idle: host gap")


@contextlib.contextmanager
def _merge_annotated():
    """ring-flash-attn's attention modules' update_out_and_lse inside a "cp::merge" range."""
    import importlib

    from portattn.compat import _RING_MODULES

    saved = {}
    for name in _RING_MODULES:
        module = importlib.import_module(f"ring_flash_attn.{name}")
        if hasattr(module, "update_out_and_lse"):
            inner = saved[module] = module.update_out_and_lse

            def annotated(*args, _inner=inner, **kwargs):
                with torch.profiler.record_function(_MERGE_RANGE):
                    return _inner(*args, **kwargs)
            module.update_out_and_lse = annotated
    try:
        yield
    finally:
        for module, inner in saved.items():
            module.update_out_and_lse = inner


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _overlap(start, end, union):
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in union)


def _events(trace):
    return trace.get("traceEvents", trace) if isinstance(trace, dict) else trace


def _compute_and_nccl(kernels):
    """The compute stream's kernels (the stream with the most attention-kernel time, else the
    first kernel's) in time order, and the NCCL kernels of any stream."""
    nccl = [k for k in kernels if "nccl" in k["name"].lower()]
    compute = [k for k in kernels if "nccl" not in k["name"].lower()]
    if not compute:
        return [], nccl
    busy = {}
    for k in compute:
        if any(a in k["name"] for a in _ATTENTION):
            busy[k["args"].get("stream")] = busy.get(k["args"].get("stream"), 0) + k["dur"]
    stream = max(busy, key=busy.get) if busy else compute[0]["args"].get("stream")
    return sorted((k for k in compute if k["args"].get("stream") == stream), key=lambda k: k["ts"]), nccl


def profile_summary(trace: dict) -> dict:
    """Time by category (ms) of one profiled step, from a torch.profiler Chrome trace.

    The compute stream is the one running the attention kernels; its kernels are put in
    CATEGORIES by name, or by the host range they were launched in (a kernel launched
    inside "cp::merge" is the merge; "cp::forward" / "cp::backward" tell the phases). Its
    idle time between the step's first and last kernel is "NCCL kernel running" where an
    NCCL kernel (any stream) overlaps it, else a host gap. Also: NCCL kernel time, and the
    step's span on the compute stream."""
    events = _events(trace)
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ranges = {}
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name") in (_MERGE_RANGE, *_PHASES):
            ranges.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))

    def launched_in(kernel, name):
        ts = launches.get(kernel.get("args", {}).get("correlation"))
        return ts is not None and any(s <= ts <= e for s, e in ranges.get(name, ()))

    summary = {"categories_ms": {c: 0.0 for c in CATEGORIES}, "kernel_counts": {c: 0 for c in CATEGORIES}}
    compute, nccl = _compute_and_nccl(kernels)
    if not compute:
        return dict(summary, step_ms=0.0, nccl_kernel_ms=0.0, note="no GPU kernels in the trace")
    for k in compute:
        name = k["name"]
        if any(p in name for p in _ATTENTION_PASSES):
            category = "attention per-call passes"
        elif any(a in name for a in _ATTENTION):
            category = "attention kernels"
        elif "merge_kernel" in name or launched_in(k, _MERGE_RANGE):
            category = "merge"
        elif launched_in(k, "cp::backward") or not launched_in(k, "cp::forward"):
            category = "other elementwise (bwd)"  # the autograd thread's launches: after the forward's range
        else:
            category = "other elementwise (fwd)"
        summary["categories_ms"][category] += k["dur"] / 1e3
        summary["kernel_counts"][category] += 1
    nccl_union = _union((k["ts"], k["ts"] + k["dur"]) for k in nccl)
    busy_union = _union((k["ts"], k["ts"] + k["dur"]) for k in compute)
    for (_, end), (start, _) in zip(busy_union, busy_union[1:]):
        waiting = _overlap(end, start, nccl_union)
        summary["categories_ms"]["idle: NCCL kernel running"] += waiting / 1e3
        summary["categories_ms"]["idle: host gap"] += (start - end - waiting) / 1e3
    summary["step_ms"] = (busy_union[-1][1] - busy_union[0][0]) / 1e3
    summary["nccl_kernel_ms"] = sum(e - s for s, e in nccl_union) / 1e3
    # Communication hidden behind attention: NCCL kernel time during which an attention kernel ran.
    attention_union = _union((k["ts"], k["ts"] + k["dur"]) for k in compute
                             if any(a in k["name"] for a in _ATTENTION) and not any(p in k["name"] for p in _ATTENTION_PASSES))
    summary["nccl_beside_attention_ms"] = sum(_overlap(s, e, attention_union) for s, e in nccl_union) / 1e3
    return summary


def _profile(run, rank, trace_path):
    """Runs `run` once on every rank, recorded on rank 0; rank 0 returns profile_summary."""
    run()  # warm: the profiled step allocates nothing new
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    if rank != 0:
        with _merge_annotated():
            run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler, _merge_annotated():
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    profiler.export_chrome_trace(trace_path)
    with open(trace_path) as handle:
        return profile_summary(json.load(handle))


def rank_timeline(trace: dict) -> dict:
    """Where one rank's profiled step lies in time, in microseconds since the epoch on the host
    clock (the trace's baseTimeNanoseconds plus its event times; the profiler puts GPU
    timestamps on that clock too), so comparable between the ranks of one machine: the host's
    start of the "cp::forward" range, the first kernel's start and the last kernel's end on the
    compute stream (profile_summary's) and of the NCCL kernels. None where there is no such
    event (a CPU run has no kernels)."""
    events = _events(trace)
    base = trace.get("baseTimeNanoseconds", 0) / 1e3 if isinstance(trace, dict) else 0.0
    compute, nccl = _compute_and_nccl([e for e in events if e.get("cat") == "kernel" and "dur" in e])
    forward = [e["ts"] for e in events if e.get("cat") == "user_annotation" and e.get("name") == "cp::forward"]

    def at(times, pick):
        return base + pick(times) if times else None
    return {"forward_host_start_us": at(forward, min),
            "first_compute_kernel_us": at([k["ts"] for k in compute], min),
            "last_compute_kernel_end_us": at([k["ts"] + k["dur"] for k in compute], max),
            "first_nccl_kernel_us": at([k["ts"] for k in nccl], min),
            "last_nccl_kernel_end_us": at([k["ts"] + k["dur"] for k in nccl], max)}


def rank_profile(trace: dict, rank: int, timed_ms: float) -> dict:
    """One rank's entry of rank_profiles (small JSON numbers, gathered to rank 0): its
    rank_timeline, profile_summary, host, and timed_ms, the recorded step's time measured on
    that rank (CUDA events; the host clock on a CPU) to set beside the kernels' span."""
    return dict(rank=rank, host=trace.get("host_name") if isinstance(trace, dict) else None, timed_ms=timed_ms,
                **rank_timeline(trace), summary=profile_summary(trace))


def _profile_all_ranks(run, rank, trace_path):
    """Runs `run` once on every rank, every rank recording it into its own trace_path; returns
    every rank's rank_profile, in rank order, on every rank.

    The profiler starts in a warm-up step (its CUPTI set-up takes each rank its own time) that
    ends in the barrier, so the recorded step starts from the barrier on every rank alike."""
    cuda = torch.cuda.is_available()
    run()  # warm: the profiled step allocates nothing new
    if cuda:
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule,
                                on_trace_ready=lambda p: p.export_chrome_trace(trace_path)) as profiler, \
            _merge_annotated():
        dist.barrier()
        profiler.step()  # recording from here
        timed_ms = peers.median_ms(run, 1, cuda, warmup=0)  # CUDA events, or the host clock on a CPU
        profiler.step()  # the trace written
    with open(trace_path) as handle:
        entry = rank_profile(json.load(handle), rank, timed_ms)
    entries = [None] * dist.get_world_size()
    dist.all_gather_object(entries, entry)
    return entries


def _profile_lines(world, tokens, profiles, ideal_ms=None, mode="forward+backward"):
    names = list(profiles)
    lines = ["", f"Profile of one {mode} step on rank 0 of {world}, {tokens} tokens "
             "(time on the compute stream, ms and % of the step):", "",
             "| category | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for category in (*CATEGORIES, "step (compute stream span)", "NCCL kernels (any stream)",
                     "NCCL kernels beside an attention kernel"):
        cells = []
        for name in names:
            p = profiles[name]
            step = p["step_ms"] or 1.0
            if category.startswith("step"):
                cells.append(f"{p['step_ms']:.2f}")
            elif category == "NCCL kernels (any stream)":
                cells.append(f"{p['nccl_kernel_ms']:.2f}")
            elif category.startswith("NCCL kernels beside"):
                cells.append(f"{p.get('nccl_beside_attention_ms', 0.0):.2f}")
            else:
                ms = p["categories_ms"][category]
                cells.append(f"{ms:.2f} ({100 * ms / step:.1f}%, {p['kernel_counts'].get(category, 0)} kernels)"
                             if not category.startswith("idle") else f"{ms:.2f} ({100 * ms / step:.1f}%)")
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    if ideal_ms is not None:
        lines += ["", f"For scale: {world} x one GPU's whole {mode} on {tokens // world} tokens "
                  f"(the weak-scaling baseline, CUDA events): {ideal_ms:.2f} ms."]
    return lines


def _rank_lines(tokens, name, entries, mode="forward+backward"):
    """The per-rank timeline table of one variant's recorded step (--profile-all-ranks)."""
    def earliest(key):
        return min((e[key] for e in entries if e.get(key) is not None), default=None)

    def since(value, origin):
        return "n/a" if value is None or origin is None else f"{(value - origin) / 1e3:.2f}"

    host0, kernel0 = earliest("forward_host_start_us"), earliest("first_compute_kernel_us")
    lines = ["", f"Per-rank timeline of one {mode} step, {name}, {len(entries)} ranks, {tokens} tokens (ms; the host's "
             "start of cp::forward from the earliest rank's, kernel times from the earliest rank's first compute "
             "kernel; timed: CUDA events around the step on that rank, the host clock on a CPU):", "",
             "| rank | host start of cp::forward | first compute kernel | last compute kernel end | "
             "compute-stream span | timed step | attention kernels | NCCL kernels (union) | "
             "NCCL beside attention | idle: NCCL kernel running | idle: host gap | first NCCL kernel / last NCCL end |",
             "|---|" + "---|" * 11]
    for e in entries:
        p = e["summary"]
        categories = p["categories_ms"]
        lines.append(f"| {e['rank']} | {since(e['forward_host_start_us'], host0)} | "
                     f"{since(e['first_compute_kernel_us'], kernel0)} | "
                     f"{since(e['last_compute_kernel_end_us'], kernel0)} | "
                     f"{p['step_ms']:.2f} | {e['timed_ms']:.2f} | {categories['attention kernels']:.2f} | "
                     f"{p['nccl_kernel_ms']:.2f} | {p.get('nccl_beside_attention_ms', 0.0):.2f} | "
                     f"{categories['idle: NCCL kernel running']:.2f} | {categories['idle: host gap']:.2f} | "
                     f"{since(e['first_nccl_kernel_us'], kernel0)} / {since(e['last_nccl_kernel_end_us'], kernel0)} |")
    hosts = [e["forward_host_start_us"] for e in entries if e["forward_host_start_us"] is not None]
    host_skew = f"{(max(hosts) - min(hosts)) / 1e3:.2f} ms" if hosts else "n/a"
    firsts = [e["first_compute_kernel_us"] for e in entries if e["first_compute_kernel_us"] is not None]
    lasts = [e["last_compute_kernel_end_us"] for e in entries if e["last_compute_kernel_end_us"] is not None]
    if firsts and lasts:
        spread = (f"Across the ranks: the step spans {(max(lasts) - min(firsts)) / 1e3:.2f} ms (the latest last "
                  f"compute kernel's end less the earliest first compute kernel's start); the first compute kernels "
                  f"start within {(max(firsts) - min(firsts)) / 1e3:.2f} ms of each other, the hosts' cp::forward "
                  f"within {host_skew}.")
    else:
        spread = f"Across the ranks: no kernels in the traces; the hosts' cp::forward start within {host_skew}."
    if len({e.get("host") for e in entries}) > 1:
        spread += " The ranks ran on more than one machine: their clocks, so these differences, are not comparable."
    return lines + ["", spread]


def markdown_lines(result) -> list:
    """The tables of a result (main's, or one read back by --render)."""
    rows, profiles = result["rows"], result.get("profiles") or {}
    world = rows[0]["world"] if rows else 0
    lines = ["| tokens | GPUs | variant | ring fwd ms | ring fwd+bwd ms | 1 GPU, tokens/N: fwd / fwd+bwd ms | "
             "1 GPU, all tokens: fwd / fwd+bwd ms | weak eff. fwd / fwd+bwd | strong eff. fwd / fwd+bwd |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = r["ms"]
        total = (f"{ms['single_total_fwd']:.1f} / {ms['single_total_fwd_bwd']:.1f}"
                 if "single_total_fwd" in ms else r.get("note", "n/a"))
        for name, t in r["variants"].items():
            strong = (f"{t['strong_efficiency_fwd']:.2f} / {t['strong_efficiency_fwd_bwd']:.2f}"
                      if "strong_efficiency_fwd" in t else "n/a")
            lines.append(f"| {r['tokens']} | {world} | {name} | {t['fwd']:.1f} | {t['fwd_bwd']:.1f} | "
                         f"{ms['single_local_fwd']:.1f} / {ms['single_local_fwd_bwd']:.1f} | {total} | "
                         f"{t['weak_efficiency_fwd']:.2f} / {t['weak_efficiency_fwd_bwd']:.2f} | {strong} |")
    if any(r.get("torch_cp") for r in rows):
        best = {r["tokens"]: min((t for t in r["variants"].values()), key=lambda t: t["fwd_bwd"]) for r in rows}
        lines += ["", "PyTorch's context parallelism on the same GPUs (SDPA backend / rotate method); "
                  "ratio = its time / the fastest variant's above (by forward+backward):", "",
                  "| tokens | torch CP | fwd ms | fwd+bwd ms | ratio fwd / fwd+bwd |", "|---|---|---|---|---|"]
        for r in rows:
            for spec, t in r.get("torch_cp", {}).items():
                if "fwd_bwd" in t and "fwd" in t:
                    b = best[r["tokens"]]
                    lines.append(f"| {r['tokens']} | {spec} | {t['fwd']:.1f} | {t['fwd_bwd']:.1f} | "
                                 f"{t['fwd'] / b['fwd']:.2f} / {t['fwd_bwd'] / b['fwd_bwd']:.2f} |")
                else:
                    lines.append(f"| {r['tokens']} | {spec} | n/a | n/a | {t.get('error', 'n/a')} |")
    if profiles:
        mode = result.get("profile_mode", "fwd_bwd")
        tokens = result["profile_tokens"]
        ideal = [world * r["ms"][f"single_local_{mode}"] for r in rows if r["tokens"] == tokens]
        lines += _profile_lines(world, tokens, profiles, ideal[0] if ideal else None,
                                "forward" if mode == "fwd" else "forward+backward")
        for name, entries in (result.get("rank_profiles") or {}).items():
            lines += _rank_lines(tokens, name, entries, "forward" if mode == "fwd" else "forward+backward")
    return lines


def plot(result, path):
    """Weak-scaling efficiency by variant against tokens, forward and forward+backward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for axis, mode, label in zip(axes, ("fwd", "fwd_bwd"), ("forward", "forward+backward")):
        for name in rows[0]["variants"] if rows else ():
            points = [(r["tokens"], r["variants"][name][f"weak_efficiency_{mode}"]) for r in rows if name in r["variants"]]
            axis.plot([p[0] // 1024 for p in points], [p[1] for p in points], marker="o", label=name)
        axis.axhline(0.9, color="grey", linestyle=":", linewidth=1)
        axis.set_title(label)
        axis.set_xlabel("tokens (k)")
        axis.set_xscale("log", base=2)
    axes[0].set_ylabel(f"weak-scaling efficiency, {rows[0]['world'] if rows else '?'} GPUs")
    axes[0].legend(fontsize=8)
    figure.suptitle(f"{result['title']} ({result['device']})", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def render(path: str, out: str) -> int:
    """--render: the .md and .png of a result JSON written by a run (e.g. after a transfer that
    brought back only the JSON)."""
    with open(path) as handle:
        result = json.load(handle)
    world = result["rows"][0]["world"]
    peers.write_results(result, out, f"context_parallel_{world}gpu", extra_markdown=markdown_lines(result), plot=plot)
    return 0


# ---- main ------------------------------------------------------------------------------------

def _variant(name: str) -> dict:
    """A --variants entry: "ring" (ring-flash-attn as published: its merge and zigzag backward)
    or "portattn" (portattn's merge and backward, compat.import_ring_flash_attn's defaults),
    each with optional "+hp" (the ring's NCCL communicator on a high-priority stream, so its
    kernels take SMs ahead of an attention kernel's waiting CTAs) and "+margin<N>" (sm_margin:
    N SMs left out of portattn's persistent grids)."""
    base, *modifiers = name.split("+")
    if base not in ("ring", "portattn"):
        raise SystemExit(f"--variants: {name!r} does not start with ring or portattn")
    config = {"merge": base, "backward": base, "high_priority": False, "sm_margin": 0}
    for modifier in modifiers:
        if modifier == "hp":
            config["high_priority"] = True
        elif modifier.startswith("margin") and modifier[len("margin"):].isdigit():
            config["sm_margin"] = int(modifier[len("margin"):])
        else:
            raise SystemExit(f"--variants: {name!r}: unknown modifier {modifier!r} (hp, margin<N>)")
    return config


def _configure(config: dict):
    """Install a variant's merge, backward and sm_margin into ring-flash-attn."""
    margin = {"sm_margin": config["sm_margin"]} if config["sm_margin"] else {}
    return import_ring_flash_attn(merge=config["merge"], backward=config["backward"], **margin)


def _torch_cp_runner(spec, mesh, tokens, device, heads, head_dim, backward):
    """PyTorch's own context parallelism (torch.distributed.tensor.experimental.context_parallel:
    SDPA on a head-tail (zigzag) sharded sequence) for a "--torch-cp" spec "<sdpa backend>/<rotate
    method>". Returns (run, exit): enter the context once, time run(), then exit()."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend, rotate = spec.split("/")
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    set_rotate_method(rotate)
    generator = torch.Generator(device=device).manual_seed(0)  # every rank the same whole sequence
    shape = (1, heads, tokens, head_dim)
    buffers = [torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator) for _ in range(4)]
    stack = contextlib.ExitStack()
    stack.enter_context(sdpa_kernel([backends[backend]]))
    stack.enter_context(context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4,
                                         no_restore_buffers=set(buffers)))
    q, k, v, dout = buffers  # now this rank's shards
    for t in (q, k, v):
        t.requires_grad_()

    def run():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            torch.autograd.grad(out, (q, k, v), dout)
    return run, stack.close


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="131072,262144")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--variants", default="ring,portattn",
                        help="comma-separated: ring | portattn, each with optional +hp and +margin<N> (_variant)")
    parser.add_argument("--torch-cp", default="",
                        help="comma-separated <sdpa backend>/<rotate method> of PyTorch's context parallelism to time "
                             "beside, e.g. cudnn/allgather,cudnn/alltoall,flash/allgather")
    parser.add_argument("--profile", action="store_true", help="also profile one step per variant (rank 0)")
    parser.add_argument("--profile-variants", default="", help="the variants to profile (default: all)")
    parser.add_argument("--profile-tokens", type=int, default=0, help="tokens of the profiled step (0: the first of --tokens)")
    parser.add_argument("--profile-forward-only", action="store_true", help="profile a forward step (default: forward+backward)")
    parser.add_argument("--profile-all-ranks", action="store_true",
                        help="every rank records the profiled step: per-rank timelines (implies --profile)")
    parser.add_argument("--trace-dir", default="", help="keep the Chrome traces here (rank 0's, every rank's "
                                                        "with --profile-all-ranks)")
    parser.add_argument("--dry-run", action="store_true", help="CPU over gloo, tiny shapes: the plumbing only")
    parser.add_argument("--render", default="", help="write the .md and .png of this result JSON to --out and exit")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "latest"))
    args = parser.parse_args(argv)
    if args.render:
        return render(args.render, args.out)
    args.profile = args.profile or args.profile_all_ranks
    variants = {name: _variant(name) for name in (v.strip() for v in args.variants.split(",")) if name}
    profiled = [v.strip() for v in args.profile_variants.split(",") if v.strip()] or list(variants)
    torch_cp = [c.strip() for c in args.torch_cp.split(",") if c.strip()]
    cuda = not args.dry_run
    heads, head_dim = (HEADS, HEAD_DIM) if cuda else (2, 32)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    ring = import_ring_flash_attn()
    groups = {False: None}
    if any(c["high_priority"] for c in variants.values()):
        options = {}
        if cuda:
            options["pg_options"] = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        groups[True] = dist.new_group(list(range(world)), **options)
    mesh = None
    if torch_cp:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world,))
    token_counts = peers.parse_ints(args.tokens)
    profile_tokens = args.profile_tokens or token_counts[0]
    rows, profiles, rank_profiles = [], {}, {}

    def attention(config):
        group = groups[config["high_priority"]]
        return lambda q, k, v, causal: ring.zigzag_ring_flash_attn_func(q, k, v, causal=causal, group=group)

    for tokens in token_counts:
        local = tokens // world
        row = {"tokens": tokens, "world": world, "ms": {}, "variants": {name: {} for name in variants},
               "torch_cp": {}}
        q, k, v, dout = _inputs(local, device, heads, head_dim)
        for name, config in variants.items():
            _configure(config)
            for backward in (False, True):
                mode = "fwd_bwd" if backward else "fwd"
                row["variants"][name][mode] = _time_ms(_step(attention(config), q, k, v, dout, backward),
                                                       args.reps, cuda)
        for backward in (False, True):
            mode = "fwd_bwd" if backward else "fwd"
            # One GPU on the per-rank token count, every rank at once (no communication).
            row["ms"][f"single_local_{mode}"] = _time_ms(_step(portattn.flash_attn_func, q, k, v, dout, backward),
                                                         args.reps, cuda)
        if args.profile and tokens == profile_tokens:
            for name in profiled:
                _configure(variants[name])
                trace = os.path.join(args.trace_dir or tempfile.gettempdir(),
                                     f"context_parallel_{world}gpu_{tokens}_{name}_rank"
                                     f"{rank if args.profile_all_ranks else 0}.json")
                if args.trace_dir:
                    os.makedirs(args.trace_dir, exist_ok=True)
                step = _step(attention(variants[name]), q, k, v, dout, not args.profile_forward_only)
                if args.profile_all_ranks:
                    entries = _profile_all_ranks(step, rank, trace)
                    if rank == 0:
                        rank_profiles[name] = entries
                        profiles[name] = entries[0]["summary"]
                else:
                    summary = _profile(step, rank, trace)
                    if rank == 0:
                        profiles[name] = summary
                if (args.profile_all_ranks or rank == 0) and not args.trace_dir:
                    os.remove(trace)
        del q, k, v, dout
        if cuda:
            torch.cuda.empty_cache()
        for spec in torch_cp:
            row["torch_cp"][spec] = {}
            for backward in (False, True):
                mode = "fwd_bwd" if backward else "fwd"
                close = None
                try:
                    run, close = _torch_cp_runner(spec, mesh, tokens, device, heads, head_dim, backward)
                    row["torch_cp"][spec][mode] = _time_ms(run, args.reps, cuda)
                except Exception as error:  # recorded in the table: PyTorch's CP is a prototype API
                    row["torch_cp"][spec]["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                finally:
                    if close is not None:
                        close()
                if cuda:
                    torch.cuda.empty_cache()
        try:
            q, k, v, dout = _inputs(tokens, device, heads, head_dim)
            for backward in (False, True):
                mode = "fwd_bwd" if backward else "fwd"
                row["ms"][f"single_total_{mode}"] = _time_ms(
                    _step(portattn.flash_attn_func, q, k, v, dout, backward), args.reps, cuda)
            del q, k, v, dout
        except torch.cuda.OutOfMemoryError:
            row["note"] = "the whole sequence does not fit one GPU"
        if cuda:
            torch.cuda.empty_cache()
        for name, timings in row["variants"].items():
            for mode in ("fwd", "fwd_bwd"):
                ring_ms = timings[mode]
                # A causal call on tokens/N does 1/N^2 of the whole call's work; N GPUs share the
                # whole work, 1/N each: so one GPU's time for 1/N of the work is N x the local time.
                timings[f"weak_efficiency_{mode}"] = world * row["ms"][f"single_local_{mode}"] / ring_ms
                if f"single_total_{mode}" in row["ms"]:
                    timings[f"strong_efficiency_{mode}"] = row["ms"][f"single_total_{mode}"] / (world * ring_ms)
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    _configure(_variant("portattn"))
    if rank == 0:
        result = dict(peers.header(args.dry_run), title=f"Context parallelism: zigzag ring attention on {world} GPUs",
                      note=(f"bf16, causal, batch 1, {heads} heads x {head_dim}; ring-flash-attn on portattn over "
                            f"{'NCCL' if cuda else 'gloo (dry run)'}; variant: ring = ring-flash-attn as published "
                            "(its merge of the steps' outputs, its fp32 ring of dK/dV), portattn = portattn's merge "
                            "(merge_attention_states) and zigzag backward (Note [zigzag backward partials]); +hp: "
                            "the ring's NCCL stream at high priority; +margin<N>: sm_margin=N; torch_cp: PyTorch's "
                            "context_parallel with SDPA (<backend>/<rotate method>)"),
                      rows=rows, modes=[], impls=[], grid=[], profile_tokens=profile_tokens if profiles else None,
                      profiles=profiles)
        result["profile_mode"] = "fwd" if args.profile_forward_only else "fwd_bwd"
        if rank_profiles:
            result["rank_profiles"] = rank_profiles
        lines = markdown_lines(result)
        peers.write_results(result, args.out, f"context_parallel_{world}gpu", extra_markdown=lines, plot=plot)
        print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
