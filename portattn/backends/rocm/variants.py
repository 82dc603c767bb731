"""The ROCm backend's variant table (torch-free): one list of tiles x dtypes x archs.

It generates the instantiation sources and their registry (build.py), gives
the support matrix its head dims, and is the ISA test's grid and budget
(tests/test_rocm_isa.py). Head dims between table entries run on the next
larger tile with zero-filled columns, so `MAX_HEAD_DIM` bounds every multiple
of 8 up to it.
"""
from __future__ import annotations

from dataclasses import dataclass

# gfx targets with the CDNA2+ matrix instructions the kernels use
# (v_mfma_f32_32x32x8{f16,bf16_1k}, and v_mfma_f32_16x16x16{f16,bf16_1k} in the
# decode kernel); RDNA has no MFMA.
SUPPORTED_ARCHS = ("gfx90a", "gfx940", "gfx941", "gfx942", "gfx950")
# Built when no AMD GPU is present and PORTATTN_HIP_ARCHS is unset: MI200, MI300.
DEFAULT_ARCHS = ("gfx90a", "gfx942")

# dtype name (torch's) -> (PortattnDtype enumerator, C++ kIsBf16, short tag)
DTYPES = {
    "float16": ("PORTATTN_FP16", "false", "fp16"),
    "bfloat16": ("PORTATTN_BF16", "true", "bf16"),
}

REGISTERS_PER_SIMD_LANE = 512  # CDNA2/3: unified VGPR + AGPR file
REGISTER_GRANULE = 8
LDS_BYTES_PER_CU = 65536
LDS_PAD = 4  # kLdsPad in csrc/tiles.h
ROWDOT_WAVES_PER_SIMD = 4  # bwd_rowdot_kernel's launch bounds
DECODE_WAVES = 4  # waves per decode workgroup (DecodeTile::kWaves); each takes 16 keys of a stage
DECODE_ROWS = 16  # packed query rows per decode workgroup (one 16x16x16 MFMA tile)
COMBINE_WAVES_PER_SIMD = 2  # decode_combine_kernel's launch bounds
APPEND_WAVES_PER_SIMD = 1  # kvcache_append_kernel's launch bounds


@dataclass(frozen=True)
class KernelTile:
    """One kernel's tile: `kernel` names its template in csrc (fwd_kernel, bwd_dq_kernel, ...).

    block: keys per block (fwd, bwd_dq), queries per block (bwd_dkdv), keys per
    stage of the whole workgroup (decode).
    waves_per_simd: designed occupancy; the kernel is compiled with
    amdgpu_waves_per_eu(this) and the ISA test holds VGPR+AGPR to the matching budget.
    """

    kernel: str
    head_dim: int
    block: int
    waves_per_simd: int
    # Next block's global reads in flight (registers) while this one computes;
    # costs 2 x block x head_dim / 128 VGPRs, so only where the budget has room.
    prefetch: bool = False

    @property
    def register_budget(self) -> int:
        """Most VGPR+AGPR per lane that still allows `waves_per_simd`."""
        per_wave = REGISTERS_PER_SIMD_LANE // self.waves_per_simd
        return per_wave - per_wave % REGISTER_GRANULE

    @property
    def lds_bytes(self) -> int:
        rows = self.block * (self.head_dim + LDS_PAD)  # a row-major tile of `block` rows
        if self.kernel == "fwd":  # K, V^T
            return 2 * (rows + self.head_dim * (self.block + LDS_PAD))
        if self.kernel == "bwd_dq":  # K, V, K^T
            return 2 * (2 * rows + self.head_dim * (self.block + LDS_PAD))
        if self.kernel == "bwd_dkdv":  # Q, dO, fp32 LSE and rowsum(dO * O) per query
            return 2 * 2 * rows + 2 * 4 * self.block
        if self.kernel == "decode":  # the waves' merge: fp32 O of waves 1.. (padded rows), LSE of all
            return 4 * ((DECODE_WAVES - 1) * DECODE_ROWS * (self.head_dim + LDS_PAD) + DECODE_WAVES * DECODE_ROWS)
        return 0

    @property
    def mfma_shape(self) -> str:
        """MxNxK of the kernel's MFMA instruction (Note [portattn MFMA layout] in csrc/cdna.h)."""
        return "16x16x16" if self.kernel == "decode" else "32x32x8"

    @property
    def dim_split(self) -> int:
        """Workgroups sharing one block, each owning a slice of the head dim (kDimSplit)."""
        return 2 if self.kernel in ("bwd_dq", "bwd_dkdv") and self.head_dim > 128 else 1

    @property
    def mfma_per_iteration(self) -> int:
        """MFMAs (of mfma_shape) per wave per block of the kernel's loop."""
        if self.kernel == "decode":  # S^T = K Q^T and O^T += V^T P^T, D / 16 steps each
            return 2 * self.head_dim // 16
        tiles, steps = self.block // 32, self.block // 8
        dim_steps, out_tiles = self.head_dim // 8, self.head_dim // self.dim_split // 32
        per_product = {"fwd": (1, 1), "bwd_dq": (2, 1), "bwd_dkdv": (2, 2)}.get(self.kernel, (0, 0))
        return per_product[0] * tiles * dim_steps + per_product[1] * out_tiles * steps


