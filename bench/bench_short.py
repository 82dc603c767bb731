"""Many short sequences (issue #11): batch 512, seqlen 50-300, head dims 16 and 64, 16 heads, bf16.

  python bench/bench_short.py [--seqlens 50,100,200,300] [--head-dims 16,64] [--out DIR] [--dry-run]

The shape of fine-tuning and classification workloads (BERT-sized sequences, large batches),
where launch shape and tile waste matter more than the main loop. Columns as in
bench_attention.py (bench/peers.py): portattn through the public API, the sm80+ path forced,
SDPA flash and cuDNN; forward and forward+backward. The question is time, not FLOP/s: the
table's TFLOP/s use the usual 4*B*H*S*S*D convention (halved for causal), so the ratio columns
are time ratios. A kernel-time breakdown (torch.profiler) of the largest point per head dim
says whether a gap is GPU time or host time. Results: <out>/short_seq.{json,md,png}.
"""
from __future__ import annotations

import argparse

import peers
from peers import SHORT_BATCH as BATCH, SHORT_HEADS as HEADS, ShortPoint


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="50,100,200,300")
    parser.add_argument("--head-dims", default="16,64")
    parser.add_argument("--impls", default="portattn,portattn_sm80,sdpa_flash,sdpa_cudnn")
    parser.add_argument("--out", default=peers.LATEST)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    peers.require_device(args.dry_run)
    impls = peers.select(args.impls)
    points = [ShortPoint(hd, s, c) for hd in peers.parse_ints(args.head_dims)
              for s in peers.parse_ints(args.seqlens) for c in (False, True)]
    timer = peers.Timer(dry_run=args.dry_run)
    rows = peers.run_grid(points, impls, list(peers.MODES), timer)
    result = dict(peers.header(args.dry_run), title="Many short sequences: portattn and SDPA",
                  note=f"batch {BATCH}, {HEADS} heads, bf16 (not the FA2 grid's 16k tokens: the grid headers' "
                       "token count does not apply). portattn / peer columns are time ratios (peer time / ours).",
                  impls=[impl.name for impl in impls], modes=list(peers.MODES), grid=rows)
    extra = []
    if not args.dry_run:
        for hd in peers.parse_ints(args.head_dims):
            extra += peers.kernel_breakdown(ShortPoint(hd, max(peers.parse_ints(args.seqlens)), True), impls)
    path = peers.write_results(result, args.out, "short_seq", extra)
    print(peers.compact_table(result))
    print("\n".join(extra))
    print("wrote", path)


if __name__ == "__main__":
    main()
