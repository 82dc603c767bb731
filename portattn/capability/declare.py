"""The vocabulary a backend's support declaration is written in (torch-free).

One `BackendSpec` per backend lives in `capability/specs/<backend>.py`; the
engineer who owns a backend edits only that file. `matrix.py` evaluates specs
against a device and a call; nothing else interprets these fields.

Statuses (Note [support status]):
- "verified": our GPU test suite passed on hardware of that exact arch
  (listed in `BackendSpec.verified`); "any" stands for every device, used by
  the pure-PyTorch reference backend that CI tests on CPU.
- "verified-at-budget": the GPU suite passed on hardware of another arch run
  with that arch's shared-memory budget (PORTATTN_MAX_SMEM_KIB, e.g. an H100 at
  the 99 KiB of sm86/sm89): the same tile configurations, not the same machine
  code or the same hardware (`BackendSpec.verified_at_budget`). selfcheck.py
  still verifies it on first use, as it does "compiled".
- "compiled": supported and built for the arch (or reachable through PTX JIT)
  but never run there by us; selfcheck.py verifies it on first use.
- "no": not supported; dispatch falls back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

from .archs import ArchRange
from .callspec import FEATURES

VERIFIED = "verified"
BUDGET_VERIFIED = "verified-at-budget"
COMPILED = "compiled"
NO = "no"
STATUSES = (VERIFIED, BUDGET_VERIFIED, COMPILED, NO)

ANY_ARCH = "any"  # key of `verified` meaning every device, CPU included

ALL_FEATURES = frozenset(FEATURES)


@dataclass(frozen=True)
class ResourceRule:
    """A feature that needs more per-block shared memory (LDS on AMD) than every
    device of the backend's archs offers. Decided from the probed device's
    `smem_per_block_optin`, never from its arch name, so a cut-down part of a
    supported arch is handled by the same rule."""

    features: Tuple[str, ...]  # the rule applies when the call uses all of these
    head_dim_above: int  # ... and its head_dim is larger than this
    min_smem_optin: int  # bytes of opt-in shared memory per block required
    why: str = ""  # one line: what the memory is for

    def applies(self, features, head_dim: int) -> bool:
        return all(f in features for f in self.features) and head_dim > self.head_dim_above


@dataclass(frozen=True)
class BudgetVerification:
    """The GPU suite passed on `hardware` (an arch name) run with PORTATTN_MAX_SMEM_KIB=`budget_kib`,
    the opt-in shared memory per block of the parts of `archs`: it ran the tile configurations
    those parts run, compiled for `hardware`. Status "verified-at-budget" on `archs`."""

    archs: Tuple[str, ...]  # arch names whose parts offer budget_kib, e.g. ("sm86", "sm89", "sm120")
    budget_kib: int
    hardware: str  # the arch the suite ran on, e.g. "sm90"
    features: frozenset
    evidence: str = ""  # where the run's results are


@dataclass(frozen=True)
class BackendSpec:
    name: str  # dispatch's name: "reference", "cuda", "rocm", ...
    title: str  # human title for tables
    vendor: Optional[str]  # "nvidia" | "amd" | None (any device, CPU included)
    archs: Tuple[ArchRange, ...] = ()  # where the kernels run; empty with vendor None
    arch_note: str = ""  # family names for messages, e.g. "CDNA2/CDNA3"
    # Newer NVIDIA archs than any built one still run through PTX JIT; AMD code objects are per target.
    ptx_forward_compatible: bool = False
    dtypes: Tuple[str, ...] = ("float16", "bfloat16")
    head_dim_multiple: int = 8
    head_dim_max: Optional[int] = 256
    # True: a call's head dim must itself be built (kernels with no masked head-dim tail);
    # False: the smallest built head dim >= it serves it.
    head_dims_exact: bool = False
    # The head dims themselves where they are no run of multiples (e.g. (64, 128, 256)); each
    # must still be a multiple of head_dim_multiple up to head_dim_max. None: every such multiple.
    head_dims: Optional[Tuple[int, ...]] = None
    # Head dims served in calls without a backward only: head dim -> where training calls go.
    forward_only_head_dims: Mapping[int, str] = field(default_factory=dict)
    head_dim_v_equal: bool = True  # v's head dim must equal q/k's
    supported: frozenset = frozenset()  # subset of callspec.FEATURES
    # Archs whose kernels implement only part of `supported`: (range, its features) pairs;
    # an arch in no range has all of `supported`.
    arch_features: Tuple[Tuple[ArchRange, frozenset], ...] = ()
    verified: Mapping[str, frozenset] = field(default_factory=dict)  # arch name -> features passed on it
    # Features that passed on other hardware at these archs' shared-memory budget (BudgetVerification).
    verified_at_budget: Tuple[BudgetVerification, ...] = ()
    resource_rules: Tuple[ResourceRule, ...] = ()
    unsupported_notes: Mapping[str, str] = field(default_factory=dict)  # feature -> what happens instead
    # arch name -> one line on what is built for it and how it was checked (the README's footnotes)
    arch_notes: Mapping[str, str] = field(default_factory=dict)
    # Supported in calls without a backward only: feature -> where training calls with it go.
    forward_only: Mapping[str, str] = field(default_factory=dict)
    build_arch_env: str = ""  # the restriction variable naming the built archs
    # The Backend class that implements this spec, "package.module:ClassName"; dispatch imports it
    # (in matrix.DISPATCH_PRIORITY order) and tests/test_dispatch.py checks its `name` is this spec's.
    implementation: str = ""
    fallback_when_unbuilt: str = ""  # e.g. "pip install with nvcc available"

    def __post_init__(self):
        unknown = (set(self.supported) | {f for fs in self.verified.values() for f in fs}) - ALL_FEATURES
        if unknown:
            raise ValueError(f"{self.name}: unknown feature names {sorted(unknown)}; add them to callspec.FEATURES")
        not_supported = set(self.forward_only) - set(self.supported)
        if not_supported:
            raise ValueError(f"{self.name}: forward-only features must be declared supported: {sorted(not_supported)}")
        if self.head_dims is not None:
            stray = [d for d in self.head_dims if d % max(self.head_dim_multiple, 1)
                     or (self.head_dim_max is not None and d > self.head_dim_max)]
            if stray:
                raise ValueError(f"{self.name}: head_dims {stray} break the rule '{self.head_dim_rule()}'")
        admitted = self.admitted_head_dims()
        if admitted is not None and set(self.forward_only_head_dims) - set(admitted):
            raise ValueError(f"{self.name}: forward-only head dims must be admitted head dims: "
                             f"{sorted(set(self.forward_only_head_dims) - set(admitted))}")
        beyond = {f for _, fs in self.arch_features for f in fs} - set(self.supported)
        if beyond:
            raise ValueError(f"{self.name}: arch_features beyond the supported set: {sorted(beyond)}")
        budget_features = {f for b in self.verified_at_budget for f in b.features}
        if budget_features - ALL_FEATURES:
            raise ValueError(f"{self.name}: unknown feature names {sorted(budget_features - ALL_FEATURES)}")
        if budget_features - set(self.supported):
            raise ValueError(f"{self.name}: features verified at a budget but not declared supported: "
                             f"{sorted(budget_features - set(self.supported))}")
        unsupported_verified = {f for fs in self.verified.values() for f in fs} - set(self.supported)
        if unsupported_verified:
            raise ValueError(f"{self.name}: features verified but not declared supported: {sorted(unsupported_verified)}")

    def supported_on(self, arch) -> frozenset:
        """The features the kernels implement on `arch` (an Arch or None for no GPU)."""
        for arch_range, features in self.arch_features:
            if arch is not None and arch_range.contains(arch):
                return frozenset(features)
        return frozenset(self.supported)

    def admitted_head_dims(self) -> Optional[Tuple[int, ...]]:
        """Every head dim the declaration admits in a forward call (None: no upper bound)."""
        if self.head_dims is not None:
            return tuple(sorted(self.head_dims))
        if self.head_dim_max is None:
            return None
        step = max(self.head_dim_multiple, 1)
        return tuple(range(step, self.head_dim_max + 1, step))

    def head_dim_rule(self) -> str:
        """e.g. "multiples of 8 up to 256", "head dims 64, 128, 256 (256 forward only)"; the
        same text every message uses."""
        if self.head_dims is not None:
            text = "head dims " + ", ".join(str(d) for d in sorted(self.head_dims))
            if self.forward_only_head_dims:
                text += f" ({', '.join(str(d) for d in sorted(self.forward_only_head_dims))} forward only)"
            return text
        if self.head_dim_max is None and self.head_dim_multiple <= 1:
            return "any head dim"
        parts = []
        if self.head_dim_multiple > 1:
            parts.append(f"multiples of {self.head_dim_multiple}")
        if self.head_dim_max is not None:
            parts.append(f"up to {self.head_dim_max}")
        return " ".join(parts)
