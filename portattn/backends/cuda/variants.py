"""The CUDA backend's variant table (torch-free): what gets compiled, from data.

Note [portattn cuda variants] (csrc/variant_table.h): this module is the one
list of kernel variants, the sm_90a (Hopper) families included. It drives the
generated translation units (one per kernel family x head dim x dtype, so ninja
builds them in parallel and a restricted build compiles only what it needs),
the C tables the entry points dispatch on, the nvcc arch flags, and the
`build_config()` the module reports.

Restriction variables (all optional, see README):
  PORTATTN_CUDA_ARCHS  "80;90", "8.0,9.0", "sm_80 sm_90a"  (default 80;90)
  PORTATTN_HEADDIMS    "64,128"                            (default every entry of HEAD_DIMS)
  PORTATTN_DTYPES      "bf16" / "fp16,bf16" / "bfloat16"   (default both)
PTX of the newest requested arch is embedded too, so GPUs newer than every
built arch still run (the driver JIT-compiles it on first use).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

# Instantiated head dims; any multiple of 8 up to the maximum is served by the
# smallest instantiated one >= it.
HEAD_DIMS: Tuple[int, ...] = (32, 64, 96, 128, 160, 192, 224, 256)
# name -> (C++ element type, PortattnDtype enumerator, torch-style name for build_config)
DTYPES = {
    "fp16": ("__half", "PORTATTN_FP16", "float16"),
    "bf16": ("__nv_bfloat16", "PORTATTN_BF16", "bfloat16"),
}
DEFAULT_ARCHS: Tuple[str, ...] = ("80", "90")
MIN_ARCH = 80  # mma.sync.m16n8k16 with bf16, cp.async and ldmatrix need sm80


@dataclass(frozen=True)
class Family:
    """A kernel family: one run template instantiated per (head dim, dtype)."""

    name: str  # "fwd"; generated files are <name>_hd<D>_<dtype>.cu
    header: str  # csrc header that defines the run template
    run_template: str  # e.g. "portattn::cuda::run_fwd"
    table: str  # C table symbol defined in variants_generated.cu
    count: str  # its element-count symbol
    fn_type: str  # function-pointer type of the table entries
    params_type: str  # the C ABI struct the run function takes
    # The head dims this family serves (None: every head dim of the plan); the plan's
    # PORTATTN_HEADDIMS restriction still applies on top.
    head_dims: Optional[Tuple[int, ...]] = None
    # Served head dim -> the larger instantiated head dim whose kernel serves it, padded
    # (the Hopper forward's 96 -> 128; Note [portattn hopper padded head dims]). A head dim
    # not named here is instantiated itself.
    padded: Mapping[int, int] = field(default_factory=dict, hash=False)
    # A second template instantiated beside run_template, whose pointer fills the table entry's
    # `query` (variant_table.h: Variant), with its C++ type: what the entry asks about the
    # kernel a call would launch (the decode families: its occupancy, for the split planner).
    query_template: Optional[str] = None
    query_type: str = ""
    query_params: str = ""  # its parameter list, for the explicit instantiation

    def variants_of(self, variants: Sequence["Variant"]) -> List["Variant"]:
        """The plan's variants this family serves."""
        return [v for v in variants if self.head_dims is None or v.head_dim in self.head_dims]

    def kernel_head_dim(self, head_dim: int) -> int:
        """The instantiated head dim that serves `head_dim`."""
        return self.padded.get(head_dim, head_dim)


