"""Where a decode step's time goes: per-kernel device time (torch.profiler) of portattn's
flash_attn_with_kvcache and of SDPA at a few shapes, and the split count chosen.

  python bench/tools/profile_decode.py [--shapes 1x4096,1x8192,16x8192] [--paged 0|16|256]

Prints one line per kernel: name, calls, mean device us. Used to diagnose the gap to
the HBM bound (launch gaps, combine cost, the kernel itself); ncu (bench/tools/ncu_stage.sh
style) gives the stall reasons of the decode kernel itself.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import portattn
from portattn import decode


def kernel_table(fn, calls=20):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.count:
            rows.append((event.key[:90], event.count // calls, event.device_time_total / calls))
    return sorted(rows, key=lambda r: -r[2])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x4096,1x8192,1x32768,16x8192")
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--paged", type=int, default=0)
    args = parser.parse_args(argv)
    hq, hk = (int(x) for x in args.heads.split("/"))
    d = args.head_dim
    for shape in args.shapes.split(","):
        batch, cache = (int(x) for x in shape.split("x"))
        q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, cache, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        seqlens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
        table = None
        if args.paged:
            pages = batch * cache // args.paged
            table = torch.randperm(pages, device="cuda").reshape(batch, -1).to(torch.int32)
            k, v = k.view(pages, args.paged, hk, d), v.view(pages, args.paged, hk, d)
        ours = lambda: portattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table)
        ours()
        splits = [value for key, value in decode._PLANS.items() if key[2] == batch and key[6] == cache]
        qt = q.transpose(1, 2).contiguous()
        kt, vt = (x.reshape(batch, cache, hk, d).transpose(1, 2).contiguous() for x in (k, v))
        sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hq != hk)
        bound = 2 * batch * cache * hk * d * 2 / 3.35e12 * 1e6
        print(f"== batch {batch} cache {cache} heads {hq}/{hk} hd {d} paged {args.paged}: bound {bound:.1f} us, "
              f"splits {splits}")
        for label, fn in (("portattn", ours), ("sdpa", sdpa)):
            for name, count, us in kernel_table(fn):
                print(f"  {label:8s} {us:8.1f} us  x{count}  {name}")
        del q, k, v, kt, vt, qt
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
