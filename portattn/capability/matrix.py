"""The support matrix: every backend's declaration, evaluated against a device and a call.

Dispatch, `explain()`, fallback warnings, error messages, the README table and
the report CLI all read these functions, so they all say the same thing. The
declarations themselves live in `specs/<backend>.py` (one file per backend).

`check_call` returns every reason a backend cannot serve a call, each naming
the offending value and what the backend supports (xformers-style), e.g.
"head_dim 264 > 256 (cuda supports multiples of 8 up to 256)".

A compiled module's `build_config()` narrows the declaration to what this
build contains: {"archs": [...], "head_dims": [...], "dtypes": [...]} and
optionally "ptx": bool or a list of archs with PTX embedded. Arch entries may
be spelled "sm80", "sm_80", "80", "8.0", "8.0+PTX", "compute_80" or "gfx942".
A call's head dim is served by the smallest built head dim >= it (kernels
mask the rest), or only by itself where the spec says `head_dims_exact`; an
empty "head_dims" list means the build has no kernel of that backend. An
optional "smem_bytes": {feature: {head_dim: bytes}} gives the least opt-in
shared memory each kernel family needs per built head dim;
it replaces the declaration's ResourceRules for those features.
"""
from __future__ import annotations

import importlib
from typing import Dict, List, Optional, Sequence

from .archs import Arch, ArchLike, format_ranges, parse_arch
from .callspec import FEATURE_TITLES, FEATURES, CallSpec
from .declare import ANY_ARCH, BUDGET_VERIFIED, COMPILED, NO, VERIFIED, BackendSpec
from .probe import DeviceInfo

# The one list of backends: specs/<module>.py each, in the order of the README table.
_SPEC_MODULES = ("reference", "cuda_sm90", "cuda", "rocm")

_VENDOR_TITLE = {"nvidia": "NVIDIA", "amd": "AMD"}
_DTYPE_ORDER = ("float16", "bfloat16", "float32")

_SPECS: Dict[str, BackendSpec] = {}
for _module in _SPEC_MODULES:
    _spec = importlib.import_module(f"{__package__}.specs.{_module}").SPEC
    _SPECS[_spec.name] = _spec

BACKEND_NAMES = tuple(_SPECS)

# Dispatch's priority order (first fit wins), by spec name; each spec names its class
# (`implementation`). The Hopper path goes first: it declares the calls it serves on sm90 and
# everything else falls through to "cuda"; the reference backend, which serves every call, is last.
DISPATCH_PRIORITY = ("cuda-sm90", "cuda", "rocm", "reference")


def get_spec(backend_name: str) -> BackendSpec:
    try:
        return _SPECS[backend_name]
    except KeyError:
        raise ValueError(f"unknown backend {backend_name!r}; known: {', '.join(BACKEND_NAMES)}") from None


def backend_specs() -> List[BackendSpec]:
    return list(_SPECS.values())


def _as_arch(arch) -> Optional[Arch]:
    if arch is None or isinstance(arch, Arch):
        return arch
    if isinstance(arch, DeviceInfo):
        return arch.arch
    return parse_arch(arch)


# ---------------------------------------------------------------------------------------------
# Arch and feature status


def arch_supported(spec: BackendSpec, arch: Optional[ArchLike]) -> bool:
    """Whether the declaration covers `arch` (None = no GPU: only vendor-neutral backends)."""
    if spec.vendor is None:
        return True
    a = _as_arch(arch)
    return a is not None and any(r.contains(a) for r in spec.archs)


def feature_status(backend_name: str, arch: Optional[ArchLike]) -> Dict[str, str]:
    """feature -> "verified" | "verified-at-budget" | "compiled" | "no" for `backend_name` on
    `arch` (None: CPU host)."""
    spec = get_spec(backend_name)
    a = _as_arch(arch)
    if not arch_supported(spec, a):
        return {f: NO for f in FEATURES}
    passed = set(spec.verified.get(ANY_ARCH, ()))
    at_budget = set()
    if a is not None:
        passed |= set(spec.verified.get(a.name, ()))
        at_budget = {f for b in spec.verified_at_budget if a.name in b.archs for f in b.features}
    supported = spec.supported_on(a)

    def status(f):
        if f not in supported:
            return NO
        return VERIFIED if f in passed else BUDGET_VERIFIED if f in at_budget else COMPILED

    return {f: status(f) for f in FEATURES}


