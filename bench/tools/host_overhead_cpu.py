"""Python host time of portattn's compiled (CUDA) path, measured on a CPU with a no-op extension module.

  python bench/tools/host_overhead_cpu.py [--repeat 5] [--calls=200] [--shapes short,hd128_1k,varlen,gqa]
                                    [--out FILE.json] [--profile SHAPE]

Why: a short call's GPU work (batch 512 x 50 rows, hd16: ~285 us per forward+backward on an H100) is
shorter than the host's time to issue it, so the Python between the user's call and the kernel launch
is the step time (bench/tools/profile_host.py measures it on the GPU; its cProfile is where this tool came
from). This tool runs the real Python path of the compiled backend -- api.py validation, ops.py's
autograd Function, dispatch, backends/compiled.py, abi.py's argument marshalling and allocations --
with the `_C` module replaced by a stand-in whose functions have the real ones' argument lists and
do nothing (bwd_workspace_bytes returns a size of the real one's order, so the workspace allocation
is timed too). So it times what host-side Python changes can change, on any machine, before and after.

What differs from the GPU (all the same before and after a change, so comparisons hold):
- tensors live on the CPU: allocations are the CPU allocator's (malloc, not the CUDA caching
  allocator), and the autograd engine runs the backward on the calling thread (on a GPU it hands
  it to the device's thread);
- the device checks that only a CUDA tensor passes are met by the harness (the dispatcher decides
  as for cuda:0 on an H100, the stream and current-device queries are stubs, see `install`); the
  CUDA-only decode-shape test in ops.run_forward (a few integer comparisons) is not taken.

Output: a table of median microseconds per forward call (autograd recording on, as in training) and
per backward call (torch.autograd.grad of the output), per shape; `--out` writes the same as JSON,
with every round's medians. Each of --repeat rounds times --calls forward+backward steps (gc off
inside a round) and takes their medians; the table shows the lowest round median of each column,
since on a shared machine other processes only add time. To compare two versions, run both
alternately (bench/tools/host_overhead_cpu.py is self-contained: `--portattn DIR` times another checkout's
library with this harness).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import os
import platform
import pstats
import statistics
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
# Set by load(): the portattn modules under test.
portattn = dispatch = abi = compiled = matrix = probe = CudaBackend = CudaSm90Backend = None


def load(root: str = ROOT) -> None:
    """Import portattn from the checkout at `root` (this one by default; --portattn DIR times an
    older checkout's library with this same harness)."""
    global portattn, dispatch, abi, compiled, matrix, probe, CudaBackend, CudaSm90Backend
    sys.path.insert(0, os.path.abspath(root))
    import portattn
    from portattn import dispatch
    from portattn.backends import abi, compiled
    from portattn.backends.cuda import CudaBackend, CudaSm90Backend
    from portattn.capability import matrix, probe

    if not os.path.abspath(portattn.__file__).startswith(os.path.abspath(root) + os.sep):
        raise RuntimeError(f"imported {portattn.__file__}, not the checkout at {root}")


# (name, description): the shapes follow bench/tools/profile_host.py's short cell and the GPU grids,
# smaller in batch so the buffers stay modest (see `keep_allocations_on_the_heap` too).
SHAPES = {
    "short": "batch 512 x 50 rows, 16 heads, hd16, causal (bench_short's host-bound cell)",
    "hd128_1k": "batch 2 x 1024 rows, 16 heads, hd128, causal",
    "varlen": "varlen: 8 documents, 2048 rows (longest 512), 16 heads, hd64, causal",
    "gqa": "batch 1 x 1024 rows, 32/8 heads (GQA), hd128, causal",
    "floor": "the short shape through a bare autograd.Function: what torch and the allocations cost",
}
DEFAULT_SHAPES = "short,hd128_1k,varlen,gqa,floor"
DTYPE = torch.bfloat16


# ---- the stand-in extension module --------------------------------------------------------

BWD_OWN_ARGS = ("dout", "dout_strides", "dq", "dq_strides", "dk", "dk_strides", "dv", "dv_strides",
                "workspace", "workspace_bytes", "deterministic")  # PORTATTN_BWD_OWN_ARG_NAMES


def _no_op(name: str, params: tuple, counts: dict):
    """A Python function named `name` taking exactly `params` (so a wrong argument count raises
    as the pybind11 binding would), counting its calls and doing nothing else."""
    source = f"def {name}({', '.join(params)}):\n    counts[{name!r}] += 1\n"
    scope = {"counts": counts}
    exec(source, scope)  # noqa: S102 - a generated signature, no user input
    return scope[name]


def _align(nbytes: int) -> int:
    return (nbytes + 255) // 256 * 256


def _workspace_bytes(batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k, deterministic, ordered_dq=False):
    """The sm80+ backward's layout (tests/test_cuda_host.py): rowsum and LSE copies, one fp32
    dQ, and fp32 dK/dV accumulators for GQA (the deterministic split factor is left out)."""
    rows = batch * nheads * seqlen_q
    size = 2 * _align(rows * 4) + _align(rows * headdim * 4)
    if nheads_k != nheads:
        size += 2 * _align(batch * seqlen_k * nheads_k * headdim * 4)
    return size


_STANDIN: list = []  # the installed stand-in module (for the floor)


def standin_module(counts: dict) -> types.ModuleType:
    """What abi.py / compiled.py / backends/cuda call on `_C`, with the real argument lists."""
    fields = abi.FwdArgs._fields
    module = types.ModuleType("portattn_standin_C")
    for name in ("fwd", "hopper_fwd"):
        counts[name] = 0
        setattr(module, name, _no_op(name, fields, counts))
    for name in ("bwd", "hopper_bwd"):
        counts[name] = 0
        setattr(module, name, _no_op(name, BWD_OWN_ARGS + fields, counts))
    module.bwd_workspace_bytes = _workspace_bytes
    build = {"archs": ["sm_80", "sm_90"], "ptx": [], "head_dims": [16, 32, 64, 96, 128, 192, 256],
             "dtypes": ["float16", "bfloat16"],
             "hopper": {"archs": ["sm_90a"], "head_dims": [64, 96, 128, 192, 256], "dtypes": ["float16", "bfloat16"]}}
    module.build_config = lambda: build
    return module


# ---- making CPU tensors dispatch as CUDA ones ---------------------------------------------


def _standin_backend(cls, module, device_info):
    backend = cls.__new__(cls)
    compiled.CompiledBackend.__init__(backend, module, "")
    backend._devices = [device_info]

    # The support declaration is asked as for the same call on cuda:0 (the tensors are CPU ones).
    # Cold path only: dispatch caches the verdict per key.
    def unsupported_reasons(call, backend=backend):
        on_gpu = dataclasses.replace(call, device_type="cuda", device_index=0)
        return matrix.check_call(backend.name, device_info, on_gpu, backend.build_config())

    backend.unsupported_reasons = unsupported_reasons
    return backend


def install(counts: dict) -> dispatch.Dispatcher:
    """Route CPU calls to the CUDA backends (Hopper path first, as on an H100) over the stand-in
    module. Only this process is changed: the library's code is not."""
    module = standin_module(counts)
    h100 = probe.fake_device("h100", 0)
    slots = [dispatch._BackendSlot(cls.name, _standin_backend(cls, module, h100))
             for cls in (CudaSm90Backend, CudaBackend)]
    slots.append(dispatch._BackendSlot("reference", dispatch.ReferenceBackend()))
    dispatcher = dispatch.Dispatcher(slots, None)
    dispatcher._selfcheck = lambda slot, device: ""  # nothing to check: the kernels are no-ops
    dispatch.DISPATCHER = dispatcher
    _STANDIN.append(module)
    # A CPU torch has no CUDA stream or device queries; C builtins stand in, as cheap as the real
    # ones (a CPU tensor's device index is None: bool(None) -> False; int() -> 0).
    abi.raw_stream = bool
    compiled._current_device = int
    return dispatcher


def keep_allocations_on_the_heap() -> bool:
    """Make glibc serve every allocation from its heap (no mmap/munmap per large buffer).

    By default glibc maps buffers above a threshold (at most 32 MB) with mmap and unmaps them
    on free, so a backward whose workspace crosses it would time page mapping (5-20 us, varying
    run to run) instead of Python; torch's CUDA caching allocator reuses its blocks. False where
    mallopt is unavailable (not glibc): the numbers then include that cost.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
        # No mmap'd chunks at all, and no returning the heap's top to the system on free.
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))
    except (OSError, AttributeError):
        return False


# ---- the calls ------------------------------------------------------------------------------


def _leaf(shape, generator):
    return torch.randn(shape, dtype=DTYPE, generator=generator).requires_grad_()


class _Floor(torch.autograd.Function):
    """The least any eager attention op pays per step: portattn's autograd node (the same seven
    inputs, two outputs, saved tensors), its allocations (out, lse, the three gradients) and one
    stand-in launch each way with prebuilt arguments; no validation, dispatch or marshalling."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, options):
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
        module, fwd, _ = options
        module.fwd(*fwd)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        module, _, bwd = ctx.options
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        module.bwd(*bwd)
        return dq, dk, dv, None, None, None, None


