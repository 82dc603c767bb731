"""The README support table, rendered from the support matrix (torch-free).

    python -m portattn.capability.render                 # print the block
    python -m portattn.capability.render --write README.md
    python -m portattn.capability.render --check README.md   # exit 1 when stale

tests/test_readme_matrix.py keeps README.md equal to `readme_table()`.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a file: make the relative imports below resolvable
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "capability"

from .callspec import FEATURE_TITLES, FEATURES
from .declare import BUDGET_VERIFIED, COMPILED, NO, VERIFIED
from .matrix import backend_specs, feature_status, get_spec
from .probe import FAKE_DEVICE_KINDS, fake_device

BEGIN = "<!-- support-matrix:begin -->"
END = "<!-- support-matrix:end -->"

SYMBOL = {VERIFIED: "✅", BUDGET_VERIFIED: "🔷", COMPILED: "🟡", NO: "❌"}

# (backend, column heading, arch names the column stands for; None = no GPU / any device).
COLUMNS: Tuple[Tuple[str, str, Tuple[Optional[str], ...]], ...] = (
    ("reference", "reference (any device)", (None,)),
    ("cuda", "cuda sm80/sm86/sm89", ("sm80", "sm86", "sm89")),
    ("cuda-sm90", "cuda-sm90 (Hopper path)", ("sm90",)),
    ("cuda", "cuda sm90", ("sm90",)),
    ("cuda", "cuda sm100+/sm120", ("sm100", "sm120")),
    ("rocm", "rocm gfx90a", ("gfx90a",)),
    ("rocm", "rocm gfx942", ("gfx942",)),
    ("rocm", "rocm gfx950", ("gfx950",)),
    ("rocm", "rocm gfx1100/gfx1201", ("gfx1100", "gfx1201")),
)

DTYPES = ("float16", "bfloat16", "float32")


def _cell(statuses: Sequence[Tuple[Optional[str], str]]) -> str:
    """One symbol when every arch of the column agrees, else the archs per symbol."""
    distinct = {s for _, s in statuses}
    if len(distinct) == 1:
        return SYMBOL[distinct.pop()]
    parts = []
    for status in (VERIFIED, BUDGET_VERIFIED, COMPILED, NO):
        archs = [a for a, s in statuses if s == status]
        if archs:
            parts.append(f"{SYMBOL[status]} {'/'.join(archs)}")
    return " ".join(parts)


def _feature_cells(backend: str, archs: Tuple[Optional[str], ...]) -> dict:
    per_arch = [(a, feature_status(backend, a)) for a in archs]
    return {f: _cell([(a, st[f]) for a, st in per_arch]) for f in FEATURES} | {
        f"dtype:{d}": _cell(
            [(a, st["forward"] if d in get_spec(backend).dtypes else NO) for a, st in per_arch]
        )
        for d in DTYPES
    }


def _head_dims(backend: str) -> str:
    spec = get_spec(backend)
    if spec.head_dims is not None:
        text = ", ".join(str(d) for d in sorted(spec.head_dims))
        if spec.forward_only_head_dims:
            text += f" ({', '.join(str(d) for d in sorted(spec.forward_only_head_dims))}: forward only)"
        return text
    if spec.head_dim_max is None:
        return "any" if spec.head_dim_multiple <= 1 else f"multiples of {spec.head_dim_multiple}"
    step = max(spec.head_dim_multiple, 1)
    return f"{step}-{spec.head_dim_max}, step {step}"


def _footnotes() -> List[str]:
    notes = []
    devices = [fake_device(k) for k in FAKE_DEVICE_KINDS]
    for spec in backend_specs():
        for arch, note in spec.arch_notes.items():
            notes.append(f"- {spec.name} {arch}: {note}.")
        for feature, note in spec.unsupported_notes.items():
            notes.append(f"- {spec.name}: {FEATURE_TITLES.get(feature, feature)} {note}.")
        for feature, note in spec.forward_only.items():
            notes.append(f"- {spec.name}: {FEATURE_TITLES.get(feature, feature)} is forward only; "
                         f"a training call with it {note}.")
        for head_dim, note in sorted(spec.forward_only_head_dims.items()):
            notes.append(f"- {spec.name}: head dim {head_dim} is forward only; a training call with it {note}.")
        # A rule speaks where a known part of the backend's archs falls short of it.
        for rule in spec.resource_rules:
            own = [d for d in devices if d.vendor == spec.vendor and any(r.contains(d.arch) for r in spec.archs)]
            short = [d for d in own if d.smem_per_block_optin < rule.min_smem_optin]
            if not short:
                continue
            names = ", ".join(f"{d.name} ({d.smem_per_block_optin // 1024} KiB)" for d in short)
            above = f" with head dim > {rule.head_dim_above}" if rule.head_dim_above > 0 else ""
            notes.append(
                f"- {spec.name}: {' + '.join(rule.features)}{above} needs "
                f"{rule.min_smem_optin / 1024:g} KiB of opt-in shared memory per block (decided from the device, "
                f"not its arch); e.g. {names} fall back for it."
            )
    return notes


def readme_table() -> str:
    """The markdown block that goes between the README markers (markers excluded)."""
    cells = [_feature_cells(backend, archs) for backend, _, archs in COLUMNS]
    header = "| feature | " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    rule = "|---|" + "---|" * len(COLUMNS)
    lines = [header, rule]
    for f in FEATURES:
        lines.append(f"| {FEATURE_TITLES.get(f, f)} | " + " | ".join(c[f] for c in cells) + " |")
    for d in DTYPES:
        lines.append(f"| dtype {d} | " + " | ".join(c[f"dtype:{d}"] for c in cells) + " |")
    lines.append("| head dims | " + " | ".join(_head_dims(backend) for backend, _, _ in COLUMNS) + " |")
    at_budget = ""
    if any(SYMBOL[BUDGET_VERIFIED] in c for row in cells for c in row.values()):
        at_budget = (f" · {SYMBOL[BUDGET_VERIFIED]} verified on other hardware at that arch's shared-memory budget "
                     f"(PORTATTN_MAX_SMEM_KIB: the same tile configurations, not the same arch; self-checked on "
                     f"first use)")
    legend = (
        f"{SYMBOL[VERIFIED]} verified (our GPU test suite passed on that arch; the reference backend is tested "
        f"on CPU in CI){at_budget} · {SYMBOL[COMPILED]} compiled, not verified on that arch (self-checked against the "
        f"reference on first use) · {SYMBOL[NO]} not supported by that backend (dispatch tries the next one in priority order, the reference backend last)"
    )
    out = ["<!-- generated by `python -m portattn.capability.render --write README.md`; do not edit -->", ""]
    out += lines + ["", legend]
    notes = _footnotes()
    if notes:
        out += [""] + notes
    return "\n".join(out)


def replace_readme_table(text: str) -> str:
    """`text` with the block between the support-matrix markers replaced by `readme_table()`."""
    start = text.find(BEGIN)
    end = text.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"README has no {BEGIN} ... {END} block to replace")
    return text[: start + len(BEGIN)] + "\n" + readme_table() + "\n" + text[end:]


def readme_block(text: str) -> Optional[str]:
    """The current block between the markers, or None when the markers are missing."""
    start = text.find(BEGIN)
    end = text.find(END)
    if start < 0 or end < 0 or end < start:
        return None
    return text[start + len(BEGIN) : end].strip("\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portattn.capability.render", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="README", help="replace the support-matrix block in this file")
    group.add_argument("--check", metavar="README", help="exit 1 if this file's block is stale")
    args = parser.parse_args(argv)
    if args.write or args.check:
        path = args.write or args.check
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        try:
            new = replace_readme_table(text)
        except ValueError as error:
            print(f"{path}: {error}", file=sys.stderr)
            return 2
        if args.check:
            if new != text:
                print(f"{path}: support matrix is stale; run python -m portattn.capability.render --write {path}")
                return 1
            return 0
        if new != text:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(new)
        return 0
    print(readme_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
