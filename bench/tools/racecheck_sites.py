"""Racecheck hazards by site: which instruction wrote and which read, per kernel.

  compute-sanitizer --tool racecheck --print-limit 100000 ... > rc.log
  cuobjdump -sass portattn/backends/cuda/_C*.so > sass.txt
  python bench/tools/racecheck_sites.py rc.log sass.txt

Prints, per (kernel, write PC, read PC), the hazard count and the two SASS instructions, so a
report can be matched to the shared-memory ring or slot it touches (the backward's LSE/delta
ring and ordered-dQ turn slot are ordered by mbarriers / named barriers racecheck does not model:
Note [portattn hopper ordered dQ])."""
import collections
import re
import sys

ERR = re.compile(r"Race reported between (Write|Read) access at (.+?)\+0x([0-9a-f]+)")
AND = re.compile(r"and (Write|Read) access at (.+?)\+0x([0-9a-f]+) \[(\d+) hazards\]")


def short(kernel):
    m = re.search(r"hopper_bwd_kernel<(.*?)>", kernel)
    return "bwd<" + m.group(1).replace("(int)", "").replace("(bool)", "").replace("__nv_bfloat16", "bf16") + ">" if m else kernel[:60]


def sass_by_function(path):
    funcs, cur = {}, None
    for line in open(path, errors="replace"):
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), {})
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and cur is not None:
            cur[int(m.group(1), 16)] = m.group(2).strip()
    return funcs


def main(log, sass):
    funcs = sass_by_function(sass) if sass else {}
    demangled = {}
    sites = collections.Counter()
    write = None
    for line in open(log, errors="replace"):
        m = ERR.search(line)
        if m:
            write = (m.group(1), m.group(2), int(m.group(3), 16))
            continue
        m = AND.search(line)
        if m and write:
            sites[(short(write[1]), write[0], write[2], m.group(1), int(m.group(3), 16))] += int(m.group(4))
    def instr(kernel, pc):
        for name, body in funcs.items():
            if demangled.get(name, name) and kernel_matches(name, kernel) and pc in body:
                return body[pc]
        return "?"
    for (kernel, a, pa, b, pb), n in sorted(sites.items(), key=lambda kv: -kv[1]):
        print(f"{n:7d}  {kernel}  {a} +{pa:#x} [{instr(kernel, pa)}]  vs  {b} +{pb:#x} [{instr(kernel, pb)}]")
    print(f"total hazards {sum(sites.values())} at {len(sites)} site pairs")


def kernel_matches(mangled, short_name):
    # bwd<128, bf16, 1, 0, 1, 1> against _ZN...hopper_bwd_kernelILi128E13__nv_bfloat16Li1ELb0ELb1ELb1EE...
    m = re.search(r"hopper_bwd_kernelILi(\d+)E\w*?(__nv_bfloat16|__half)Li(\d)ELb(\d)ELb(\d)ELb(\d)E", mangled)
    if not m:
        return False
    hd, ty, mask, cap, bulk, ordd = m.groups()
    want = re.findall(r"[\w]+", short_name[4:-1])
    ty = "bf16" if ty == "__nv_bfloat16" else "__half"
    return [hd, ty, mask, cap, bulk, ordd] == want


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
