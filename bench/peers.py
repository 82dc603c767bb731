"""What the attention benchmarks share: the grid, the implementations timed side by side
(portattn and its peers), the timer, and the one writer of JSON / markdown / plot results.

An implementation that cannot run (a peer not installed, a backend refusing the call, a
compile failure) becomes an "n/a" cell with its reason; it never stops the run. Peers are
timed, never depended on: flash-attn-4 is imported only if its wheels were installed on the
device (bench/tools/fa4_stage.sh).

`--dry-run` (CPU, no triton): every implementation is still bound and called once on a small
proxy of each grid point (so import failures, refusals and the writers are exercised), and
the timer returns fake, deterministic values. Dry-run results say so in their header.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import os
import subprocess
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

HIDDEN = 2048  # FA2 paper grid: 32 heads x 64 or 16 heads x 128
TOKENS = 16384  # batch x seqlen
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
BWD_FACTOR = 2.5  # FA2 convention (and issue #6's table): backward = 2.5 x forward FLOPs
MODES = {"fwd": "forward", "fwd_bwd": "forward+backward"}
# Dry runs bind each implementation on this proxy (B=1, H=2, seqlen <= 64): exercising the
# code paths needs no realistic size, and the CPU reference backend is O(seqlen^2) in time.
DRY_PROXY_SEQLEN = 64


# ---- run metadata -----------------------------------------------------------------------
def commit() -> str:
    """The commit a result is labelled with: PORTATTN_COMMIT if set, else git's HEAD, marked "+dirty" when
    tracked files differ from it (a copied tree with a stale .git would otherwise carry an older commit's
    label; the mark makes such a label visibly not the tree that ran)."""
    if os.environ.get("PORTATTN_COMMIT"):
        return os.environ["PORTATTN_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if changed else "")


def _version(distribution: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def header(dry_run: bool) -> dict:
    """device, date, commit, torch and the peers' versions: the first lines of every result."""
    if dry_run or not torch.cuda.is_available():
        device = "cpu (DRY RUN: fake timings, not measurements)"
    else:
        device = torch.cuda.get_device_name()
    versions = {name: _version(name) for name in ("triton", "flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels")}
    return {
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "torch": torch.__version__,
        "versions": {k: v for k, v in versions.items() if v},
        "dry_run": dry_run,
    }


def flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, mode: str = "fwd") -> float:
    forward = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return forward * (1 + BWD_FACTOR) if mode == "fwd_bwd" else forward


@dataclass(frozen=True)
class Point:
    head_dim: int
    seqlen: int
    causal: bool

    @property
    def heads(self) -> int:
        return HIDDEN // self.head_dim

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    def flops(self, mode: str) -> float:
        return flops(self.batch, self.heads, self.seqlen, self.head_dim, self.causal, mode)

    def label(self) -> str:
        return f"hd{self.head_dim} s{self.seqlen:5d} {'causal' if self.causal else 'full  '}"



def median_ms(fn, reps: int, cuda: bool, warmup: int = 2, before: Optional[Callable[[], None]] = None) -> float:
    """Median wall time of fn() in ms over `reps` runs after `warmup` untimed ones: CUDA events
    around each run on a GPU, the host clock on a CPU. `before` runs untimed ahead of each
    timed run (e.g. a distributed barrier)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - begin))
    times.sort()
    middle = len(times) // 2
    return times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2

def grid(head_dims, seqlens, causal=(False, True)) -> list:
    return [Point(hd, s, c) for hd in head_dims for s in seqlens for c in causal]


def parse_ints(text: str) -> list:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) <= 0:
        raise SystemExit(f"expected positive integers, got {text!r}")
    return values


# Many short sequences (bench_short.py and the tools that probe its cells): a fixed batch and
# head count instead of the FA2 grid's 16k tokens.
SHORT_BATCH = 512
SHORT_HEADS = 16


@dataclass(frozen=True)
class ShortPoint(Point):
    """A grid point at SHORT_BATCH x SHORT_HEADS instead of the FA2 grid's 16k tokens."""

    @property
    def heads(self) -> int:
        return SHORT_HEADS

    @property
    def batch(self) -> int:
        return SHORT_BATCH