FAMILIES: Tuple[Family, ...] = (
    Family("fwd", "fwd_launch.cuh", "portattn::cuda::run_fwd", "kFwdVariants", "kNumFwdVariants",
           "FwdFn", "PortattnFwdParams"),
    # backward family (backward engineer): bwd_<hd>_<dtype>.cu instantiate run_bwd
    Family("bwd", "bwd_launch.cuh", "portattn::cuda::run_bwd", "kBwdVariants", "kNumBwdVariants",
           "BwdFn", "PortattnBwdParams"),
    # split-KV decode over a KV cache read in place (Note [portattn decode] in common/params.h)
    Family("decode", "decode_launch.cuh", "portattn::cuda::run_decode", "kDecodeVariants",
           "kNumDecodeVariants", "DecodeFn", "PortattnDecodeParams",
           query_template="portattn::cuda::decode_facts", query_type="DecodeQueryFn",
           query_params="bool, portattn::cuda::DecodeTileFacts*"),
    # the same kernels over float8 e4m3 caches (Note [portattn fp8 kv cache] in common/params.h);
    # the dtype is the query's
    Family("decode_fp8", "decode_launch.cuh", "portattn::cuda::run_decode_fp8", "kDecodeFp8Variants",
           "kNumDecodeFp8Variants", "DecodeFn", "PortattnDecodeParams",
           query_template="portattn::cuda::decode_fp8_facts", query_type="DecodeQueryFn",
           query_params="bool, portattn::cuda::DecodeTileFacts*"),
)


@dataclass(frozen=True)
class Variant:
    head_dim: int  # the head dim it serves (its kernel's: Family.kernel_head_dim)
    dtype: str  # key of DTYPES

    def source_name(self, family: Family) -> str:
        """The generated file that instantiates its kernel (shared by the head dims one kernel serves)."""
        return f"{family.name}_hd{family.kernel_head_dim(self.head_dim)}_{self.dtype}.cu"


@dataclass(frozen=True)
class BuildPlan:
    archs: Tuple[str, ...]  # compute capabilities as "80", "90", "90a"
    head_dims: Tuple[int, ...]
    dtypes: Tuple[str, ...]
    hopper: bool = False  # the sm_90a path is built (hopper_enabled)

    @property
    def variants(self) -> List[Variant]:
        return [Variant(h, d) for h in self.head_dims for d in self.dtypes]

    @property
    def hopper_variants(self) -> List[Variant]:
        """The Hopper forward's variants (a superset of the backward's): the restricted head dims
        that are HOPPER_HEAD_DIMS (possibly none: the path is then built with empty tables and
        serves no call). Per family: `Family.variants_of`."""
        if not self.hopper:
            return []
        return [Variant(h, d) for h in self.head_dims if h in HOPPER_HEAD_DIMS for d in self.dtypes]

    @property
    def ptx_arch(self) -> str:
        return max(self.archs, key=_arch_number)

    def build_config(self) -> dict:
        """What the built module's build_config() reports (csrc/binding.cpp)."""
        config = {
            "archs": [f"sm_{a}" for a in self.archs],
            "ptx": [f"sm_{self.ptx_arch}"],
            "head_dims": list(self.head_dims),
            "dtypes": [DTYPES[d][2] for d in self.dtypes],
        }
        if self.hopper:
            # The forward table's pairs (csrc/binding.cpp reads kHopperFwdVariants): the head dims
            # served, padded ones included; head dims the backward lacks are the spec's
            # forward_only_head_dims.
            hopper = self.hopper_variants
            config["hopper"] = {
                "archs": ["sm_90a"],
                "head_dims": sorted({v.head_dim for v in hopper}),
                "dtypes": [DTYPES[d][2] for d in DTYPES if any(v.dtype == d for v in hopper)],
            }
        return config


def _arch_number(arch: str) -> int:
    return int(re.match(r"\d+", arch).group(0))


def parse_archs(text: str) -> Tuple[str, ...]:
    """"80;90", "8.0,9.0", "sm_80 sm_90a", "8.6+PTX" -> ("80", "90") etc. (sorted, unique)."""
    archs = []
    for token in re.split(r"[;,\s]+", text.strip()):
        if not token:
            continue
        word = token.lower().replace("+ptx", "")
        word = re.sub(r"^(sm_?|compute_?)", "", word)
        match = re.fullmatch(r"(\d+)\.(\d)([a-z]?)|(\d{2,3})([a-z]?)", word)
        if match is None:
            raise ValueError(f"PORTATTN_CUDA_ARCHS: cannot read {token!r} (examples: '80;90', '8.0,9.0', 'sm_90a')")
        if match.group(1) is not None:
            arch = f"{match.group(1)}{match.group(2)}{match.group(3)}"
        else:
            arch = f"{match.group(4)}{match.group(5)}"
        if _arch_number(arch) < MIN_ARCH:
            raise ValueError(f"PORTATTN_CUDA_ARCHS: {token!r} is below sm_{MIN_ARCH}, the oldest arch this backend supports")
        if arch not in archs:
            archs.append(arch)
    if not archs:
        raise ValueError("PORTATTN_CUDA_ARCHS is set but names no arch")
    return tuple(sorted(archs, key=lambda a: (_arch_number(a), a)))


