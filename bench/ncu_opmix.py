"""Two kernels' instruction mix side by side, per unit of work, from Nsight Compute's source pages.

  ncu --import REP.ncu-rep --page source --csv --print-source sass | gzip > SRC.csv.gz   (each kernel)
  python bench/ncu_opmix.py A_SRC.csv[.gz] B_SRC.csv[.gz] UNITS [--names A,B] [--top N]

Sums the executed warp instructions of each opcode (its first mnemonic, predicate and modifiers
dropped) and divides them by UNITS, e.g. the executions of an instruction both kernels run once per
consumer warp and step, so the table reads "instructions a warp issues per step". Prints a markdown
table of the TOP opcodes (default 30) with the larger total first, and the difference. Session 19
compared flash-attn-4's hd128 backward with our 80-query kernel at the same tile this way
(docs/hopper_notes.md).
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re


def opcode_counts(path: str) -> collections.Counter:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as handle:
        rows = list(csv.reader(handle))
    header = next(i for i, row in enumerate(rows) if "Source" in row and "Instructions Executed" in row)
    source, executed = rows[header].index("Source"), rows[header].index("Instructions Executed")
    counts = collections.Counter()
    for row in rows[header + 1:]:
        if len(row) <= executed:
            continue
        try:
            times = float(row[executed].replace(",", ""))
        except ValueError:
            continue
        text = re.sub(r"^@!?U?P\w+\s+", "", row[source].strip())
        counts[text.split(" ")[0].split(".")[0]] += times
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("units", type=float)
    parser.add_argument("--names", default="A,B")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    name_a, name_b = args.names.split(",")
    a, b = opcode_counts(args.a), opcode_counts(args.b)
    print(f"| opcode | {name_a} | {name_b} | {name_b} - {name_a} |")
    print("|---|---|---|---|")
    print(f"| (all) | {sum(a.values()) / args.units:.1f} | {sum(b.values()) / args.units:.1f} | "
          f"{(sum(b.values()) - sum(a.values())) / args.units:+.1f} |")
    for op in sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))[:args.top]:
        print(f"| {op} | {a[op] / args.units:.1f} | {b[op] / args.units:.1f} | {(b[op] - a[op]) / args.units:+.1f} |")


if __name__ == "__main__":
    main()
