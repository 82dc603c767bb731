"""How evenly the Hopper forward's persistent walk spreads a launch's tiles over the CTAs.

A model, not a measurement: each tile costs its key blocks plus `--overhead` (its prologue and
epilogue in key-block units), and a CTA's time is the sum over the tiles it walks. It mirrors the
kernel's index arithmetic (hopper_fwd_kernel.cuh: decode_tile, tile_of_cta) for the two orders of a
masked persistent launch, the group order and the paired one (Note [portattn hopper paired tiles]),
and prints, per point of the issue's grid (16k tokens, hidden 2048), the slowest CTA's time over the
mean (1.00 is a perfect spread) next to a greedy dynamic hand-out (each tile to the CTA that frees up
first, what an atomic tile counter would give).

    python bench/tools/tile_balance.py [--sms 132] [--overhead 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import heapq
import json


def causal_blocks(m_block, block_m, block_n, seqlen):
    last_row = min((m_block + 1) * block_m, seqlen) - 1
    return min((seqlen + block_n - 1) // block_n, last_row // block_n + 1)


def group_order(t, num_m_blocks, heads_batches, group_heads):
    per_group = group_heads * num_m_blocks
    group, index = divmod(t, per_group)
    group_size = min(group_heads, heads_batches - group * group_heads)
    return group * group_heads + index % group_size, num_m_blocks - 1 - index // group_size


def paired_order(t, num_m_blocks):
    hb, i = divmod(t, num_m_blocks)
    listed = num_m_blocks - 1 - i if hb & 1 else i
    return hb, listed // 2 if listed & 1 else num_m_blocks - 1 - listed // 2


def cta_loads(order, num_tiles, ctas, cost_of):
    loads = [0.0] * ctas
    for cta in range(ctas):
        round_ = 0
        while True:
            if order == "paired":
                if 2 * (round_ >> 1) * ctas >= num_tiles:
                    break
                t = 2 * ((round_ >> 1) * ctas + cta) + (round_ & 1)
            else:
                if round_ * ctas >= num_tiles:
                    break
                t = round_ * ctas + (ctas - 1 - cta if round_ & 1 else cta)
            if t < num_tiles:
                loads[cta] += cost_of(t)
            round_ += 1
    return loads


def balance(seqlen, head_dim, *, sms, overhead, tokens=16384, hidden=2048, block_m=128, block_n=128):
    batch, heads = tokens // seqlen, hidden // head_dim
    num_m_blocks = (seqlen + block_m - 1) // block_m
    heads_batches = batch * heads
    num_tiles = num_m_blocks * heads_batches
    group_heads = max(1, min(heads_batches, (24 << 20) // (4 * seqlen * head_dim)))  # the launch's rule
    ctas = min(sms, num_tiles)

    def cost(m_block):
        return causal_blocks(m_block, block_m, block_n, seqlen) + overhead

    group_costs = [cost(group_order(t, num_m_blocks, heads_batches, group_heads)[1]) for t in range(num_tiles)]
    paired_costs = [cost(paired_order(t, num_m_blocks)[1]) for t in range(num_tiles)]
    # Every tile once in the paired order (the index arithmetic is a permutation).
    seen = sorted(paired_order(t, num_m_blocks) for t in range(num_tiles))
    assert seen == [(hb, m) for hb in range(heads_batches) for m in range(num_m_blocks)]
    mean = sum(group_costs) / ctas
    group = max(cta_loads("group", num_tiles, ctas, group_costs.__getitem__)) / mean
    paired = max(cta_loads("paired", num_tiles, ctas, paired_costs.__getitem__)) / mean
    free = [0.0] * ctas
    for c in sorted(group_costs, reverse=True):
        heapq.heappush(free, heapq.heappop(free) + c)
    return dict(head_dim=head_dim, seqlen=seqlen, tiles=num_tiles, ctas=ctas, group=group, paired=paired,
                dynamic=max(free) / mean)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--overhead", type=float, default=1.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [balance(s, hd, sms=args.sms, overhead=args.overhead)
            for hd in (64, 128) for s in (512, 1024, 2048, 4096, 8192, 16384)]
    print(f"causal, 128-row tiles, 128-key blocks, {args.sms} CTAs, overhead {args.overhead} blocks a tile;")
    print("slowest CTA / mean (1.00 = even)\n")
    print("| hd | seqlen | tiles | group order | paired | dynamic (greedy) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['head_dim']} | {r['seqlen']} | {r['tiles']} | {r['group']:.3f} | {r['paired']:.3f} |"
              f" {r['dynamic']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