@dataclass(frozen=True)
class HeadDimConfig:
    head_dim: int
    fwd: KernelTile
    bwd_dq: KernelTile
    bwd_dkdv: KernelTile
    decode: KernelTile

    @property
    def decode_kernels(self) -> tuple:
        """The decode instantiation's kernels: decode, split combine, cache append."""
        combine = KernelTile("decode_combine", self.head_dim, 0, COMBINE_WAVES_PER_SIMD)
        append = KernelTile("kvcache_append", self.head_dim, 0, APPEND_WAVES_PER_SIMD)
        return (self.decode, combine, append)

    @property
    def kernels(self) -> tuple:
        rowdot = KernelTile("bwd_rowdot", self.head_dim, 0, ROWDOT_WAVES_PER_SIMD)
        return (self.fwd, self.bwd_dq, self.bwd_dkdv, rowdot, *self.decode_kernels)


def _config(head_dim, fwd, bwd_dq, bwd_dkdv, decode) -> HeadDimConfig:
    """(block, waves per SIMD, prefetch) per kernel -> HeadDimConfig."""
    return HeadDimConfig(head_dim, KernelTile("fwd", head_dim, *fwd), KernelTile("bwd_dq", head_dim, *bwd_dq),
                         KernelTile("bwd_dkdv", head_dim, *bwd_dkdv), KernelTile("decode", head_dim, *decode))


# Key blocks of the forward: 64 keys at D=64 amortise the softmax over more
# MFMAs; at D>=128 32 keys keep K + V^T within a third (D=128) of the CU's LDS.
# D=256 needs 35 KiB of LDS, so one workgroup per CU: its registers may use
# the whole file (1 wave per SIMD), which keeps Q (64 VGPRs) and O^T (128)
# resident. The backward's dq kernel holds Q, dO (D/2 VGPRs) and a D x 32 fp32
# accumulator (D/2), its dkdv kernel K, V and two accumulators: at D=128 the
# compiler needs a few more than 256 registers for either (2-4 spills at 2
# waves per SIMD on both archs), so they are designed for one; at D=256 both
# split the output head dim over 2 workgroups (kDimSplit in bwd_kernel.h).
# The decode reads K/V straight into registers (16 keys per wave, 4 waves: 64
# keys per stage) with the next stage prefetched; its LDS is only the waves'
# final merge, which sets the occupancy: 13 / 25 / 49 KiB allow 4 / 2 / 1
# workgroups per CU (decode_kernel.h's docblock).
CONFIGS = (
    _config(64, fwd=(64, 2, True), bwd_dq=(64, 2, False), bwd_dkdv=(32, 2, False), decode=(64, 4, True)),
    _config(128, fwd=(32, 2, True), bwd_dq=(32, 1, True), bwd_dkdv=(32, 1, True), decode=(64, 2, True)),
    _config(256, fwd=(32, 1, False), bwd_dq=(32, 1, True), bwd_dkdv=(32, 1, False), decode=(64, 1, True)),
)

MAX_HEAD_DIM = max(config.head_dim for config in CONFIGS)