def parse_head_dims(text: str) -> Tuple[int, ...]:
    """"64,128" -> (64, 128); each must be one of HEAD_DIMS."""
    dims = []
    for token in re.split(r"[;,\s]+", text.strip()):
        if not token:
            continue
        if not token.isdigit() or int(token) not in HEAD_DIMS:
            raise ValueError(f"PORTATTN_HEADDIMS: {token!r} is not an instantiable head dim; choose from {list(HEAD_DIMS)}")
        if int(token) not in dims:
            dims.append(int(token))
    if not dims:
        raise ValueError("PORTATTN_HEADDIMS is set but names no head dim")
    return tuple(sorted(dims))


_DTYPE_ALIASES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


def parse_dtypes(text: str) -> Tuple[str, ...]:
    """"bf16" / "fp16,bf16" / "bfloat16" -> keys of DTYPES, in DTYPES order."""
    chosen = set()
    for token in re.split(r"[;,\s]+", text.strip().lower()):
        if not token:
            continue
        if token not in _DTYPE_ALIASES:
            raise ValueError(f"PORTATTN_DTYPES: {token!r} is not a dtype this backend builds; choose from {sorted(DTYPES)}")
        chosen.add(_DTYPE_ALIASES[token])
    if not chosen:
        raise ValueError("PORTATTN_DTYPES is set but names no dtype")
    return tuple(d for d in DTYPES if d in chosen)


def plan_from_env(env: Mapping[str, str]) -> BuildPlan:
    archs = parse_archs(env["PORTATTN_CUDA_ARCHS"]) if env.get("PORTATTN_CUDA_ARCHS") else DEFAULT_ARCHS
    head_dims = parse_head_dims(env["PORTATTN_HEADDIMS"]) if env.get("PORTATTN_HEADDIMS") else HEAD_DIMS
    dtypes = parse_dtypes(env["PORTATTN_DTYPES"]) if env.get("PORTATTN_DTYPES") else tuple(DTYPES)
    return BuildPlan(archs, head_dims, dtypes, hopper=_hopper_wanted(env, archs))


