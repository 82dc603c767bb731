"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page.

  ncu --section SourceCounters --section WarpStateStats --import-source no --export REP ...
  ncu --import REP.ncu-rep --page source --csv --print-source sass > SRC.csv
  python bench/tools/ncu_sass_stalls.py SRC.csv [TOP]
  python bench/tools/ncu_sass_stalls.py SRC.csv --by-opcode [REASON]

The second form sums the samples of one reason (default "wait") and the executed counts by opcode
(predicate and modifiers dropped: `@!P0 MUFU.EX2` counts as MUFU). A reason spread thin over
hundreds of instructions shows up there: the hd64 forward's "wait" samples sit on the
exponentials (MUFU), behind the fixed stalls ptxas puts before them to pace the MUFU unit.

Prints the kernel's warp-stall samples by reason and the TOP instructions (default 25) with the
most samples, each with its index in the listing, share of all samples, times executed and its
three largest reasons; it shows what the Hopper backward's consumers wait on
(docs/kernels-hopper.md): the samples of every warp count, so idle producer warps waiting on a
barrier show up too (low "executed" counts tell them apart).
"""
from __future__ import annotations

import collections
import csv
import sys


def stalls(path: str):
    rows = list(csv.reader(open(path, newline="")))
    header = next(i for i, row in enumerate(rows) if "Source" in row and "Address" in row)
    names = rows[header]
    col = {name: i for i, name in enumerate(names)}
    reasons = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
    found = []
    for index, row in enumerate(rows[header + 1:]):
        if len(row) < len(names):
            continue
        counts = {name[len("stall_"):]: int(row[col[name]] or 0) for name in reasons}
        found.append((index, row[col["Source"]].strip(), int(row[col["Warp Stall Sampling (All Samples)"]] or 0),
                      int(row[col["Instructions Executed"]] or 0), counts))
    return found


def opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def by_opcode(found, reason: str) -> None:
    total = sum(samples for _, _, samples, _, _ in found) or 1
    waits, executed = collections.Counter(), collections.Counter()
    for _, source, _, count, counts in found:
        waits[opcode(source)] += counts.get(reason, 0)
        executed[opcode(source)] += count
    print(f"samples {total}; '{reason}' {sum(waits.values()) / total:.1%} of them; executed {sum(executed.values())}")
    print(f"'{reason}' by opcode (share of all samples): " +
          ", ".join(f"{name} {n / total:.1%}" for name, n in waits.most_common(12)))
    print("executed by opcode: " + ", ".join(f"{name} {n}" for name, n in executed.most_common(16)))


def main(argv) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    found = stalls(argv[1])
    if len(argv) > 2 and argv[2] == "--by-opcode":
        by_opcode(found, argv[3] if len(argv) > 3 else "wait")
        return 0
    top = int(argv[2]) if len(argv) > 2 else 25
    total = sum(samples for _, _, samples, _, _ in found) or 1
    by_reason = collections.Counter()
    for *_, counts in found:
        by_reason.update(counts)
    print(f"samples {total}; by reason: " +
          ", ".join(f"{name} {count / total:.1%}" for name, count in by_reason.most_common(12)))
    for index, source, samples, executed, counts in sorted(found, key=lambda item: -item[2])[:top]:
        largest = ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:3] if n)
        print(f"{index:5d} {samples / total:6.2%} executed {executed:9d}  {source[:64]:64s} | {largest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