for _config_ in CONFIGS:
    for _tile in _config_.kernels:
        if _tile.lds_bytes * _tile.waves_per_simd > LDS_BYTES_PER_CU:
            raise AssertionError(f"{_tile}: LDS cannot hold {_tile.waves_per_simd} workgroups per CU")


@dataclass(frozen=True)
class Variant:
    arch: str
    dtype: str
    config: HeadDimConfig

    def stem(self, direction: str) -> str:
        """Source / object name of the forward ("fwd"), backward ("bwd") or decode instantiation."""
        return f"{direction}_{self.arch}_{DTYPES[self.dtype][2]}_hd{self.config.head_dim}"

    def entry_point(self, direction: str) -> str:
        return f"portattn_rocm_{self.stem(direction)}"


DIRECTIONS = ("fwd", "bwd", "decode")

# The kernels of each direction's instantiation, by KernelTile.kernel.
DIRECTION_KERNELS = {
    "fwd": ("fwd",),
    "bwd": ("bwd_rowdot", "bwd_dq", "bwd_dkdv"),
    "decode": ("decode", "decode_combine", "kvcache_append"),
}


def select(archs, dtypes=None, head_dims=None) -> list[Variant]:
    """The variants a build compiles; `dtypes` / `head_dims` restrict (PORTATTN_DTYPES/HEADDIMS).

    A requested head dim selects the smallest configuration that serves it.
    """
    configs = list(CONFIGS)
    if head_dims:
        wanted = set()
        for head_dim in head_dims:
            serving = [config for config in CONFIGS if config.head_dim >= head_dim]
            if not serving:
                raise ValueError(f"PORTATTN_HEADDIMS: {head_dim} exceeds the ROCm maximum {MAX_HEAD_DIM}")
            wanted.add(serving[0])
        configs = [config for config in CONFIGS if config in wanted]
    names = {name: name for name in DTYPES} | {tag: name for name, (_, _, tag) in DTYPES.items()}
    chosen_dtypes = []
    for dtype in dtypes or DTYPES:
        if dtype.lower() not in names:
            raise ValueError(f"PORTATTN_DTYPES: {dtype!r} is not one of {', '.join(sorted(names))}")
        if names[dtype.lower()] not in chosen_dtypes:
            chosen_dtypes.append(names[dtype.lower()])
    return [Variant(arch, dtype, config) for arch in archs for dtype in chosen_dtypes for config in configs]


def _template(variant: Variant, tile: KernelTile, name: str) -> str:
    is_bf16 = DTYPES[variant.dtype][1]
    return (f"portattn::rocm::{variant.arch}::{name}<{tile.head_dim}, {tile.block}, {is_bf16}, "
            f"{tile.waves_per_simd}, {'true' if tile.prefetch else 'false'}>")


def _budget_line(tile: KernelTile) -> str:
    return (f"// {tile.kernel}: block {tile.block}, LDS {tile.lds_bytes} bytes, {tile.mfma_per_iteration} MFMAs "
            f"per block per wave, {tile.waves_per_simd} wave(s) per SIMD (VGPR+AGPR <= {tile.register_budget})"
            f"{', next block prefetched' if tile.prefetch else ''}.")


