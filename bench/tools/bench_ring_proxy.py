"""What context parallelism costs per ring step, measured on one device (a proxy).

Ring attention over N ranks computes, on each rank, N partial attentions of its query
shard against the K/V shards passed around the ring, then merges them by their LSE; the
backward runs N low-level backward calls with the merged out/LSE. This script runs the
same calls in one process, on shifted K/V chunks of one sequence (no communication), and
compares them with one whole-sequence call of the same total work:

    whole:  flash_attn_func forward (+ backward) on (seqlen, seqlen), non-causal
    ring N: for each of N query chunks, N x _flash_attn_forward on (seqlen/N, seqlen/N)
            + the LSE merge, and N x _flash_attn_backward with the merged out/LSE

overhead per step = (ring time - whole time) / (N x N calls): the fixed cost a ring
step adds (launch, dispatch, the merge), which communication must hide. Non-causal keeps
the work of both sides equal. Writes <out>/ring_proxy.{json,md} (default bench/results/latest) through
peers.write_results, with device, date and commit. `--dry-run` runs tiny shapes on the CPU (any device works) for the plumbing.
"""
import argparse
import datetime
import os
import sys
import time

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]  # the checkout (portattn) and bench/ (peers.py)

import peers  # noqa: E402
import portattn  # noqa: E402
from portattn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, device, repeats):
    fn()  # warm-up (dispatch decision, allocator)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / repeats


def _merge(pieces):
    """LSE-weighted merge of [(out, lse)] partial results (what ring attention does)."""
    lse = torch.logsumexp(torch.stack([p[1] for p in pieces]), dim=0)
    out = sum(p[0].float() * torch.exp(p[1] - lse).transpose(1, 2)[..., None] for p in pieces)
    return out.to(pieces[0][0].dtype), lse


def ring_steps(q, k, v, dout, ranks, backward):
    """One rank-step at a time, every rank's query chunk in turn (all on this device)."""
    qs, ks, vs, douts = (t.chunk(ranks, dim=1) for t in (q, k, v, dout))
    for qi, doi in zip(qs, douts):
        pieces = [_flash_attn_forward(qi, kj, vj, 0.0, None, False, -1, -1, 0.0, None, False)[:2]
                  for kj, vj in zip(ks, vs)]
        out, lse = _merge(pieces)
        if backward:
            dq, dk, dv = torch.empty_like(qi), torch.empty_like(ks[0]), torch.empty_like(vs[0])
            for kj, vj in zip(ks, vs):
                _flash_attn_backward(doi, qi, kj, vj, out, lse, dq, dk, dv, 0.0, None, False, -1, -1,
                                     0.0, None, False)


def whole_call(q, k, v, dout, backward):
    if not backward:
        portattn.flash_attn_func(q, k, v)
        return
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    portattn.flash_attn_func(*leaves).backward(dout)


def measure(device, dtype, batch, seqlen, heads, head_dim, ranks_list, backward, repeats):
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, generator=gen).to(device, dtype) for _ in range(4))
    whole = _time_ms(lambda: whole_call(q, k, v, dout, backward), device, repeats)
    rows = []
    for ranks in ranks_list:
        if seqlen % ranks:
            continue
        ring = _time_ms(lambda: ring_steps(q, k, v, dout, ranks, backward), device, repeats)
        steps = ranks * ranks
        rows.append({"seqlen": seqlen, "ranks": ranks, "backward": backward, "whole_ms": whole,
                     "ring_ms": ring, "steps": steps, "overhead_per_step_us": (ring - whole) * 1e3 / steps,
                     "ratio": ring / whole})
    return rows


def write_results(result, out_dir):
    result = dict(result, title="Ring-attention proxy: per-step overhead on one device",
                  note=f"dtype {result['dtype']}; batch {result['batch']}, heads {result['heads']}, head dim "
                       f"{result['head_dim']}" + ("; DRY RUN (tiny CPU shapes)" if result["dry_run"] else ""))
    lines = ["| seqlen | ranks | pass | whole (ms) | ring (ms) | steps | overhead / step (us) | ring / whole |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['seqlen']} | {row['ranks']} | {'fwd+bwd' if row['backward'] else 'fwd'} | "
                     f"{row['whole_ms']:.3f} | {row['ring_ms']:.3f} | {row['steps']} | "
                     f"{row['overhead_per_step_us']:.1f} | {row['ratio']:.2f} |")
    peers.write_results(result, out_dir, "ring_proxy", lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (plumbing check)")
    parser.add_argument("--out", default=peers.LATEST)
    args = parser.parse_args(argv)
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.bfloat16
        seqlens, heads, head_dim, repeats = [64], 2, 16, 1
    else:
        if not torch.cuda.is_available():
            parser.error("needs a GPU (torch.cuda.is_available() is False); --dry-run runs on the CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16
        seqlens, heads, head_dim, repeats = [int(s) for s in args.seqlens.split(",")], args.heads, args.head_dim, args.repeats
    ranks = [int(r) for r in args.ranks.split(",")]
    rows = []
    for seqlen in seqlens:
        for backward in (False, True):
            rows += measure(device, dtype, args.batch, seqlen, heads, head_dim, ranks, backward, repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"device": name, "date": datetime.date.today().isoformat(), "commit": peers.commit(),
              "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""), "batch": args.batch,
              "heads": heads, "head_dim": head_dim, "dry_run": args.dry_run,
              "backends": portattn.selected_backends(), "rows": rows}
    write_results(result, args.out)
    for row in rows:
        print(f"seqlen {row['seqlen']} ranks {row['ranks']} {'fwd+bwd' if row['backward'] else 'fwd'}: "
              f"whole {row['whole_ms']:.3f} ms, ring {row['ring_ms']:.3f} ms, "
              f"{row['overhead_per_step_us']:.1f} us/step")
    print(f"results: {os.path.join(args.out, 'ring_proxy')}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
