"""Host time of one decode-step attention call: portattn's GPU path timed on a CPU, or real calls on a GPU.

  python bench/tools/host_decode.py [--repeat 7] [--calls 400] [--paths a,b,...] [--batch 8]
                                    [--keys 1024] [--device cpu|cuda] [--out FILE.json] [--profile PATH]

Why: an eager generate() step calls attention once per layer with one query row, and at small batches
the GPU work is shorter than the host's time to issue the call, so the Python between transformers'
call and the kernel launch decides the step (docs/host-overhead.md, "A decode step's call").

--device cpu (the default) runs that Python -- the transformers integration (`attention_forward`),
api.py, validation, ops.py, dispatch, decode.run_decode, backends/compiled.py and abi.decode_args --
with the compiled module replaced by bench/tools/host_overhead_cpu.py's stand-in (no-op functions
with the real argument lists; `decode`'s comes from common/binding_args.h), the dispatcher deciding
as for an H100, and the host-side value checks that only CPU tensors get switched off
(validation.HOST_CHECKED_DEVICE_TYPE). It fails if a call reaches anything other than the stand-in's
`decode` entry. So what it times is what host-side Python changes can change, on any machine. Not
timed there: the integration's once-per-device error-buffer test (`query.is_cuda`, false on a CPU),
the CUDA caching allocator (CPU malloc instead), pybind11's argument conversion and the launch.

--device cuda times the same calls for real (the kernels run; nothing is stubbed), wall time per
call with no synchronisation inside a round: at these shapes the GPU finishes each call before the
host has issued the next, so the time is the host's. SDPA's rows then run at the full shapes.

Paths (GQA 16/4 heads, hd128, bf16, no gradients, as in generate(); the cache holds --keys keys):
- hf_decode: transformers' call of `attention_forward` in a DynamicCache decode step: (batch, heads,
  1, hd) query and (batch, kv_heads, keys, hd) key/value views, no mask (an unpadded batch), the
  kwargs generate() passes (position_ids, use_cache);
- hf_decode_leftpad: the same with a left-padded batch: padding_mask's key bounds as the mask, which
  goes to flash_attn_with_kvcache;
- kvcache: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=<int32 tensor>);
- func: flash_attn_func(q, k, v, causal=True) with one query row (decode-shaped);
- varlen: flash_attn_varlen_func with one query row per sequence and packed keys;
- sdpa_hf: transformers' own sdpa_attention_forward on the hf_decode inputs, kernel included (on a
  CPU cut to batch 1 and SDPA_KEYS keys: the CPU kernel at the full shapes takes ~50 ms, and the
  wrapper's Python does not depend on the shapes);
- sdpa_call: torch.nn.functional.scaled_dot_product_attention alone on sdpa_hf's tensors
  (enable_gqa): sdpa_hf minus sdpa_call is transformers' wrapper;
- sdpa_tiny: scaled_dot_product_attention with batch 1, 1 head, 1 key, hd 8: the least an SDPA
  call costs on this host.

Noise control as in host_overhead_cpu.py: one intra-op thread, gc off inside a round, each path's
least-disturbed round median reported; the paths alternate round by round.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_overhead_cpu as base  # noqa: E402

ROOT = base.ROOT
PATHS = ("hf_decode", "hf_decode_leftpad", "kvcache", "func", "varlen", "sdpa_hf", "sdpa_call", "sdpa_tiny")
PORTATTN_PATHS = PATHS[:5]
HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
SDPA_KEYS = 16


def _macro_names(header: str, macro: str) -> tuple:
    """The names a *_ARG_NAMES macro of binding_args.h expands to (nested groups expanded)."""
    text = open(header).read().replace("\\\n", " ")
    body = re.search(rf"#define {macro}\s+(.*)", text).group(1)
    names = []
    for name in (n.strip() for n in body.split(",")):
        names.extend(_macro_names(header, name) if name.startswith("PORTATTN_") else [name])
    return tuple(names)


def install(counts: dict, root: str = ROOT, patch=setattr) -> None:
    """host_overhead_cpu's stand-in dispatcher plus the decode entry points, with the host-side
    value checks of CPU tensors switched off. `patch(obj, name, value)` makes each change (a
    test passes pytest's monkeypatch.setattr, which undoes them)."""
    from portattn import decode, dispatch, kvcache, ops, validation

    for obj, name in ((dispatch, "DISPATCHER"), (base.abi, "raw_stream"), (base.compiled, "_current_device")):
        patch(obj, name, getattr(obj, name))  # base.install assigns these: let `patch` undo them
    base.install(counts)
    module = base._STANDIN[-1]
    header = os.path.join(root, "portattn", "backends", "common", "binding_args.h")
    counts["decode"] = counts["kvcache_append"] = 0
    module.decode = base._no_op("decode", _macro_names(header, "PORTATTN_DECODE_ARG_NAMES"), counts)
    module.kvcache_append = base._no_op("kvcache_append", _macro_names(header, "PORTATTN_APPEND_ARG_NAMES"), counts)
    # The sm90 decode tile of hd128 (stage_keys, threads, smem) and an H100's 132 SMs.
    module.decode_tile = lambda head_dim, fp8=0: {"stage_keys": 64, "threads": 128, "smem_bytes": 49152}
    for mod in (validation, ops, kvcache):
        if hasattr(mod, "HOST_CHECKED_DEVICE_TYPE"):
            patch(mod, "HOST_CHECKED_DEVICE_TYPE", None)
    for mod in (decode, ops):  # checkouts whose run_forward tested the device type (3c204df)
        if hasattr(mod, "KERNEL_DEVICE_TYPE"):
            patch(mod, "KERNEL_DEVICE_TYPE", "cpu")
    patch(decode, "_capturing", bool)  # bool() is False: not capturing, at a builtin's cost
    # The decode launch passes q.get_device(), -1 for a CPU tensor: "already current", at a
    # builtin's cost (host_overhead_cpu's stand-in, int(), answers 0 for the forward's None).
    patch(base.compiled, "_current_device", (-1).__index__)
    patch(decode, "resident_slots", lambda device, tile: (132, 264))
    patch(decode, "_PLANS", {})


class _Module(torch.nn.Module):
    """What transformers' attention functions read from the layer."""

    def __init__(self):
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = HEADS // KV_HEADS
        self.layer_idx = 0


def make_call(name: str, batch: int, keys: int, device: str = "cpu"):
    """call() runs one decode-step attention call of path `name`."""
    g = torch.Generator().manual_seed(0)
    dtype = base.DTYPE

    def randn(*shape):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    scale = HEAD_DIM ** -0.5
    # transformers' layout: q_proj(x).view(b, 1, h, d).transpose(1, 2); a DynamicCache's keys are
    # torch.cat results (batch, kv_heads, keys, d), contiguous.
    q_hf = randn(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
    k_hf, v_hf = randn(batch, KV_HEADS, keys, HEAD_DIM), randn(batch, KV_HEADS, keys, HEAD_DIM)
    position_ids = torch.full((batch, 1), keys - 1, dtype=torch.long, device=device)
    module = _Module()
    if name in ("hf_decode", "hf_decode_leftpad"):
        from portattn.integrations import transformers as pt_hf

        mask = None
        if name == "hf_decode_leftpad":
            user = torch.ones(batch, keys, dtype=torch.long, device=device)
            user[0, :7] = 0
            mask = pt_hf.padding_mask(batch, 1, keys, keys - 1, 0, attention_mask=user)
            assert mask is not None and mask.dtype == pt_hf.KEY_BOUNDS_DTYPE, mask
        attend = pt_hf.attention_forward
        return lambda: attend(module, q_hf, k_hf, v_hf, mask, dropout=0.0, scaling=scale,
                              position_ids=position_ids, use_cache=True)
    if name.startswith("sdpa") and device == "cpu":
        # The CPU kernel at the portattn paths' shapes takes ~50 ms; the wrappers' Python does
        # not depend on the shapes.
        q_hf, k_hf, v_hf = q_hf[:1], k_hf[:1, :, :SDPA_KEYS], v_hf[:1, :, :SDPA_KEYS]
        position_ids = position_ids[:1]
    if name == "sdpa_hf":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return lambda: sdpa_attention_forward(module, q_hf, k_hf, v_hf, None, dropout=0.0, scaling=scale,
                                              position_ids=position_ids, use_cache=True)
    if name == "sdpa_call":
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return lambda: sdpa(q_hf, k_hf, v_hf, attn_mask=None, dropout_p=0.0, scale=scale, is_causal=False,
                            enable_gqa=True)
    if name == "sdpa_tiny":
        sdpa = torch.nn.functional.scaled_dot_product_attention
        qt, kt, vt = randn(1, 1, 1, 8), randn(1, 1, 1, 8), randn(1, 1, 1, 8)
        return lambda: sdpa(qt, kt, vt, attn_mask=None, dropout_p=0.0, scale=scale, is_causal=False)
    import portattn

    q = randn(batch, 1, HEADS, HEAD_DIM)
    if name == "kvcache":
        k_cache, v_cache = randn(batch, keys, KV_HEADS, HEAD_DIM), randn(batch, keys, KV_HEADS, HEAD_DIM)
        lengths = torch.full((batch,), keys, dtype=torch.int32, device=device)
        fn = portattn.flash_attn_with_kvcache
        return lambda: fn(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    if name == "func":
        k, v = randn(batch, keys, KV_HEADS, HEAD_DIM), randn(batch, keys, KV_HEADS, HEAD_DIM)
        fn = portattn.flash_attn_func
        return lambda: fn(q, k, v, causal=True)
    if name == "varlen":
        k, v = randn(batch * keys, KV_HEADS, HEAD_DIM), randn(batch * keys, KV_HEADS, HEAD_DIM)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
        cu_k = cu_q * keys
        packed_q = q.view(batch, HEADS, HEAD_DIM)
        fn = portattn.flash_attn_varlen_func
        return lambda: fn(packed_q, k, v, cu_q, cu_k, 1, keys, causal=True)
    raise ValueError(f"unknown path {name!r}; choose from {', '.join(PATHS)}")


def time_paths(names, batch: int, keys: int, repeat: int, calls: int, counts: dict, device: str = "cpu") -> dict:
    fns = {name: make_call(name, batch, keys, device) for name in names}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rounds = {name: [] for name in names}
    launched = {}
    clock = time.perf_counter
    with torch.no_grad():  # generate() runs under no_grad
        for name, fn in fns.items():
            for _ in range(50):  # warm-up: dispatch's decisions, the split plan, allocator caches
                fn()
        for _ in range(repeat):
            for name, fn in fns.items():
                before = dict(counts)
                samples = []
                gc.collect()
                gc.disable()
                try:
                    sync()
                    for _ in range(calls):
                        begin = clock()
                        fn()
                        samples.append((clock() - begin) * 1e6)
                    sync()
                finally:
                    gc.enable()
                rounds[name].append(statistics.median(samples))
                step = {key: counts[key] - before[key] for key in counts if counts[key] != before[key]}
                launched.setdefault(name, step)
    for name in names:
        if device == "cpu" and name in PORTATTN_PATHS and launched[name] != {"decode": calls}:
            raise RuntimeError(f"{name}: expected {calls} calls of the stand-in decode entry, got {launched[name]}")
    return {name: {"us": min(rounds[name]), "rounds": rounds[name], "entry_points": sorted(launched[name])}
            for name in names}


def profile_path(name: str, batch: int, keys: int, calls: int, device: str = "cpu", lines: int = 30) -> str:
    """cProfile of `calls` calls of path `name`, by own time (cProfile inflates every Python call:
    read it for where the time goes, not how much)."""
    fn = make_call(name, batch, keys, device)
    with torch.no_grad():
        for _ in range(50):
            fn()
        return base.profile_table(fn, calls, lines, name, "call")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7, help="rounds (each path's best round median is shown)")
    parser.add_argument("--calls", type=int, default=400, help="calls per path per round")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--keys", type=int, default=1024)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: the GPU path's Python over the stand-in module; cuda: real calls")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--profile", default=None, metavar="PATH", help="also print a cProfile of PATH")
    parser.add_argument("--portattn", default=ROOT, metavar="DIR", help="checkout whose portattn to time")
    args = parser.parse_args(argv)
    base.load(args.portattn)
    globals()["ROOT"] = args.portattn
    torch.set_num_threads(1)
    heap_only = base.keep_allocations_on_the_heap()
    counts: dict = {}
    if args.device == "cpu":
        install(counts, args.portattn)
    else:
        import portattn.integrations.transformers as pt_hf

        pt_hf.register()
    names = [p.strip() for p in args.paths.split(",") if p.strip()]
    rows = time_paths(names, args.batch, args.keys, args.repeat, args.calls, counts, args.device)
    result = {"tool": "bench/tools/host_decode.py", "portattn": args.portattn,
              "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
              "allocations_on_heap": heap_only, "device": args.device, "batch": args.batch, "keys": args.keys, "heads": HEADS,
              "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "repeat": args.repeat, "calls": args.calls, "paths": rows}
    where = "the GPU path's Python on a CPU" if args.device == "cpu" else torch.cuda.get_device_name()
    lines = [f"host us per call ({where}), batch {args.batch}, {args.keys} keys, {HEADS}/{KV_HEADS} heads, hd{HEAD_DIM}",
             "| path | us per call | entry points |", "|---|---|---|"]
    lines += [f"| {name} | {row['us']:.2f} | {'/'.join(row['entry_points']) or '-'} |" for name, row in rows.items()]
    print("\n".join(lines))
    if args.profile:
        print(profile_path(args.profile, args.batch, args.keys, args.calls, args.device))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