def instantiation_source(variant: Variant, direction: str) -> str:
    config = variant.config
    header = (f"// Generated by portattn/backends/rocm/variants.py; do not edit.\n"
              f"// {variant.arch} {variant.dtype} head dim <= {config.head_dim}.\n")
    if direction == "decode":
        tile = _template(variant, config.decode, "DecodeTile")
        return f"""{header}{_budget_line(config.decode)}
// Also the split combine and the cache append (with rotary) for this dtype.
#define PORTATTN_ROCM_ARCH_NS {variant.arch}
#include "decode_kernel.h"

static_assert({tile}::kLdsBytes == {config.decode.lds_bytes}, "variants.py and decode_kernel.h disagree on LDS");
static_assert({tile}::kMfmaPerIter == {config.decode.mfma_per_iteration}, "variants.py and decode_kernel.h disagree");
static_assert({tile}::kStageKeys == {config.decode.block} && {tile}::kBlockM == {DECODE_ROWS} &&
              {tile}::kWaves == {DECODE_WAVES}, "variants.py and decode_kernel.h disagree on the tile");

extern "C" int {variant.entry_point("decode")}(const PortattnDecodeParams* params) {{
  return static_cast<int>(portattn::rocm::{variant.arch}::launch_decode<{tile}>(*params));
}}

extern "C" int {variant.entry_point("append")}(const PortattnAppendParams* params) {{
  return static_cast<int>(portattn::rocm::{variant.arch}::launch_kvcache_append<{tile}>(*params));
}}
"""
    if direction == "fwd":
        fwd = _template(variant, config.fwd, "FwdTile")
        return f"""{header}{_budget_line(config.fwd)}
#define PORTATTN_ROCM_ARCH_NS {variant.arch}
#include "fwd_kernel.h"

static_assert({fwd}::kLdsBytes == {config.fwd.lds_bytes}, "variants.py and fwd_kernel.h disagree on LDS");
static_assert({fwd}::kMfmaPerIter == {config.fwd.mfma_per_iteration}, "variants.py and fwd_kernel.h disagree");

extern "C" int {variant.entry_point("fwd")}(const PortattnFwdParams* params) {{
  return static_cast<int>(portattn::rocm::{variant.arch}::launch_fwd<{fwd}>(*params));
}}
"""
    dq = _template(variant, config.bwd_dq, "BwdDqTile")
    dkdv = _template(variant, config.bwd_dkdv, "BwdDkdvTile")
    return f"""{header}{_budget_line(config.bwd_dq)}
{_budget_line(config.bwd_dkdv)}
#define PORTATTN_ROCM_ARCH_NS {variant.arch}
#include "bwd_kernel.h"

static_assert({dq}::kLdsBytes == {config.bwd_dq.lds_bytes}, "variants.py and bwd_kernel.h disagree on LDS");
static_assert({dq}::kMfmaPerIter == {config.bwd_dq.mfma_per_iteration}, "variants.py and bwd_kernel.h disagree");
static_assert({dkdv}::kLdsBytes == {config.bwd_dkdv.lds_bytes}, "variants.py and bwd_kernel.h disagree on LDS");
static_assert({dkdv}::kMfmaPerIter == {config.bwd_dkdv.mfma_per_iteration}, "variants.py and bwd_kernel.h disagree");

extern "C" int {variant.entry_point("bwd")}(const PortattnBwdParams* params) {{
  return static_cast<int>(portattn::rocm::{variant.arch}::launch_bwd<{dq}, {dkdv}>(*params));
}}
"""


def registry_source(variants: list[Variant], compilers: dict) -> str:
    declarations = "\n".join(
        f'extern "C" int {v.entry_point("fwd")}(const PortattnFwdParams*);\n'
        f'extern "C" int {v.entry_point("bwd")}(const PortattnBwdParams*);\n'
        f'extern "C" int {v.entry_point("decode")}(const PortattnDecodeParams*);\n'
        f'extern "C" int {v.entry_point("append")}(const PortattnAppendParams*);'
        for v in variants
    )
    rows = "\n".join(
        f'    {{"{v.arch}", {DTYPES[v.dtype][0]}, {v.config.head_dim}, &{v.entry_point("fwd")}, '
        f'&{v.entry_point("bwd")}, {v.config.fwd.lds_bytes}, '
        f'{max(v.config.bwd_dq.lds_bytes, v.config.bwd_dkdv.lds_bytes)}, &{v.entry_point("decode")}, '
        f'&{v.entry_point("append")}, {v.config.decode.lds_bytes}, {v.config.decode.block}, '
        f'{DECODE_WAVES * 64}}},'
        for v in variants
    )
    compiler_rows = "\n".join(f'    {{"{arch}", "{_c_escape(text)}"}},' for arch, text in compilers.items())
    return f"""// Generated by portattn/backends/rocm/variants.py; do not edit.
#include "registry.h"

{declarations}

namespace portattn {{
namespace rocm {{
const KernelVariant kVariants[] = {{
{rows}
}};
const int kNumVariants = {len(variants)};
const ArchCompiler kArchCompilers[] = {{
{compiler_rows}
}};
const int kNumArchCompilers = {len(compilers)};
}}  // namespace rocm
}}  // namespace portattn
"""


def _c_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