def parse_point(text: str, short: bool = False) -> Point:
    """head_dim:seqlen:causal|full on the FA2 grid's 16k tokens, or with `short` a ShortPoint."""
    head_dim, seqlen, mask = text.split(":")
    if mask not in ("causal", "full"):
        raise SystemExit(f"point '{text}' must end in :causal or :full")
    return (ShortPoint if short else Point)(int(head_dim), int(seqlen), mask == "causal")


# ---- the implementations ---------------------------------------------------------------
# Each binds (q, k, v) in (batch, seqlen, heads, head_dim) layout to a zero-argument call
# returning the output in that layout (a view is fine: autograd follows it). Bindings run
# inside `context`, which is also held while timing, so a context's own cost (sdpa_kernel's
# ~30 us, force_backend) stays outside the timed loop.

@contextlib.contextmanager
def _portattn_forced(name: Optional[str]):
    from portattn import dispatch

    before = dispatch.DISPATCHER.forced
    dispatch.force_backend(name)
    try:
        yield
    finally:
        dispatch.force_backend(before)


def _bind_portattn(deterministic: bool):
    import portattn

    def bind(q, k, v, causal):
        return lambda: portattn.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    return bind


def _bind_sm80_kernel():
    """CudaBackend.forward alone: no validation, dispatch or allocation (tuning runs)."""
    from portattn.backends.cuda import CudaBackend

    backend = CudaBackend()
    if getattr(backend, "unavailable_reason", ""):
        raise RuntimeError(backend.unavailable_reason)

    def bind(q, k, v, causal):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
        options = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                       softmax_scale=q.shape[-1] ** -0.5, window_left=-1, window_right=0 if causal else -1,
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0)

        def call():
            backend.forward(q, k, v, out, lse, **options)
            return out
        return call
    return bind


def _bind_sdpa():
    import torch.nn.functional as F

    def bind(q, k, v, causal):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's (B, H, S, D) view
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    return bind


def _sdpa_context(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, backend_name))


def _bind_flex():
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Dynamic shapes: every (head dim, mask, grad mode) compiles once for all the grid's
    # seqlens (compiles dominate the run otherwise). Should a dynamic compile fail, static
    # shapes (one compile per point) take over for the rest of the run. A recompile-limit
    # hit must fail (n/a), never fall back to eager flex, which materialises the
    # O(seqlen^2) scores.
    for name, value in (("recompile_limit", 64), ("fail_on_recompile_limit_hit", True)):
        with contextlib.suppress(AttributeError):
            setattr(torch._dynamo.config, name, value)
    variants = [torch.compile(flex_attention, dynamic=True, fullgraph=True),
                torch.compile(flex_attention, dynamic=False, fullgraph=True)]

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx  # square grid: bottom-right and top-left alignment coincide

    def bind(q, k, v, causal):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        mask = (create_block_mask(causal_mask, None, None, q.shape[1], k.shape[1], device=q.device)
                if causal else None)
        while True:
            compiled = variants[0]
            try:
                compiled(qt, kt, vt, block_mask=mask)  # compiles now, so a failure can switch variant
            except Exception:
                if len(variants) == 1:
                    raise
                variants.pop(0)
                continue
            return lambda: compiled(qt, kt, vt, block_mask=mask).transpose(1, 2)
    return bind


def _bind_fa4():
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as error:
        # bench/tools/fa4_stage.sh says why the wheels are not installed, when it knows.
        staged = os.environ.get("PORTATTN_FA4_MISSING")
        raise ImportError(f"{staged} ({error})" if staged else str(error)) from error

    def bind(q, k, v, causal):
        def call():
            out = flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out  # 4.0 betas return (out, lse)
        return call
    return bind


@dataclass(frozen=True)
class Impl:
    name: str  # JSON key
    label: str  # table / plot label
    short: str  # compact stdout table
    load: Callable  # () -> bind(q, k, v, causal) -> call; raising = n/a with the reason
    context: Callable = contextlib.nullcontext
    modes: tuple = ("fwd", "fwd_bwd")


