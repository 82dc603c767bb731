"""GPU architecture names, families and ordered ranges (torch-free).

An `Arch` is what a kernel binary targets: NVIDIA compute capabilities
("sm90") and AMD gfx targets ("gfx942"). Support is always decided with
ordered ranges (`ArchRange`) or with device properties, never by comparing
against one product name, so an arch released after this file was written
still lands in the right place:

- NVIDIA: a newer minor of a known major is treated as that major's family
  (sm121 -> blackwell-consumer, as sm120); a binary built for sm_XY runs on
  sm_XZ with Z >= Y, and PTX JIT-compiles for any newer arch.
- AMD: gfx code objects are exact per target, so ranges list the targets a
  backend builds for; an unknown target inherits the family of its
  generation (gfx9 minor 4 -> cdna3, gfx11 -> rdna3, ...) for messages only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

VENDORS = ("nvidia", "amd")

# (major, minor) -> family for every NVIDIA arch characterised here.
_NVIDIA_KNOWN = {
    (7, 0): "volta",
    (7, 2): "volta",
    (7, 5): "turing",
    (8, 0): "ampere",
    (8, 6): "ampere",
    (8, 7): "ampere",
    (8, 9): "ada",
    (9, 0): "hopper",
    (10, 0): "blackwell",
    (10, 3): "blackwell",
    (11, 0): "blackwell",
    (12, 0): "blackwell-consumer",
}

# Family of an uncharacterised NVIDIA arch, by major version. Ada (8.9) shares
# major 8 with Ampere, so only the known table can tell them apart.
_NVIDIA_FAMILY_BY_MAJOR = {
    7: "volta",
    8: "ampere",
    9: "hopper",
    10: "blackwell",
    11: "blackwell",
    12: "blackwell-consumer",
}

# gfx target (without feature suffixes) -> family.
_AMD_KNOWN = {
    "gfx900": "gcn5",
    "gfx906": "gcn5",
    "gfx908": "cdna1",
    "gfx90a": "cdna2",
    "gfx940": "cdna3",
    "gfx941": "cdna3",
    "gfx942": "cdna3",
    "gfx950": "cdna4",
    "gfx1030": "rdna2",
    "gfx1100": "rdna3",
    "gfx1101": "rdna3",
    "gfx1102": "rdna3",
    "gfx1150": "rdna3.5",
    "gfx1151": "rdna3.5",
    "gfx1200": "rdna4",
    "gfx1201": "rdna4",
}


def _amd_family_guess(major: int, minor: int) -> str:
    """Family of an uncharacterised gfx target, from its generation digits."""
    if major == 9:
        return {0: "gcn5", 4: "cdna3", 5: "cdna4"}.get(minor, "gcn5")
    if major == 10:
        return "rdna1" if minor == 1 else "rdna2"
    if major == 11:
        return "rdna3.5" if minor >= 5 else "rdna3"
    if major == 12:
        return "rdna4"
    return "unknown"


@dataclass(frozen=True)
class Arch:
    """One GPU architecture. Order with <, <=, >=, > (same vendor only)."""

    vendor: str  # "nvidia" | "amd"
    name: str  # canonical: "sm90", "sm121", "gfx90a", "gfx1100"
    key: Tuple[int, ...] = field(compare=False)  # ordering key within the vendor
    family: str = field(compare=False)
    known: bool = field(compare=False)
    note: str = field(default="", compare=False)

    def _key_of(self, other: object):
        if not isinstance(other, Arch):
            return None
        if other.vendor != self.vendor:
            raise TypeError(f"cannot order {self.name} ({self.vendor}) against {other.name} ({other.vendor})")
        return other.key

    def __lt__(self, other: object) -> bool:
        k = self._key_of(other)
        return NotImplemented if k is None else self.key < k

    def __le__(self, other: object) -> bool:
        k = self._key_of(other)
        return NotImplemented if k is None else self.key <= k

    def __gt__(self, other: object) -> bool:
        k = self._key_of(other)
        return NotImplemented if k is None else self.key > k

    def __ge__(self, other: object) -> bool:
        k = self._key_of(other)
        return NotImplemented if k is None else self.key >= k

    @property
    def major(self) -> int:
        return self.key[0]

    @property
    def minor(self) -> int:
        return self.key[1]

    def describe(self) -> str:
        """e.g. "sm90 (hopper)" or "sm121 (blackwell-consumer; not in portattn's arch table: ...)"."""
        if self.known or not self.note:
            return f"{self.name} ({self.family})"
        return f"{self.name} ({self.family}; {self.note})"


def nvidia_arch(major: int, minor: int) -> Arch:
    if major < 1 or minor < 0 or minor > 9:
        raise ValueError(f"not an NVIDIA compute capability: {major}.{minor}")
    name = f"sm{major}{minor}"
    family = _NVIDIA_KNOWN.get((major, minor))
    if family is not None:
        return Arch("nvidia", name, (major, minor), family, True)
    family = _NVIDIA_FAMILY_BY_MAJOR.get(major)
    if family is None:
        newest = max(_NVIDIA_KNOWN)
        note = f"newer than every arch portattn knows (newest sm{newest[0]}{newest[1]}); reachable only through PTX JIT"
        return Arch("nvidia", name, (major, minor), "unknown", False, note)
    # The nearest characterised arch of the same major names what it behaves like.
    same_major = sorted(mm for mm in _NVIDIA_KNOWN if mm[0] == major)
    below = [mm for mm in same_major if mm <= (major, minor)]
    base = below[-1] if below else same_major[0]
    like = f"sm{base[0]}{base[1]}"
    note = f"not in portattn's arch table; treated as {like} ({family}) by its major version"
    return Arch("nvidia", name, (major, minor), family, False, note)


_GFX_RE = re.compile(r"^gfx(\d{1,2})([0-9a-f])([0-9a-f])$")


def amd_arch(target: str) -> Arch:
    """`target` is a gfx name, optionally with feature suffixes ("gfx942:sramecc+:xnack-")."""
    base = target.strip().lower().split(":", 1)[0]
    m = _GFX_RE.match(base)
    if m is None:
        raise ValueError(f"not an AMD gfx target: {target!r} (expected e.g. 'gfx90a', 'gfx942', 'gfx1100')")
    major, minor, stepping = int(m.group(1)), int(m.group(2), 16), int(m.group(3), 16)
    family = _AMD_KNOWN.get(base)
    if family is not None:
        return Arch("amd", base, (major, minor, stepping), family, True)
    family = _amd_family_guess(major, minor)
    note = f"not in portattn's arch table; treated as {family} by its generation"
    return Arch("amd", base, (major, minor, stepping), family, False, note)


_SM_RE = re.compile(r"^(?:sm_?|compute_?)(\d{2,3})[af]?$")
_CC_RE = re.compile(r"^(\d{1,2})\.(\d)$")
_BARE_SM_RE = re.compile(r"^(\d{2,3})[af]?$")  # "80", "90a", "120": TORCH_CUDA_ARCH_LIST / CMake style

ArchLike = Union[Arch, str, Tuple[int, int]]


def parse_arch(value: ArchLike) -> Arch:
    """Accepts "sm_90", "sm90", "sm_90a", "9.0", (9, 0), "gfx90a", "gfx942:sramecc+:xnack-"."""
    if isinstance(value, Arch):
        return value
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return nvidia_arch(*value)
    if not isinstance(value, str):
        raise TypeError(f"arch must be a str, a (major, minor) tuple or an Arch, got {type(value).__name__}")
    text = value.strip().lower()
    if text.startswith("gfx"):
        return amd_arch(text)
    m = _SM_RE.match(text)
    if m is not None:
        digits = m.group(1)
        return nvidia_arch(int(digits[:-1]), int(digits[-1]))
    m = _CC_RE.match(text)
    if m is not None:
        return nvidia_arch(int(m.group(1)), int(m.group(2)))
    m = _BARE_SM_RE.match(text)
    if m is not None:
        digits = m.group(1)
        return nvidia_arch(int(digits[:-1]), int(digits[-1]))
    raise ValueError(
        f"cannot parse arch {value!r}: expected an NVIDIA arch ('sm_90', 'sm90', '9.0') "
        "or an AMD gfx target ('gfx90a', 'gfx942:sramecc+:xnack-')"
    )


@dataclass(frozen=True)
class ArchRange:
    """Architectures `min` .. `max` (inclusive) of one vendor; `max=None` is open-ended."""

    vendor: str
    min: Arch
    max: Optional[Arch] = None

    def __init__(self, vendor: str, min: ArchLike, max: Optional[ArchLike] = None):  # noqa: A002
        if vendor not in VENDORS:
            raise ValueError(f"vendor must be one of {VENDORS}, got {vendor!r}")
        lo = parse_arch(min)
        hi = parse_arch(max) if max is not None else None
        for a in (lo, hi):
            if a is not None and a.vendor != vendor:
                raise ValueError(f"{a.name} is not a {vendor} arch")
        if hi is not None and hi < lo:
            raise ValueError(f"empty arch range: {lo.name} > {hi.name}")
        object.__setattr__(self, "vendor", vendor)
        object.__setattr__(self, "min", lo)
        object.__setattr__(self, "max", hi)

    def contains(self, arch: Optional[ArchLike]) -> bool:
        if arch is None:
            return False
        a = parse_arch(arch)
        if a.vendor != self.vendor:
            return False
        return a >= self.min and (self.max is None or a <= self.max)

    __contains__ = contains

    def __str__(self) -> str:
        if self.max is None:
            return f"{self.min.name}+"
        if self.max == self.min:
            return self.min.name
        return f"{self.min.name}-{self.max.name}"


def format_ranges(ranges) -> str:
    return ", ".join(str(r) for r in ranges)