# ---------------------------------------------------------------------------------------------
# check_call: one small function per rule, each returning its reasons


def _check_device(spec: BackendSpec, device: Optional[DeviceInfo], call: CallSpec) -> List[str]:
    if spec.vendor is None:
        return []
    needs = f"{spec.name} needs an {_VENDOR_TITLE[spec.vendor]} GPU, {format_ranges(spec.archs)}"
    reasons = []
    if call.device_type != "cuda":
        reasons.append(f"tensors are on {call.device_type} ({needs})")
    if device is None:
        if call.device_type == "cuda":
            reasons.append(f"no GPU device found ({needs})")
        return reasons
    if device.vendor != spec.vendor:
        reasons.append(f"device {device.name} is an {_VENDOR_TITLE.get(device.vendor, device.vendor)} GPU ({needs})")
        return reasons
    return reasons + _check_arch(spec, device)


def _check_arch(spec: BackendSpec, device: DeviceInfo) -> List[str]:
    arch = device.arch
    if any(r.contains(arch) for r in spec.archs):
        return []
    lowest = min(r.min for r in spec.archs)
    if arch < lowest:
        return [f"arch {arch.name} ({device.name}) below {spec.name}'s minimum {lowest.name}"]
    note = f": {spec.arch_note}" if spec.arch_note else ""
    return [f"arch {arch.name} ({device.name}, {arch.family}) not supported by {spec.name} ({format_ranges(spec.archs)}{note})"]


def _check_dtype(spec: BackendSpec, call: CallSpec) -> List[str]:
    if call.dtype in spec.dtypes:
        return []
    return [f"dtype {call.dtype} not supported ({spec.name}: {', '.join(spec.dtypes)})"]


def _check_head_dims(spec: BackendSpec, call: CallSpec) -> List[str]:
    rule = f"{spec.name} supports {spec.head_dim_rule()}"
    reasons = []
    dims = [("head_dim", call.head_dim)]
    if call.head_dim_v != call.head_dim:
        if spec.head_dim_v_equal:
            reasons.append(f"head_dim_v {call.head_dim_v} != head_dim {call.head_dim} ({spec.name} needs them equal)")
        dims.append(("head_dim_v", call.head_dim_v))
    for label, d in dims:
        before = len(reasons)
        if spec.head_dim_max is not None and d > spec.head_dim_max:
            reasons.append(f"{label} {d} > {spec.head_dim_max} ({rule})")
        if spec.head_dim_multiple > 1 and d % spec.head_dim_multiple:
            reasons.append(f"{label} {d} is not a multiple of {spec.head_dim_multiple} ({rule})")
        if len(reasons) == before and spec.head_dims is not None and d not in spec.head_dims:
            reasons.append(f"{label} {d} is not one of {', '.join(map(str, sorted(spec.head_dims)))} ({rule})")
        if len(reasons) == before and call.uses("backward") and d in spec.forward_only_head_dims:
            reasons.append(f"{label} {d} is forward-only on {spec.name}; with a backward it "
                           f"{spec.forward_only_head_dims[d]}")
    return reasons


def _check_features(spec: BackendSpec, call: CallSpec, device: Optional[DeviceInfo] = None) -> List[str]:
    reasons = []
    arch = device.arch if device is not None and device.vendor == spec.vendor else None
    on_arch = spec.supported_on(arch)
    for f in FEATURES:
        if call.uses(f) and f not in spec.supported:
            note = spec.unsupported_notes.get(f)
            reasons.append(f"feature {f} not supported by {spec.name}" + (f" ({note})" if note else ""))
        elif call.uses(f) and f not in on_arch:
            reasons.append(f"feature {f} not built for {arch.name} by {spec.name} (its kernels there: "
                           f"{', '.join(sorted(on_arch))})")
        elif call.uses(f) and call.uses("backward") and f in spec.forward_only:
            reasons.append(f"feature {f} is forward-only on {spec.name}; with a backward it {spec.forward_only[f]}")
    return reasons