def make_call(name: str):
    """(call, inputs): call() runs one forward with autograd recording; inputs get gradients."""
    g = torch.Generator().manual_seed(0)
    if name == "short":
        q, k, v = (_leaf((512, 50, 16, 16), g) for _ in range(3))
        return (lambda: portattn.flash_attn_func(q, k, v, causal=True)), (q, k, v)
    if name == "hd128_1k":
        q, k, v = (_leaf((2, 1024, 16, 128), g) for _ in range(3))
        return (lambda: portattn.flash_attn_func(q, k, v, causal=True)), (q, k, v)
    if name == "gqa":
        q = _leaf((1, 1024, 32, 128), g)
        k, v = (_leaf((1, 1024, 8, 128), g) for _ in range(2))
        return (lambda: portattn.flash_attn_func(q, k, v, causal=True)), (q, k, v)
    if name == "floor":
        q, k, v = (_leaf((512, 50, 16, 16), g) for _ in range(3))
        fwd = (0,) * len(abi.FwdArgs._fields)
        options = (_STANDIN[0], fwd, (0,) * len(BWD_OWN_ARGS) + fwd)
        return (lambda: _Floor.apply(q, k, v, None, None, None, options)[0]), (q, k, v)
    if name == "varlen":
        lengths = [150, 350, 64, 512, 256, 450, 116, 150]
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        total, longest = int(cu[-1]), max(lengths)
        q, k, v = (_leaf((total, 16, 64), g) for _ in range(3))
        return (lambda: portattn.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)), (q, k, v)
    raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")


