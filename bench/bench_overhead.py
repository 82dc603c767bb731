"""Host overhead per call: portattn vs SDPA (no backend forced), and what the self-check costs.

Each mode runs in its own process, so the first call is really the first:
  PORTATTN_SELFCHECK=0      no self-check at all (the baseline)
  PORTATTN_SELFCHECK=force  the self-check runs at the first call of the process
The warm per-call times of the two must match: dispatch caches its decision, so
after the first call a self-checked backend costs nothing extra. Wall time per
call with no sync inside the loop (the host is the bottleneck at these sizes).
Writes overhead.{json,md} under --out (default bench/results/latest) through peers.write_results.
"""
import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = [(2, 16, 50), (2, 16, 150), (2, 16, 300), (2, 64, 50), (2, 64, 150), (2, 64, 300),
          (512, 16, 50), (512, 16, 150), (512, 16, 300), (512, 64, 50), (512, 64, 150), (512, 64, 300)]


def _child(calls: int) -> dict:
    import torch
    import torch.nn.functional as F

    import portattn
    from bench_attention import _wall_us

    def wall_us(fn):
        return _wall_us(fn, calls)

    q, k, v = (torch.randn(2, 150, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()
    start = time.perf_counter()
    portattn.flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    rows = []
    for batch, head_dim, seqlen in SHAPES:
        q, k, v = (torch.randn(batch, seqlen, 16, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        rows.append({"batch": batch, "heads": 16, "head_dim": head_dim, "seqlen": seqlen,
                     "portattn_us": wall_us(lambda: portattn.flash_attn_func(q, k, v)),
                     "portattn_causal_us": wall_us(lambda: portattn.flash_attn_func(q, k, v, causal=True)),
                     "sdpa_us": wall_us(lambda: F.scaled_dot_product_attention(qt, kt, vt)),
                     "sdpa_causal_us": wall_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))})
    return {"first_call_ms": first_ms, "rows": rows, "backend": portattn.explain(q, k, v).chosen,
            "decode": _decode_rows(calls)}


def _decode_rows(calls: int) -> list:
    """Host time of one generation step's attention call per layer: batch 1, one query, 16
    heads x 128, 8192 keys, no gradients; the three portattn entry points that serve it and
    SDPA (cuDNN on an H100 for these shapes). Least-disturbed of three loops. `growing` gives
    each call one more key than the last, as a DynamicCache does."""
    import torch
    import torch.nn.functional as F

    import portattn

    def best_us(fn, n):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - start) / n * 1e6)
            torch.cuda.synchronize()
        return min(times)

    rows = []
    with torch.no_grad():
        for heads_k in (16, 4):
            q = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, 8192, heads_k, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            lens = torch.full((1,), 8192, dtype=torch.int32, device="cuda")
            cu_q = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
            cu_k = torch.tensor([0, 8192], dtype=torch.int32, device="cuda")
            gqa = heads_k != 16
            q0, k0, v0 = q[0], k[0], v[0]  # views made once: the loop times the call alone
            rows.append({"heads_k": heads_k, "keys": "8192",
                         "flash_attn_func": best_us(lambda: portattn.flash_attn_func(q, k, v, causal=True), calls),
                         "flash_attn_varlen_func": best_us(lambda: portattn.flash_attn_varlen_func(
                             q0, k0, v0, cu_q, cu_k, 1, 8192, causal=True), calls),
                         "flash_attn_with_kvcache": best_us(lambda: portattn.flash_attn_with_kvcache(
                             q, k, v, cache_seqlens=lens, causal=True), calls),
                         "sdpa": best_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa), calls)})
        # Every call of the warm-up and the three loops sees a key count not seen before (cuDNN
        # builds a plan per new count; portattn's split planner buckets counts, decode.key_bucket).
        count = 50 + 3 * 150
        keys = [torch.randn(1, 4096 + i, 4, 128, device="cuda", dtype=torch.bfloat16) for i in range(count)]
        keys_t = [x.transpose(1, 2) for x in keys]
        ours_step, sdpa_step = iter(range(count)), iter(range(count))
        ours = best_us(lambda: (lambda i: portattn.flash_attn_func(q, keys[i], keys[i], causal=True))(
            next(ours_step)), 150)
        theirs = best_us(lambda: (lambda i: F.scaled_dot_product_attention(
            qt, keys_t[i], keys_t[i], enable_gqa=True))(next(sdpa_step)), 150)
        rows.append({"heads_k": 4, "keys": "4096-4595, one more each call", "flash_attn_func": ours,
                     "flash_attn_varlen_func": None, "flash_attn_with_kvcache": None, "sdpa": theirs})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "latest"))
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.calls)))
        return
    import peers

    modes = {}
    for mode in ("0", "force"):
        env = dict(os.environ, PORTATTN_SELFCHECK=mode)
        done = subprocess.run([sys.executable, __file__, "--child", "--calls", str(args.calls)], env=env,
                              capture_output=True, text=True, check=True)
        modes[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    off, on = modes["0"], modes["force"]
    result = dict(peers.header(dry_run=False), title="Host overhead per call (us, wall time, no sync in the loop, bf16, 16 heads)",
                  note=f"backend: {off['backend']}", modes=modes)
    lines = [f"First call of a process: {off['first_call_ms']:.1f} ms without the self-check, "
             f"{on['first_call_ms']:.1f} ms with it (PORTATTN_SELFCHECK=force).", "",
             "| batch | hd | seqlen | portattn | portattn (self-checked) | SDPA | ratio | causal: portattn | causal: SDPA | causal ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for a, b in zip(off["rows"], on["rows"]):
        lines.append(f"| {a['batch']} | {a['head_dim']} | {a['seqlen']} | {a['portattn_us']:.1f} | {b['portattn_us']:.1f} | "
                     f"{a['sdpa_us']:.1f} | {a['portattn_us'] / a['sdpa_us']:.2f} | {a['portattn_causal_us']:.1f} | "
                     f"{a['sdpa_causal_us']:.1f} | {a['portattn_causal_us'] / a['sdpa_causal_us']:.2f} |")
    lines += ["", "## A decode step's call (batch 1, 1 query, 16 heads x 128, no gradients)", "",
              "Least-disturbed of three loops. The key counts of `growing` change by one each call, as a "
              "DynamicCache's do during generate().", "",
              "| KV heads | keys | flash_attn_func | flash_attn_varlen_func | flash_attn_with_kvcache | SDPA | "
              "flash_attn_func / SDPA |", "|---|---|---|---|---|---|---|"]
    for row in off["decode"]:
        cells = [f"{row[name]:.1f}" if row[name] is not None else "-"
                 for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "sdpa")]
        lines.append(f"| {row['heads_k']} | {row['keys']} | " + " | ".join(cells) +
                     f" | {row['flash_attn_func'] / row['sdpa']:.2g} |")
    print(open(peers.write_results(result, args.out, "overhead", lines)).read())


if __name__ == "__main__":
    main()