def gencode_flags(plan: BuildPlan) -> List[str]:
    """SASS for every arch, plus PTX of the newest for GPUs newer than all of them."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in plan.archs]
    ptx = plan.ptx_arch
    flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    return flags


_GENERATED = "// generated by portattn/backends/cuda/variants.py; do not edit"


def generated_sources(plan: BuildPlan, families: Sequence[Family] = FAMILIES) -> dict:
    """{file name: text} for every generated translation unit, the tables included: the
    sm80+ families' (variants_generated.cu) and, when plan.hopper, the Hopper families'
    (hopper_variants_generated.cu; every Hopper file name starts with HOPPER_SOURCE_PREFIX,
    so build.py compiles them for sm_90a only)."""
    sources = _variant_sources(plan.variants, families)
    sources["variants_generated.cu"] = _table_source(plan.variants, families, [
        f'const char* const kBuildArchs = "{";".join(plan.archs)}";',
        f'const char* const kBuildPtx = "{plan.ptx_arch}";',
    ])
    if plan.hopper:
        sources.update(_variant_sources(plan.hopper_variants, HOPPER_FAMILIES))
        sources[HOPPER_TABLE_SOURCE] = _table_source(plan.hopper_variants, HOPPER_FAMILIES)
    return sources


def _variant_sources(variants: Sequence[Variant], families: Iterable[Family]) -> dict:
    """One file per instantiated kernel: head dims served by the same kernel share it."""
    sources = {}
    for family in families:
        for variant in family.variants_of(variants):
            elem = DTYPES[variant.dtype][0]
            kernel = family.kernel_head_dim(variant.head_dim)
            lines = [
                _GENERATED,
                f'#include "{family.header}"',
                f"template cudaError_t {family.run_template}<{kernel}, {elem}>(",
                f"    const {family.params_type}&);",
            ]
            if family.query_template:
                lines.append(f"template cudaError_t {family.query_template}<{kernel}, {elem}>({family.query_params});")
            lines.append("")
            sources[variant.source_name(family)] = "\n".join(lines)
    return sources


def _table_source(variants: Sequence[Variant], families: Iterable[Family], extra: Sequence[str] = ()) -> str:
    lines = [_GENERATED, '#include "variant_table.h"', "", "namespace portattn {", "namespace cuda {", ""]
    for family in families:
        own = family.variants_of(variants)
        variant_type = f"Variant<{family.fn_type}, {family.query_type}>" if family.query_template else \
            f"Variant<{family.fn_type}>"
        lines.append(f"const {variant_type} {family.table}[] = {{")
        for variant in own:
            elem, enum, _ = DTYPES[variant.dtype]
            kernel = family.kernel_head_dim(variant.head_dim)
            query = f", &{family.query_template}<{kernel}, {elem}>" if family.query_template else ""
            lines.append(f"    {{{variant.head_dim}, {enum}, &{family.run_template}<{kernel}, {elem}>{query}}},")
        if not own:  # C++ has no empty arrays; the count below says there is no entry
            lines.append("    {0, -1, nullptr},")
        lines.append("};")
        lines.append(f"const int {family.count} = {len(own)};")
        lines.append("")
    if extra:
        lines += [*extra, ""]
    lines += ["}  // namespace cuda", "}  // namespace portattn", ""]
    return "\n".join(lines)


# ---- Hopper path (issue #6, its variants issue 16) -----------------------------------
# The sm_90a kernels (forward and backward) are built whenever the plan
# includes sm_90 (PORTATTN_CUDA_HOPPER=0 leaves it out, =1 forces it): their
# sources (csrc/hopper_*.cu and the generated hopper_* files) are left out of the
# generic arch loop, get SASS for sm_90a only (wgmma and setmaxnreg exist nowhere
# else, and no PTX is embedded for newer GPUs), and the binding then exposes
# `hopper_fwd` and `hopper_bwd` (compile definition below).
# Dispatch serves it as the "cuda-sm90" backend (capability/specs/cuda_sm90.py).
# Its families are generated like the sm80+ ones, one file per (family, head dim, dtype)
# of the plan, restricted by PORTATTN_HEADDIMS / PORTATTN_DTYPES the same way; a head dim
# outside a family's head dims has no kernel of that family.
HOPPER_ENV = "PORTATTN_CUDA_HOPPER"
HOPPER_SOURCE_PREFIX = "hopper_"
HOPPER_GENCODE: Tuple[str, ...] = ("-gencode=arch=compute_90a,code=sm_90a",)
HOPPER_BINDING_DEFINE = "-DPORTATTN_WITH_HOPPER"
# Exactly these, per family: the Hopper kernels have no masked head-dim tail, so a call is
# served only at a head dim named here, by its own kernel or, for the forward, by the larger
# kernel HOPPER_FWD_PADDED names (as the sm80+ path serves 40 with its hd64 kernel, but as a
# table, not "the smallest one >= it": 80 or 160 have no Hopper serving). The forward has hd192
# and hd256 (Notes [portattn hopper hd192] and [portattn hopper hd256] in csrc/hopper_fwd_kernel.cuh)
# and hd96 padded (Note [portattn hopper padded head dims] in csrc/hopper_fwd_launch.cuh); the backward has hd96 padded
# on its hd128 kernel, hd256 with its head dim split over two CTAs (Note [portattn hopper split
# head dim] in csrc/hopper_bwd_kernel.cuh) and hd192 in two parts of its own kernel (Note [portattn
# hopper hd192 backward]). The spec says the same
# (capability/specs/cuda_sm90.py: head_dims and forward_only_head_dims);
# tests/test_cuda_hopper_build.py checks the two agree.
# PORTATTN_HEADDIMS names served head dims: "96" builds the hd128 kernels (forward and backward)
# and serves 96 only.
HOPPER_FWD_PADDED: Mapping[int, int] = {96: 128}  # served head dim -> kernel head dim
HOPPER_FWD_KERNEL_HEAD_DIMS: Tuple[int, ...] = (64, 128, 192, 256)
HOPPER_FWD_HEAD_DIMS: Tuple[int, ...] = tuple(sorted(HOPPER_FWD_KERNEL_HEAD_DIMS + tuple(HOPPER_FWD_PADDED)))
HOPPER_BWD_PADDED: Mapping[int, int] = {96: 128}  # served head dim -> kernel head dim
HOPPER_BWD_KERNEL_HEAD_DIMS: Tuple[int, ...] = (64, 128, 192, 256)
HOPPER_BWD_HEAD_DIMS: Tuple[int, ...] = tuple(sorted(HOPPER_BWD_KERNEL_HEAD_DIMS + tuple(HOPPER_BWD_PADDED)))
HOPPER_HEAD_DIMS: Tuple[int, ...] = HOPPER_FWD_HEAD_DIMS  # every head dim a Hopper kernel serves
HOPPER_FAMILIES: Tuple[Family, ...] = (
    Family("hopper_fwd", "hopper_fwd_launch.cuh", "portattn::hopper::run_hopper_fwd", "kHopperFwdVariants",
           "kNumHopperFwdVariants", "FwdFn", "PortattnFwdParams", HOPPER_FWD_HEAD_DIMS, HOPPER_FWD_PADDED),
    Family("hopper_bwd", "hopper_bwd_launch.cuh", "portattn::hopper::run_hopper_bwd", "kHopperBwdVariants",
           "kNumHopperBwdVariants", "BwdFn", "PortattnBwdParams", HOPPER_BWD_HEAD_DIMS, HOPPER_BWD_PADDED),
)
assert set(HOPPER_BWD_HEAD_DIMS) <= set(HOPPER_FWD_HEAD_DIMS), "build_config()['hopper'] reports the forward's"
# The kernel's store loop guards only its last 64-column panel (hopper_fwd_min_head_dim in
# csrc/hopper_fwd_schedule.h, whose rule this repeats; the launch refuses anything else).
assert all(kernel in HOPPER_FWD_KERNEL_HEAD_DIMS and kernel > 64 and kernel - 64 <= served < kernel
           and served % 8 == 0 for served, kernel in HOPPER_FWD_PADDED.items()), HOPPER_FWD_PADDED
# The backward's rule (hopper_bwd_acc_head_dim in csrc/bwd_kernel.cuh, which run_hopper_bwd checks):
# the kernel is the first of 64, 128, 192, 256 at or above the served head dim, since the workspace
# Python sizes without knowing the table has accumulator rows of that width; a padded head dim
# is a multiple of 32 (bwd_convert_dq reads whole groups of 8 swizzled 16-byte chunks of a row).
def hopper_bwd_acc_head_dim(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 192 if head_dim <= 192 else 256


assert all(kernel in HOPPER_BWD_KERNEL_HEAD_DIMS and kernel == hopper_bwd_acc_head_dim(served) and served % 32 == 0
           for served, kernel in HOPPER_BWD_PADDED.items()), HOPPER_BWD_PADDED
HOPPER_TABLE_SOURCE = "hopper_variants_generated.cu"


def _hopper_wanted(env: Mapping[str, str], archs: Sequence[str]) -> bool:
    value = env.get(HOPPER_ENV, "").strip()
    if value == "0":
        return False
    if value == "1":
        return True
    if value == "":
        return any(_arch_number(arch) == 90 for arch in archs)
    raise ValueError(f"{HOPPER_ENV}: expected 0 or 1 (unset: built when the archs include sm_90), got {value!r}")


def hopper_enabled(env: Mapping[str, str]) -> bool:
    """Whether the library (and so the binding) carries the sm_90a path."""
    return plan_from_env(env).hopper


def is_hopper_source(file_name: str) -> bool:
    return file_name.startswith(HOPPER_SOURCE_PREFIX)
