#!/usr/bin/env python3
"""Per-warp timeline of the Hopper backward's steps (Note [portattn hopper backward timeline]).

Needs a library whose hd128 bf16 backward translation unit was built with
-DPORTATTN_HOPPER_BWD_TIMELINE=1 (it exports portattn_cuda_hopper_bwd_timeline); the
default build has no stamps and this script says so. It runs one forward+backward through
the public API (hd128, bf16, no mask unless --causal), copies out the SM cycle counter that
lane 0 of every warp wrote at each landmark of each step, for 4 CTAs in the middle of the
launch, and prints per landmark the median cycles since the previous one, per consumer
warpgroup, with the other warpgroup's offset; --out writes the raw stamps as JSON.

Consumer landmarks (events): 0 step top, 2 S^T and dP^T issued, 3 S^T retired, 4 P^T
computed, 5 dV issued, 6 dP^T retired, 7 dS^T computed, 8 dS^T stored, 9 past the dS^T
barrier, 10 dQ and dK issued, 11 dQ retired, 12 dQ staged (its buffer's wait included),
13 every product retired. The reducing warp (warp 2): 0 before the full barrier, 1 past it,
2 the copy has read the buffer. The producer's warps 0 and 1: 0 before the empty wait, 1 past it.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics

import torch

CTAS, WARPS, STEPS, EVENTS = 4, 12, 64, 16
CONSUMER_EVENTS = [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
NAMES = {0: "top", 2: "S,dP issued", 3: "S retired", 4: "P computed", 5: "dV issued", 6: "dP retired",
         7: "dS computed", 8: "dS stored", 9: "dS barrier", 10: "dQ,dK issued", 11: "dQ retired",
         12: "dQ staged", 13: "all retired"}


def fetch_stamps():
    import portattn.backends.cuda as cuda_backend
    lib = ctypes.CDLL(os.path.join(os.path.dirname(cuda_backend.__file__), "libportattn_cuda.so"))
    try:
        fetch = lib.portattn_cuda_hopper_bwd_timeline
    except AttributeError:
        raise SystemExit("this library has no timeline: build the hd128 bf16 backward TU with "
                         "-DPORTATTN_HOPPER_BWD_TIMELINE=1")
    fetch.restype = ctypes.c_int
    fetch.argtypes = [ctypes.c_void_p, ctypes.c_longlong]
    count = fetch(None, 0)
    assert count == CTAS * WARPS * STEPS * EVENTS, count
    buffer = (ctypes.c_ulonglong * count)()
    assert fetch(ctypes.cast(buffer, ctypes.c_void_p), count) == 0
    flat = list(buffer)
    return [[[flat[((c * WARPS + w) * STEPS + s) * EVENTS:((c * WARPS + w) * STEPS + s + 1) * EVENTS]
              for s in range(STEPS)] for w in range(WARPS)] for c in range(CTAS)]


def run(seqlen, tokens, causal):
    import portattn
    torch.manual_seed(0)
    batch, heads, hd = tokens // seqlen, 16, 128
    q, k, v = (torch.randn(batch, seqlen, heads, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(batch, seqlen, heads, hd, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # the last run's stamps stay
        out = portattn.flash_attn_func(q, k, v, causal=causal)
        out.backward(dout)
    torch.cuda.synchronize()


def summarize(stamps, steps):
    lines = []
    for cta in range(CTAS):
        rows = {}
        for wg, warp in ((0, 4), (1, 8)):
            per_event = {e: [] for e in CONSUMER_EVENTS}
            periods = []
            for s in range(2, steps - 2):
                t = stamps[cta][warp][s]
                if t[0] == 0 or t[13] == 0:
                    continue
                previous = t[0]
                for e in CONSUMER_EVENTS[1:]:
                    if t[e]:
                        per_event[e].append(t[e] - previous)
                        previous = t[e]
                nxt = stamps[cta][warp][s + 1][0]
                if nxt:
                    periods.append(nxt - t[0])
            rows[wg] = (per_event, periods)
        skew = [stamps[cta][8][s][0] - stamps[cta][4][s][0] for s in range(2, steps - 2)
                if stamps[cta][8][s][0] and stamps[cta][4][s][0]]
        lines.append(f"CTA {cta}: step period (cycles, median) wg0 {statistics.median(rows[0][1]):.0f}, "
                     f"wg1 {statistics.median(rows[1][1]):.0f}; wg1's step top minus wg0's: median "
                     f"{statistics.median(skew):.0f}, range {min(skew)}..{max(skew)}")
        for e in CONSUMER_EVENTS[1:]:
            values = [f"{statistics.median(rows[wg][0][e]):7.0f}" if rows[wg][0][e] else "      -" for wg in (0, 1)]
            lines.append(f"  {NAMES[e]:14s} +{values[0]}  +{values[1]}")
        reduce_wait = [stamps[cta][2][s][1] - stamps[cta][2][s][0] for s in range(2, steps - 2) if stamps[cta][2][s][1]]
        reduce_read = [stamps[cta][2][s][2] - stamps[cta][2][s][1] for s in range(2, steps - 2) if stamps[cta][2][s][2]]
        producer = [stamps[cta][0][s][1] - stamps[cta][0][s][0] for s in range(2, steps - 2) if stamps[cta][0][s][1]]
        if reduce_read:
            lines.append(f"  reducing warp: waits for full {statistics.median(reduce_wait):.0f}, copy reads the buffer in "
                         f"{statistics.median(reduce_read):.0f}; producer's empty wait {statistics.median(producer):.0f}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--out", default=None, help="JSON file for the raw stamps")
    args = parser.parse_args()
    if args.seqlen < 512 or args.tokens % args.seqlen:
        parser.error("--seqlen must be at least 512 (the medians skip each CTA's first and last two steps) "
                     "and divide --tokens")
    run(args.seqlen, args.tokens, args.causal)
    stamps = fetch_stamps()
    steps = min(STEPS, args.seqlen // 64)
    header = (f"Hopper backward timeline, hd128 bf16, seqlen {args.seqlen}, {args.tokens} tokens, "
              f"{'causal' if args.causal else 'no mask'}, {torch.cuda.get_device_name()}; cycles since the previous "
              f"landmark, median over steps 2..{steps - 3} (wg0 / wg1)")
    lines = [header] + summarize(stamps, steps)
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"header": header, "stamps": stamps, "summary": lines}, f)


if __name__ == "__main__":
    main()