def _check_resources(spec: BackendSpec, device: Optional[DeviceInfo], call: CallSpec, build: dict) -> List[str]:
    # Unknown opt-in memory (a text-tool probe) is not a reason: the kernel launch checks it.
    if device is None or device.smem_per_block_optin is None or device.vendor != (spec.vendor or device.vendor):
        return []
    have = device.smem_per_block_optin
    head_dim = max(call.head_dim, call.head_dim_v)
    # A build that reports its kernels' smallest shared-memory budgets decides for those features.
    budgets = build.get("smem_bytes") or {}
    reasons = []
    # Rules form steps over the head dim; only the most specific step that applies
    # speaks (per feature set), so a head dim never gets two answers.
    steps = {}
    for rule in spec.resource_rules:
        if any(f in budgets for f in rule.features) or not rule.applies(call.features, head_dim):
            continue
        current = steps.get(rule.features)
        if current is None or rule.head_dim_above > current.head_dim_above:
            steps[rule.features] = rule
    for rule in steps.values():
        if have < rule.min_smem_optin:
            what = " + ".join(rule.features)
            reasons.append(
                f"{what}{_above(rule, head_dim)} needs {_kib(rule.min_smem_optin)} "
                f"of opt-in shared memory per block ({rule.why}); {_has(device)}"
            )
    for feature, per_head_dim in budgets.items():
        table = {int(d): int(n) for d, n in per_head_dim.items()}
        served = _served_head_dim(table, head_dim)
        if call.uses(feature) and served is not None and table[served] > have:
            reasons.append(
                f"{feature} with head_dim {head_dim} needs {_kib(table[served])} of opt-in shared memory per "
                f"block (this build's smallest tile for head dim {served}); {_has(device)}"
            )
    return reasons


def _above(rule, head_dim: int) -> str:
    return f" with head_dim {head_dim} > {rule.head_dim_above}" if rule.head_dim_above > 0 else ""


def _has(device: DeviceInfo) -> str:
    """"NVIDIA L4 has 99 KiB", or under PORTATTN_MAX_SMEM_KIB what the cap leaves of the device's own."""
    if device.smem_per_block_optin_uncapped is not None:
        return (f"PORTATTN_MAX_SMEM_KIB leaves {_kib(device.smem_per_block_optin)} of {device.name}'s "
                f"{_kib(device.smem_per_block_optin_uncapped)}")
    return f"{device.name} has {_kib(device.smem_per_block_optin)}"


def _served_head_dim(built, head_dim: int) -> Optional[int]:
    """The built head dim that serves `head_dim`: the smallest one >= it."""
    fitting = [d for d in built if d >= head_dim]
    return min(fitting) if fitting else None


