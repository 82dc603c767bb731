"""Opcode counts of compiled kernels, from cuobjdump's SASS (issue #15: instruction mix).

  python bench/tools/sass_stats.py FILE REGEX [REGEX ...]

FILE: the library, or (much faster: cuobjdump reads the whole fat binary) one object file
of the build, e.g. .portattn_build/.../bwd_128_bf16.cu.o.

For each kernel whose mangled name matches every REGEX: its instruction count per opcode
(the first word of each SASS line, predicates and modifiers dropped), the total, and the
ratio of other instructions to tensor-core MMAs (HMMA), the number the backward's
issue-efficiency work moves. Static counts: unrolled loop bodies count once per copy.

Where the CUDA install has no cuobjdump (the dev machine's nvcc 13 has none), PyPI's
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels carry both binaries (`pip download
--no-deps`, unzip, put their bin/ on PATH): enough to compare two builds' SASS without a GPU,
as when the hd64 causal backward's regression was found (docs/kernels-hopper.md).
"""
from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys


def kernels(lib: str) -> dict:
    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    return parse(subprocess.run([tool, "-sass", lib], capture_output=True, text=True, check=True).stdout)


def parse(text: str) -> dict:
    """{kernel name: Counter of opcodes} from cuobjdump -sass text."""
    found, name = {}, None
    for line in text.splitlines():
        head = re.match(r"\s*Function : (\S+)", line)
        if head:
            name = head.group(1)
            found[name] = collections.Counter()
            continue
        inst = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if name and inst:
            found[name][inst.group(2)] += 1
    return found


def main(argv) -> int:
    if len(argv) < 3:
        print(__doc__)
        return 2
    lib, patterns = argv[1], [re.compile(p) for p in argv[2:]]
    for name, counts in kernels(lib).items():
        if not all(p.search(name) for p in patterns):
            continue
        total = sum(counts.values())
        hmma = counts.get("HMMA", 0)
        print(f"== {name[:160]}\n   total {total}, HMMA {hmma}, other per HMMA "
              f"{(total - hmma) / hmma if hmma else float('nan'):.2f}")
        print("   " + ", ".join(f"{op} {n}" for op, n in counts.most_common(28)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
