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
    return {"first_call_ms": first_ms, "rows": rows, "backend": portattn.explain(q, k, v).chosen}


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
    print(open(peers.write_results(result, args.out, "overhead", lines)).read())


if __name__ == "__main__":
    main()