def time_shape(name: str, repeat: int, calls: int, counts: dict) -> dict:
    call, inputs = make_call(name)
    dout = torch.randn_like(call())
    for _ in range(20):  # warm-up: dispatch's first decision, allocator caches
        torch.autograd.grad(call(), inputs, dout)
    before = dict(counts)
    rounds = []  # per round: (forward, backward, step) medians
    grad = torch.autograd.grad
    clock = time.perf_counter
    for _ in range(repeat):
        forward_us, backward_us = [], []
        gc.collect()
        gc.disable()
        try:
            for _ in range(calls):
                begin = clock()
                out = call()
                middle = clock()
                grad(out, inputs, dout)
                end = clock()
                forward_us.append((middle - begin) * 1e6)
                backward_us.append((end - middle) * 1e6)
        finally:
            gc.enable()
        rounds.append((statistics.median(forward_us), statistics.median(backward_us),
                       statistics.median(f + b for f, b in zip(forward_us, backward_us))))
    launched = {key: counts[key] - before[key] for key in counts if counts[key] != before[key]}
    steps = repeat * calls
    # Every step must have reached the stand-in kernels (no fallback to the reference backend).
    if sum(v for k, v in launched.items() if k.endswith("fwd")) != steps or \
            sum(v for k, v in launched.items() if k.endswith("bwd")) != steps:
        raise RuntimeError(f"{name}: expected {steps} compiled forward and backward calls, got {launched}")
    # The least disturbed round: on a shared machine other processes only ever add time.
    forward, backward, step = (min(column) for column in zip(*rounds))
    return {"description": SHAPES[name], "forward_us": forward, "backward_us": backward, "step_us": step,
            "rounds": [dict(zip(("forward_us", "backward_us", "step_us"), r)) for r in rounds],
            "entry_points": sorted(launched), "steps": steps}


def profile_shape(name: str, calls: int, lines: int = 30) -> str:
    """cProfile of `calls` steps: the functions with the most own time, in microseconds per step
    (cProfile's own overhead inflates every Python call; read it for where, not how much)."""
    call, inputs = make_call(name)
    dout = torch.randn_like(call())
    for _ in range(20):
        torch.autograd.grad(call(), inputs, dout)
    return profile_table(lambda: torch.autograd.grad(call(), inputs, dout), calls, lines, name, "step")


def profile_table(run, calls: int, lines: int, name: str, unit: str) -> str:
    """cProfile of `calls` runs of run(): the `lines` functions with the most own time, in
    microseconds per `unit`."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        run()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:lines]
    text = [f"cProfile of {calls} {unit}s of {name}, by own time (us per {unit})",
            f"{'calls/' + unit:>10} {'own us':>8} {'cum us':>8}  function"]
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{os.path.basename(path)}:{line}({func})" if line else func
        text.append(f"{ncalls / calls:10.1f} {tottime / calls * 1e6:8.2f} {cumtime / calls * 1e6:8.2f}  {where}")
    return "\n".join(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="rounds (medians are over all their steps)")
    parser.add_argument("--calls", type=int, default=200, help="forward+backward steps per round")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--profile", default=None, metavar="SHAPE", help="also print a cProfile of SHAPE")
    parser.add_argument("--portattn", default=ROOT, metavar="DIR", help="checkout whose portattn to time")
    args = parser.parse_args(argv)
    load(args.portattn)
    torch.set_num_threads(1)  # nothing here computes; keep intra-op threads from adding noise
    heap_only = keep_allocations_on_the_heap()
    counts: dict = {}
    install(counts)
    result = {"tool": "bench/tools/host_overhead_cpu.py", "portattn": os.path.dirname(os.path.dirname(portattn.__file__)), "python": platform.python_version(), "torch": torch.__version__,
              "machine": platform.machine(), "allocations_on_heap": heap_only, "repeat": args.repeat, "calls": args.calls, "shapes": {}}
    lines = ["| shape | backend (fwd/bwd entry) | forward us | backward us | step us |", "|---|---|---|---|---|"]
    for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        row = time_shape(name, args.repeat, args.calls, counts)
        result["shapes"][name] = row
        lines.append(f"| {name} | {'/'.join(row['entry_points'])} | {row['forward_us']:.1f} | "
                     f"{row['backward_us']:.1f} | {row['step_us']:.1f} |")
    print("\n".join(lines))
    if args.profile:
        print(profile_shape(args.profile, args.calls))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