IMPLS = {impl.name: impl for impl in (
    Impl("portattn", "portattn", "pa", functools.partial(_bind_portattn, False),
         functools.partial(_portattn_forced, None)),
    Impl("portattn_sm80", "portattn sm80+ path (forced)", "sm80", functools.partial(_bind_portattn, False),
         functools.partial(_portattn_forced, "cuda")),
    Impl("portattn_det", "portattn deterministic", "det", functools.partial(_bind_portattn, True),
         functools.partial(_portattn_forced, None), modes=("fwd_bwd",)),
    Impl("portattn_sm80_det", "portattn sm80+ path deterministic (forced)", "s80det",
         functools.partial(_bind_portattn, True), functools.partial(_portattn_forced, "cuda"), modes=("fwd_bwd",)),
    Impl("sm80_kernel", "sm80+ kernel (CudaBackend.forward, direct)", "kern", _bind_sm80_kernel, modes=("fwd",)),
    Impl("sdpa_flash", "SDPA flash (FA2)", "fa2", _bind_sdpa, functools.partial(_sdpa_context, "FLASH_ATTENTION")),
    Impl("sdpa_cudnn", "SDPA cuDNN", "cudnn", _bind_sdpa, functools.partial(_sdpa_context, "CUDNN_ATTENTION")),
    Impl("flex", "FlexAttention (compiled)", "flex", _bind_flex),
    Impl("fa4", "flash-attn-4", "fa4", _bind_fa4),
)}
# The ratio columns: portattn against each of these, where both were measured.
RATIO_PEERS = ("sdpa_cudnn", "fa4", "sdpa_flash")


def select(names: str) -> list:
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in IMPLS]
    if unknown or not chosen:
        raise SystemExit(f"unknown implementation(s) {unknown}; choose from {', '.join(IMPLS)}")
    return [IMPLS[name] for name in chosen]


@functools.lru_cache(maxsize=None)
def load_impl(name: str):
    """(bind, None) or (None, why): each implementation is imported once per run."""
    try:
        return IMPLS[name].load(), None
    except Exception as error:  # any failure of a peer's import is a reason, not a crash
        return None, _reason(error)


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    # torch.compile wraps the real error ("Observed exception"); its debug context names it.
    inner = next((line.strip() for line in lines if "raised exception" in line), "")
    return f"{type(error).__name__}: {text}{' / ' + inner if inner else ''}"[:300]


