"""Executed instructions by opcode, from Nsight Compute's source page, for one kernel or two side by side.

  ncu --section SourceCounters --import-source no --export REP ...
  ncu --import REP.ncu-rep --page source --csv --print-source sass > SRC.csv   (gzip optional)
  python bench/tools/ncu_opcode_mix.py OURS.csv[.gz] [PEER.csv[.gz]] [TOP] [--per=UNITS]

Sums the "Instructions Executed" column (warp instructions) per opcode (the first word of the SASS
line, predicate and modifiers dropped) and prints the TOP opcodes (default 40) with the difference
between the two kernels. Static counts (bench/tools/sass_stats.py) weigh a loop body once; these weigh
each instruction by how often it ran, which is what separates per-block overhead from per-tile work.
--per=UNITS divides every count by UNITS (e.g. the executions of an instruction both kernels run
once per warp and step, so the table reads "instructions a warp issues per step"). The Hopper
forward against cuDNN's at hd64, seqlen 512, causal was compared this way (docs/kernels-hopper.md).
"""
from __future__ import annotations

import collections
import csv
import gzip
import re
import sys


def opcode_mix(path: str):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as handle:
        rows = list(csv.reader(handle))
    header = next(i for i, row in enumerate(rows) if "Source" in row and "Address" in row)
    col = {name: i for i, name in enumerate(rows[header])}
    counts, total = collections.Counter(), 0
    for row in rows[header + 1:]:
        if len(row) < len(rows[header]):
            continue
        source = re.sub(r"^@!?U?P\w+\s+", "", row[col["Source"]].strip())
        opcode = source.split()[0].split(".")[0] if source else "?"
        executed = int(row[col["Instructions Executed"]] or 0)
        counts[opcode] += executed
        total += executed
    return counts, total


def main(argv):
    per = float(next((a.split("=", 1)[1] for a in argv if a.startswith("--per=")), "1"))
    argv = [a for a in argv if not a.startswith("--per=")]
    paths = [a for a in argv if not a.isdigit()]
    top = int(next((a for a in argv if a.isdigit()), "40"))
    if not 1 <= len(paths) <= 2:
        sys.exit(__doc__)
    mixes = [opcode_mix(p) for p in paths]
    if per != 1:
        mixes = [(collections.Counter({op: round(n / per, 1) for op, n in m.items()}), round(t / per, 1))
                 for m, t in mixes]
    totals = [t for _, t in mixes]
    print("warp instructions executed: " + ", ".join(f"{p}: {t:,}" for p, t in zip(paths, totals)) +
          (f" (ratio {totals[0] / totals[1]:.3f})" if len(paths) == 2 and totals[1] else ""))
    ops = sorted(set().union(*(m for m, _ in mixes)), key=lambda o: -sum(m[o] for m, _ in mixes))
    for op in ops[:top]:
        cells = [f"{m[op]:>12,}" for m, _ in mixes]
        diff = f" {mixes[0][0][op] - mixes[1][0][op]:>+12,}" if len(paths) == 2 else ""
        print(f"{op:<12}" + "".join(cells) + diff)


if __name__ == "__main__":
    main(sys.argv[1:])