def _kib(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes % 1024 == 0 else f"{nbytes} bytes"


def _check_built_head_dim(spec: BackendSpec, call: CallSpec, built: Optional[Sequence]) -> List[str]:
    """The call's head dim against the build's head dims (None: the build does not say)."""
    need = max(call.head_dim, call.head_dim_v)
    if built is None or (spec.head_dim_max is not None and need > spec.head_dim_max):
        return []  # beyond the declared maximum the declaration's reason is enough
    if not built:
        return [f"head_dim {need} not built (this build has no {spec.name} kernel: PORTATTN_HEADDIMS / "
                f"PORTATTN_DTYPES left none of its head dims)"]
    head_dims = sorted(int(d) for d in built)
    if spec.head_dims_exact:
        if need in head_dims:
            return []
        rule = f"{spec.name} serves only the built head dims themselves"
    else:
        if _served_head_dim(head_dims, need) is not None:
            return []
        rule = "a head dim is served by the smallest built one >= it"
    return [f"head_dim {need} not built (this build: PORTATTN_HEADDIMS={','.join(map(str, head_dims))}; {rule})"]


def _check_build(spec: BackendSpec, device: Optional[DeviceInfo], call: CallSpec, build: dict) -> List[str]:
    reasons = []
    dtypes = build.get("dtypes")
    if dtypes and call.dtype in spec.dtypes and call.dtype not in dtypes:
        reasons.append(f"dtype {call.dtype} not built (this build: PORTATTN_DTYPES={','.join(dtypes)})")
    reasons += _check_built_head_dim(spec, call, build.get("head_dims"))
    archs = build.get("archs")
    if archs and device is not None and device.vendor == spec.vendor and any(r.contains(device.arch) for r in spec.archs):
        if not build_serves_arch(archs, device.arch, build.get("ptx", False)):
            var = spec.build_arch_env or "archs"
            no_ptx = device.arch.vendor == "nvidia" and not _ptx_archs(archs, build.get("ptx", False))
            extra = "; no PTX embedded" if no_ptx else ""
            reasons.append(f"arch {device.arch.name} not built (this build: {var}={','.join(map(str, archs))}{extra})")
    return reasons


def _split_build_arch(entry) -> tuple:
    """(Arch, has_ptx) from one build-config arch entry."""
    text = str(entry).strip().lower()
    if text.endswith("+ptx"):
        return parse_arch(text[:-4]), True
    return parse_arch(text), text.startswith("compute_")


def _ptx_archs(archs: Sequence, ptx) -> List[Arch]:
    parsed = [_split_build_arch(a) for a in archs]
    found = [a for a, has in parsed if has]
    if ptx is True and parsed:
        found.append(max(a for a, _ in parsed))
    elif isinstance(ptx, (list, tuple)):
        found += [parse_arch(p) for p in ptx]
    return found


def build_serves_arch(archs: Sequence, arch: Arch, ptx=False) -> bool:
    """Whether a build for `archs` can run on `arch`.

    NVIDIA: a cubin for sm_XY runs on sm_XZ with Z >= Y (same major); PTX for
    sm_XY JIT-compiles for any arch >= it. AMD: the gfx target must match.
    """
    for built, _ in (_split_build_arch(a) for a in archs):
        if built.vendor != arch.vendor:
            continue
        if arch.vendor == "amd":
            if built.name == arch.name:
                return True
        elif built.major == arch.major and built.minor <= arch.minor:
            return True
    if arch.vendor == "nvidia":
        return any(p.vendor == "nvidia" and p <= arch for p in _ptx_archs(archs, ptx))
    return False


def check_call(
    backend_name: str,
    device: Optional[DeviceInfo],
    call: CallSpec,
    build_config: Optional[dict] = None,
) -> List[str]:
    """Every reason `backend_name` cannot serve `call` on `device` (None: no GPU); [] = it can."""
    spec = get_spec(backend_name)
    reasons = _check_device(spec, device, call)
    reasons += _check_dtype(spec, call)
    reasons += _check_head_dims(spec, call)
    reasons += _check_features(spec, call, device)
    reasons += _check_resources(spec, device, call, build_config or {})
    if build_config:
        reasons += _check_build(spec, device, call, build_config)
    return reasons


# ---------------------------------------------------------------------------------------------
# Tables


def support_table(device: Optional[DeviceInfo]) -> List[dict]:
    """Rows for the report: {"feature", "title", "status": {backend: status}} per feature,
    then one row per dtype (status of "forward" where the dtype is declared, else "no")."""
    arch = device.arch if device is not None else None
    per_backend = {spec.name: feature_status(spec.name, arch) for spec in backend_specs()}
    rows = [
        {"feature": f, "title": FEATURE_TITLES.get(f, f), "status": {b: s[f] for b, s in per_backend.items()}}
        for f in FEATURES
    ]
    for dtype in _DTYPE_ORDER:
        rows.append(
            {
                "feature": f"dtype:{dtype}",
                "title": f"dtype {dtype}",
                "status": {
                    spec.name: (per_backend[spec.name]["forward"] if dtype in spec.dtypes else NO)
                    for spec in backend_specs()
                },
            }
        )
    return rows