# ---- timing -----------------------------------------------------------------------------
class Timer:
    """Median ms of triton.testing.do_bench; fake (derived from a hash) in a dry run."""

    def __init__(self, warmup_ms: int = 20, rep_ms: int = 80, dry_run: bool = False):
        self.warmup_ms, self.rep_ms, self.dry_run = warmup_ms, rep_ms, dry_run

    def sync(self):
        if not self.dry_run:
            torch.cuda.synchronize()

    def ms(self, step, work: float, salt: str) -> float:
        if self.dry_run:
            fake_tflops = 150 + zlib.crc32(salt.encode()) % 500
            return work / fake_tflops / 1e9
        from triton.testing import do_bench

        return do_bench(step, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")


def require_device(dry_run: bool) -> None:
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: --dry-run checks the plumbing on the CPU (fake timings)")


def make_inputs(point: Point, dry_run: bool):
    """q, k, v (leaves that require grad) and dout; a small CPU proxy in a dry run."""
    if dry_run:
        shape = (1, min(point.seqlen, DRY_PROXY_SEQLEN), 2, point.head_dim)
        device = "cpu"
    else:
        shape = (point.batch, point.seqlen, point.heads, point.head_dim)
        device = "cuda"
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn_like(q)


def chosen_backend(q, causal: bool, backward: bool) -> str:
    """The backend portattn's dispatch picks for this call (automatic, not forced)."""
    try:
        from portattn import dispatch

        with _portattn_forced(None):
            bits = dispatch.feature_bits(-1, 0 if causal else -1, 0.0, False, 0.0, False, False, backward=backward)
            return dispatch.DISPATCHER.backend_for(q.device, q.dtype, q.shape[-1], bits).name
    except Exception as error:
        return f"? ({_reason(error)})"


def time_call(make_call, mode: str, tensors, timer: Timer, work: float, salt: str) -> float:
    """Median ms of one step: `make_call(q, k, v)` run under no_grad (fwd, on inputs that need no
    grad: peers specialise on it) or with autograd.grad of q, k, v (fwd_bwd), after one warm-up
    call (compiles, self-checks)."""
    q, k, v, dout = tensors
    if mode == "fwd":
        q, k, v = q.detach(), k.detach(), v.detach()
    call = make_call(q, k, v)
    if mode == "fwd":
        def step():
            with torch.no_grad():
                return call()
    else:
        def step():
            return torch.autograd.grad(call(), (q, k, v), dout)
    step()
    timer.sync()
    return timer.ms(step, work, salt)


def measure(impl: Impl, mode: str, point: Point, tensors, timer: Timer):
    """(ms, None) or (None, why): one warm-up call (compiles, self-checks), then the timer."""
    bind, why = load_impl(impl.name)
    if bind is None:
        return None, why
    q, k, v, dout = tensors
    try:
        with impl.context():
            return time_call(lambda q, k, v: bind(q, k, v, point.causal), mode, (q, k, v, dout), timer,
                             point.flops(mode), f"{impl.name}/{mode}/{point}"), None
    except Exception as error:  # a refusal or failure of one cell must not end the run
        if not timer.dry_run:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        return None, _reason(error)


def run_grid(points, impls, modes, timer: Timer, budget_s: float = math.inf, on_point=None) -> list:
    """One row per point: TFLOP/s and ms per (mode, implementation), n/a reasons, and the
    backends portattn's dispatch chose. Past `budget_s` the remaining cells are n/a (the
    device call has a hard limit; a partial table beats none). `on_point(rows)` after each."""
    start = time.monotonic()
    rows = []
    for point in points:
        row = {"head_dim": point.head_dim, "heads": point.heads, "batch": point.batch, "seqlen": point.seqlen,
               "causal": point.causal, "backend": {}, "tflops": {}, "ms": {}, "na": {}}
        tensors = make_inputs(point, timer.dry_run)
        forward = chosen_backend(tensors[0], point.causal, backward=False)
        for mode in modes:
            # fwd+bwd runs two dispatch decisions: name both where they differ.
            backward = chosen_backend(tensors[0], point.causal, backward=True) if mode == "fwd_bwd" else forward
            row["backend"][mode] = forward if backward == forward else f"{forward} + {backward}"
            tflops, ms, na = row["tflops"].setdefault(mode, {}), row["ms"].setdefault(mode, {}), {}
            for impl in impls:
                if mode not in impl.modes:
                    continue
                if time.monotonic() - start > budget_s:
                    result, why = None, f"not run: the {budget_s:.0f} s time budget was spent"
                else:
                    result, why = measure(impl, mode, point, tensors, timer)
                ms[impl.name] = result
                tflops[impl.name] = point.flops(mode) / result / 1e9 if result else None
                if why:
                    na[impl.name] = why
            row["na"][mode] = na
        rows.append(row)
        print(compact_line(row, impls, modes), flush=True)
        del tensors
        if on_point is not None:
            on_point(rows)
    return rows


# ---- derived numbers --------------------------------------------------------------------
def ratio(row, mode, a="portattn", b="sdpa_cudnn") -> Optional[float]:
    values = row["tflops"].get(mode, {})
    return values[a] / values[b] if values.get(a) and values.get(b) else None


def backward_only_tflops(row, name) -> Optional[float]:
    """Backward FLOPs (2.5 x forward) / (fwd+bwd time - forward time)."""
    fwd, both = row["ms"].get("fwd", {}).get(name), row["ms"].get("fwd_bwd", {}).get(name)
    if not fwd or not both or both <= fwd:
        return None
    work = flops(row["batch"], row["heads"], row["seqlen"], row["head_dim"], row["causal"]) * BWD_FACTOR
    return work / (both - fwd) / 1e9


def _point_text(row) -> str:
    return f"hd{row['head_dim']} s{row['seqlen']:5d} {'causal' if row['causal'] else 'full  '}"


def fmt_num(value, digits=0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def compact_line(row, impls, modes) -> str:
    parts = [_point_text(row)]
    for mode in modes:
        cells = [f"{impl.short} {fmt_num(row['tflops'][mode].get(impl.name))}" for impl in impls
                 if impl.name in row["tflops"][mode]]
        ratios = [f"pa/{IMPLS[peer].short} {fmt_num(ratio(row, mode, 'portattn', peer), 2)}" for peer in RATIO_PEERS[:2]
                  if "portattn" in row["tflops"][mode] and peer in row["tflops"][mode]]
        parts.append(f"{'f+b' if mode == 'fwd_bwd' else mode}: " + " ".join(cells + ratios))
    return " | ".join(parts)


def na_reasons(rows) -> dict:
    """{implementation: [distinct reasons]} over the whole grid, in first-seen order."""
    reasons: dict = {}
    for row in rows:
        for per_mode in row["na"].values():
            for name, why in per_mode.items():
                if why not in reasons.setdefault(name, []):
                    reasons[name].append(why)
    return reasons


def compact_table(result) -> str:
    """The end-of-run summary (the device reply keeps only the tail of the output)."""
    impls = [IMPLS[name] for name in result["impls"]]
    lines = [f"== {result['title']}: {result['device']}, {result['date']}, commit {result['commit']}, "
             f"torch {result['torch']}, TFLOP/s",
             "   " + ", ".join(f"{impl.short} = {impl.label}" for impl in impls)]
    lines += [compact_line(row, impls, result["modes"]) for row in in_order(result["grid"])]
    backends = sorted({f"{mode}: {row['backend'][mode]}" for row in result["grid"] for mode in result["modes"]})
    lines.append("portattn dispatch chose: " + "; ".join(backends))
    for name, whys in na_reasons(result["grid"]).items():
        lines.append(f"n/a {name}: " + " | ".join(whys[:2])[:400])
    return "\n".join(lines)


# ---- writing results ---------------------------------------------------------------------
def in_order(rows) -> list:
    """Tables read by head dim, seqlen, causal, whatever order the grid ran in."""
    return sorted(rows, key=lambda r: (r["head_dim"], r["seqlen"], r["causal"]))


def _markdown_grid(result) -> list:
    impls = [IMPLS[name] for name in result["impls"]]
    lines = []
    for mode in result["modes"]:
        shown = [impl for impl in impls if mode in impl.modes]
        peers = [p for p in RATIO_PEERS if p in result["impls"] and "portattn" in result["impls"]]
        factor = "" if mode == "fwd" else f", FLOPs = {1 + BWD_FACTOR} x forward"
        lines += [f"## {MODES[mode].capitalize()} TFLOP/s (bf16, batch x seqlen = {TOKENS}, hidden {HIDDEN}{factor})", "",
                  "| hd | seqlen | causal | " + " | ".join(impl.label for impl in shown)
                  + "".join(f" | portattn / {IMPLS[p].label}" for p in peers) + " |",
                  "|---" * (3 + len(shown) + len(peers)) + "|"]
        for row in in_order(result["grid"]):
            values = row["tflops"][mode]
            cells = []
            for impl in shown:
                cell = fmt_num(values.get(impl.name), 1)
                if impl.name == "portattn" and values.get(impl.name) is not None:
                    cell += f" ({row['backend'][mode]})"
                cells.append(cell)
            cells += [fmt_num(ratio(row, mode, "portattn", p), 3) for p in peers]
            lines.append(f"| {row['head_dim']} | {row['seqlen']} | {row['causal']} | " + " | ".join(cells) + " |")
        lines.append("")
    if set(result["modes"]) == {"fwd", "fwd_bwd"}:
        both = [impl for impl in impls if set(impl.modes) >= {"fwd", "fwd_bwd"}]
        lines += ["## Backward alone, derived (TFLOP/s = 2.5 x forward FLOPs / (fwd+bwd time - forward time))", "",
                  "| hd | seqlen | causal | " + " | ".join(impl.label for impl in both) + " |",
                  "|---" * (3 + len(both)) + "|"]
        for row in in_order(result["grid"]):
            lines.append(f"| {row['head_dim']} | {row['seqlen']} | {row['causal']} | "
                         + " | ".join(fmt_num(backward_only_tflops(row, impl.name), 1) for impl in both) + " |")
        lines.append("")
    reasons = na_reasons(result["grid"])
    if reasons:
        lines += ["n/a cells, why:", ""]
        lines += [f"- {IMPLS[name].label}: " + "; ".join(whys[:3]) + (f" (+{len(whys) - 3} more)" if len(whys) > 3 else "")
                  for name, whys in reasons.items()]
        lines.append("")
    return lines


def _plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [(hd, causal) for hd in sorted({r["head_dim"] for r in result["grid"]}) for causal in (False, True)
              if any(r["head_dim"] == hd and r["causal"] == causal for r in result["grid"])]
    modes = result["modes"]
    if not panels:
        return
    fig, axes = plt.subplots(len(modes), len(panels), figsize=(4.5 * len(panels), 3.8 * len(modes)),
                             sharey="row", squeeze=False)
    for i, mode in enumerate(modes):
        for j, (hd, causal) in enumerate(panels):
            ax = axes[i][j]
            rows = [r for r in in_order(result["grid"]) if r["head_dim"] == hd and r["causal"] == causal]
            xs = [str(r["seqlen"]) for r in rows]
            for name in result["impls"]:
                if name not in rows[0]["tflops"][mode]:
                    continue
                ys = [r["tflops"][mode].get(name) for r in rows]
                ys = [math.nan if y is None else y for y in ys]  # n/a: a gap, not a zero
                missing = all(math.isnan(y) for y in ys)
                ax.plot(xs, ys, marker="o", label=IMPLS[name].label + (" (n/a)" if missing else ""))
            ax.set_title(f"{MODES[mode]}, hd {hd}, {'causal' if causal else 'full'}", fontsize=10)
            ax.set_xlabel("seqlen")
            ax.grid(alpha=0.3)
        axes[i][0].set_ylabel(f"{MODES[mode]} TFLOP/s (bf16)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{result['device']}  {result['date']}  ({result['commit']}, torch {result['torch']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# The default --out of every benchmark script: the current table per question, which
# bench/run_all.sh regenerates (bench/results/README.md).
LATEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "latest")
# The default --out of the tools in bench/tools/: what they write is not a table of latest/.
SCRATCH = os.path.join("/tmp", "portattn-bench-tools")


def write_results(result, out_dir: str, name: str, extra_markdown=(), plot=None) -> str:
    """The one writer of benchmark results; every benchmark in bench/ writes through it.

    <out_dir>/<name>.json: `result` as is. <name>.md: `# title`, one line with device, date,
    commit, torch and the peers' versions (the same header in every result file), `note`,
    the grid tables when `result["grid"]` is non-empty, then the `extra_markdown` lines.
    <name>.png: the grid plot, or `plot(result, path)` when given. Returns the .md path."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    with open(base + ".json", "w") as handle:
        json.dump(result, handle, indent=1)
    versions = ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())
    lines = [f"# {result['title']}", "",
             f"device: {result['device']}; date: {result['date']}; commit: {result.get('commit', 'unknown')}; "
             f"torch {result.get('torch', torch.__version__)}" + (f"; {versions}" if versions else ""), ""]
    if result.get("note"):
        lines += [result["note"], ""]
    if result.get("grid"):
        lines += _markdown_grid(result)
    lines += list(extra_markdown)
    with open(base + ".md", "w") as handle:
        handle.write("\n".join(lines).rstrip() + "\n")
    if plot is not None:
        plot(result, base + ".png")
    elif result.get("grid"):
        _plot(result, base + ".png")
    return base + ".md"


def kernel_breakdown(point: Point, impls, top_n: int = 6) -> list:
    """Per implementation: the CUDA kernels of one forward+backward step and their total GPU time."""
    from torch.profiler import ProfilerActivity, profile

    lines = [f"### GPU kernels of one forward+backward step, {point.label()} (batch {point.batch}, {point.heads} heads)", ""]
    q, k, v, dout = make_inputs(point, dry_run=False)
    for impl in impls:
        bind, why = load_impl(impl.name)
        if bind is None:
            lines.append(f"- {impl.label}: n/a ({why})")
            continue
        with impl.context():
            call = bind(q, k, v, point.causal)

            def step():
                return torch.autograd.grad(call(), (q, k, v), dout)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in events)
        top = sorted(events, key=lambda e: -e.device_time_total)[:top_n]
        lines.append(f"- {impl.label}: {total:.0f} us of GPU time: "
                     + "; ".join(f"{e.key[:60]} {e.device_time_total:.0f} us x{e.count}" for e in top))
    lines.append("")
    return lines
