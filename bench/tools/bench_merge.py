"""One ring step's merge on one GPU: ring-flash-attn's update_out_and_lse against
portattn.merge_attention_states, at the per-rank shapes of bench_context_parallel.py.

    python bench/tools/bench_merge.py [--tokens 32768,65536,131072] [--reps 20] [--out DIR]

--tokens are per-rank token counts (131072 tokens on 4 GPUs: 32768). For each, the full
merge (fp32 out (1, T, 16, 128), bf16 block) and zigzag's sliced one (the later T/2 tokens,
through ring-flash-attn's slice_ path, write-back included), after warm-up (TorchScript
specialises ring-flash-attn's function in its first calls). Reports ms and the bandwidth
of the bytes a one-pass merge must move (fp32 out read and written, bf16 block read, the
LSEs): the fused kernel's floor. Writes <out>/merge_bench.{json,md} via peers.write_results.
`--dry-run` runs tiny shapes on the CPU for the plumbing.
"""
import argparse
import os
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

import peers  # noqa: E402
import portattn  # noqa: E402
from portattn.compat import import_ring_flash_attn  # noqa: E402

HEADS, HEAD_DIM = 16, 128


def _time_ms(fn, reps, cuda):
    return peers.median_ms(fn, reps, cuda, warmup=5)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="32768,65536,131072")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=os.path.join(BENCH, "results", "latest"))
    args = parser.parse_args(argv)
    cuda = not args.dry_run
    device = "cuda" if cuda else "cpu"
    heads, dim = (HEADS, HEAD_DIM) if cuda else (2, 32)
    import_ring_flash_attn(merge="ring")
    from ring_flash_attn.utils import update_out_and_lse

    rows = []
    for tokens in peers.parse_ints("64,128" if args.dry_run and args.tokens == parser.get_default("tokens")
                                   else args.tokens):
        out = torch.randn(1, tokens, heads, dim, device=device)
        lse = torch.randn(1, heads, tokens, device=device).transpose(-2, -1).unsqueeze(-1)  # ring's accumulator view
        row = {"tokens": tokens}
        for sliced in (False, True):
            length = tokens // 2 if sliced else tokens
            block_out = torch.randn(1, length, heads, dim, device=device).to(torch.bfloat16)
            block_lse = torch.randn(1, heads, length, device=device)
            slice_ = (slice(None), slice(tokens // 2, None)) if sliced else None
            key = "half" if sliced else "full"

            def ring_merge():
                update_out_and_lse(out, lse, block_out, block_lse, slice_=slice_)

            def portattn_merge():
                if sliced:
                    portattn.merge_attention_states(out[slice_], lse[slice_], block_out, block_lse)
                else:
                    portattn.merge_attention_states(out, lse, block_out, block_lse)

            # Bytes a one-pass merge moves: out read + written (fp32), block read (bf16), both LSEs.
            moved = length * heads * (dim * (4 + 4 + 2) + 4 * 3)
            row[f"{key}_bytes"] = moved
            for name, fn in (("ring", ring_merge), ("portattn", portattn_merge)):
                ms = _time_ms(fn, args.reps, cuda)
                row[f"{key}_{name}_ms"] = ms
                row[f"{key}_{name}_gbps"] = moved / ms / 1e6
        rows.append(row)
        print(row, flush=True)
    result = dict(peers.header(args.dry_run), title="One ring step's merge: ring-flash-attn vs portattn",
                  note=f"fp32 accumulator (1, tokens, {heads}, {dim}), bf16 block; GB/s of the one-pass bytes",
                  rows=rows, modes=[], impls=[], grid=[])
    lines = ["| tokens per rank | merge | ring-flash-attn ms (GB/s) | portattn ms (GB/s) | saved ms |",
             "|---|---|---|---|---|"]
    for r in rows:
        for key, label in (("full", "all tokens"), ("half", "zigzag's later half")):
            lines.append(f"| {r['tokens']} | {label} | {r[f'{key}_ring_ms']:.3f} ({r[f'{key}_ring_gbps']:.0f}) | "
                         f"{r[f'{key}_portattn_ms']:.3f} ({r[f'{key}_portattn_gbps']:.0f}) | "
                         f"{r[f'{key}_ring_ms'] - r[f'{key}_portattn_ms']:.3f} |")
    peers.write_results(result, args.out, "merge_bench", extra_markdown=lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
