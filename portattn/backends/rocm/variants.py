"""The ROCm backend's variant table (torch-free): one list of tiles x dtypes x archs.

It generates the instantiation sources and their registry (build.py), gives
the support matrix its head dims, and is the ISA test's grid and budget
(tests/test_rocm_isa.py). Head dims between table entries run on the next
larger tile with zero-filled columns, so `MAX_HEAD_DIM` bounds every multiple
of 8 up to it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

# gfx target -> the matrix instructions its kernels use: "mfma" (CDNA2+:
# v_mfma_f32_32x32x8{f16,bf16_1k}, and v_mfma_f32_16x16x16{f16,bf16_1k} in the
# decode kernel; gfx950 keeps both shapes), "wmma11" / "wmma12" (RDNA3 / RDNA4:
# wave32 v_wmma_f32_16x16x16_{f16,bf16}: forward and decode). "emu*" are the CPU
# emulation's pseudo-archs (tests/rocm_emulation), one per family.
ARCH_ISA = {
    "gfx90a": "mfma", "gfx940": "mfma", "gfx941": "mfma", "gfx942": "mfma", "gfx950": "mfma",
    "gfx1100": "wmma11", "gfx1201": "wmma12",
    "emu": "mfma", "emu_gfx950": "mfma", "emu_gfx11": "wmma11", "emu_gfx12": "wmma12",
}
# CDNA4: the 16-bit MFMAs come in double depth too (v_mfma_f32_32x32x16_{f16,bf16},
# v_mfma_f32_16x16x32_{f16,bf16}); the kernels built for these take two shallow
# steps per instruction (Note [portattn MFMA double depth] in csrc/cdna.h).
CDNA4_ARCHS = ("gfx950", "emu_gfx950")
SUPPORTED_ARCHS = tuple(arch for arch in ARCH_ISA if arch.startswith("gfx"))
# Built when no AMD GPU is present and PORTATTN_HIP_ARCHS is unset: MI200, MI300,
# MI350/MI355X, Radeon RX 7900 / PRO W7900, RX 9070.
DEFAULT_ARCHS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201")


def isa_of(arch: str) -> str:
    return ARCH_ISA[arch]


def amd_at_least(arch: str, lowest: str) -> bool:
    """gfx targets compared as ordered (major, minor, stepping), never by name."""
    def key(name: str) -> tuple:
        digits = name[3:]
        return (int(digits[:-2]), int(digits[-2], 16), int(digits[-1], 16))
    return key(arch) >= key(lowest)


# dtype name (torch's) -> (PortattnDtype enumerator, C++ kIsBf16, short tag)
DTYPES = {
    "float16": ("PORTATTN_FP16", "false", "fp16"),
    "bfloat16": ("PORTATTN_BF16", "true", "bf16"),
}

REGISTERS_PER_SIMD_LANE = 512  # CDNA2/3/4: unified VGPR + AGPR file
REGISTER_GRANULE = 8
LDS_BYTES_PER_CU = 65536  # CDNA2/3 (and a workgroup's limit on RDNA)
CDNA4_LDS_BYTES_PER_CU = 163840  # gfx950: 160 KiB, all of it addressable by one workgroup
LDS_PAD = 4  # kLdsPad in csrc/tiles.h
# RDNA3/4 in wave32 (LLVM's model of gfx1100 and gfx1201): 1536 VGPRs per SIMD
# lane, at most 256 addressable by one wave, allocated in granules of 24 (the
# ISA test reads the compiler's occupancy); 64 KiB of LDS per workgroup, 128 KiB
# per WGP, whose 4 SIMDs each run one wave of a 4-wave workgroup.
RDNA_REGISTERS_PER_SIMD_LANE = 1536
RDNA_MAX_VGPRS = 256
RDNA_REGISTER_GRANULE = 24
RDNA_LDS_BYTES_PER_WGP = 131072
WMMA_LDS_PAD = 8  # kWmmaLdsPad in csrc/rdna.h
ROWDOT_WAVES_PER_SIMD = 4  # bwd_rowdot_kernel's launch bounds
DECODE_WAVES = 4  # waves per decode workgroup (DecodeTile::kWaves); each takes 16 keys of a stage
DECODE_ROWS = 16  # packed query rows per decode workgroup (one 16x16x16 MFMA / WMMA tile)
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
    # costs 2 x block x head_dim / 128 VGPRs (CDNA), so only where the budget has room.
    prefetch: bool = False
    isa: str = "mfma"  # ARCH_ISA's family
    # Shallow MFMA steps per instruction: 2 on CDNA4 (kStepsPerMfma in csrc/cdna.h).
    steps_per_mfma: int = 1
    lds_per_cu: int = LDS_BYTES_PER_CU  # kLdsBytesPerCu in csrc/cdna.h

    @property
    def wmma(self) -> bool:
        return self.isa.startswith("wmma")

    @property
    def q_in_lds(self) -> bool:
        """WmmaFwdTile::kQInLds: gfx11's Q operands (D/2 VGPRs), and gfx12's at D > 128, go through LDS."""
        return self.wmma and self.kernel == "fwd" and (self.isa == "wmma11" or self.head_dim > 128)

    @property
    def workgroup_waves(self) -> int:
        """Waves per workgroup: 4, except the RDNA backward at D > 128 (2: wmma_bwd_waves)."""
        if self.wmma and self.kernel in ("bwd_dq", "bwd_dkdv") and self.head_dim > 128:
            return 2
        return 4

    @property
    def wave_size(self) -> int:
        return 32 if self.wmma else 64

    @property
    def register_budget(self) -> int:
        """Most VGPR(+AGPR) per lane that still allows `waves_per_simd`."""
        if self.wmma:
            per_wave = RDNA_REGISTERS_PER_SIMD_LANE // self.waves_per_simd
            return min(RDNA_MAX_VGPRS, per_wave - per_wave % RDNA_REGISTER_GRANULE)
        per_wave = REGISTERS_PER_SIMD_LANE // self.waves_per_simd
        return per_wave - per_wave % REGISTER_GRANULE

    @property
    def lds_bytes(self) -> int:
        if self.wmma:  # K, V^T (and Q where kQInLds) with rows padded by 8
            if self.kernel == "fwd":
                q_rows = 64 if self.q_in_lds else 0
                return 2 * ((self.block + q_rows) * (self.head_dim + WMMA_LDS_PAD)
                            + self.head_dim * (self.block + WMMA_LDS_PAD))
            if self.kernel == "decode":  # Q, K, this workgroup's V^T; after the loop the merge reuses them
                out_dim = self.head_dim // self.dim_split
                stage = 2 * ((DECODE_ROWS + self.block) * (self.head_dim + WMMA_LDS_PAD)
                             + out_dim * (self.block + WMMA_LDS_PAD))
                merge = 4 * ((DECODE_WAVES - 1) * DECODE_ROWS * (out_dim + LDS_PAD) + DECODE_WAVES * DECODE_ROWS)
                return max(stage, merge)
            own_rows = 16 * self.workgroup_waves  # dq: Q, dO; dkdv: K, V (the workgroup's rows)
            out_dim = self.head_dim // self.dim_split  # rows of the transposed block tiles
            padded = self.head_dim + WMMA_LDS_PAD
            if self.kernel == "bwd_dq":  # Q, dO, K, V, this slice of K^T
                return 2 * ((2 * own_rows + 2 * self.block) * padded + out_dim * (self.block + WMMA_LDS_PAD))
            if self.kernel == "bwd_dkdv":  # K, V, Q, dO, this slice of Q^T and dO^T, fp32 LSE and Dr
                return (2 * ((2 * own_rows + 2 * self.block) * padded + 2 * out_dim * (self.block + WMMA_LDS_PAD))
                        + 2 * 4 * self.block)
            return 0
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
        """MxNxK of the kernel's matrix instruction (Note [portattn MFMA layout] in csrc/cdna.h,
        Note [portattn WMMA layout] in csrc/rdna.h)."""
        return self.mfma_shapes[0]

    @property
    def mfma_shapes(self) -> tuple:
        """Every matrix instruction shape the kernel issues: on CDNA4 the double-depth ones
        (Note [portattn MFMA double depth]), and the decode's O^T += V^T P^T stays 16x16x16
        there (16 keys per wave are one shallow step)."""
        if self.kernel == "decode" or self.wmma:
            return ("16x16x32", "16x16x16") if self.steps_per_mfma == 2 else ("16x16x16",)
        return ("32x32x16",) if self.steps_per_mfma == 2 else ("32x32x8",)

    @property
    def static_mfma_count(self) -> int:
        """Matrix instructions in the compiled loop body: mfma_per_iteration, except where
        kQInLds rolls the Q K^T steps (unrolled by 2)."""
        if self.q_in_lds:
            return 2 * (self.block // 16) + self.head_dim // self.dim_split // 16 * (self.block // 16)
        if self.wmma and self.kernel == "decode":  # S^T's D / 16 steps unrolled by 2, then O^T's tiles
            return 2 + self.head_dim // self.dim_split // 16
        if self.wmma and self.kernel in ("bwd_dq", "bwd_dkdv"):
            # S and dP steps unrolled by 2 (dq) or rolled (dkdv) per tile, then the output products.
            tiles, out_tiles = self.block // 16, self.head_dim // self.dim_split // 16
            if self.kernel == "bwd_dq":
                return 2 * 2 * tiles + out_tiles * tiles
            return 2 * tiles + 2 * out_tiles * tiles
        return self.mfma_per_iteration

    @property
    def dim_split(self) -> int:
        """Workgroups sharing one block, each owning a slice of the head dim (kDimSplit)."""
        if self.wmma:
            if self.kernel == "bwd_dkdv" and self.head_dim > 128:  # 64 columns each: wmma_bwd_kernel.h
                return 4
            return 2 if self.kernel in ("fwd", "decode", "bwd_dq") and self.head_dim > 128 else 1
        return 2 if self.kernel in ("bwd_dq", "bwd_dkdv") and self.head_dim > 128 else 1

    @property
    def mfma_per_iteration(self) -> int:
        """Matrix instructions (of mfma_shape) per wave per block of the kernel's loop."""
        if self.wmma:
            if self.kernel == "decode":  # one 16-key tile per wave: S^T's D / 16 steps, O^T's D' / 16 tiles
                return (self.head_dim + self.head_dim // self.dim_split) // 16
            tiles, dim_steps, out_tiles = self.block // 16, self.head_dim // 16, self.head_dim // self.dim_split // 16
            if self.kernel in ("bwd_dq", "bwd_dkdv"):  # S and dP; dQ^T, or dK^T and dV^T
                return 2 * tiles * dim_steps + (1 if self.kernel == "bwd_dq" else 2) * out_tiles * tiles
            if self.kernel != "fwd":
                return 0
            key_tiles = tiles
            return key_tiles * dim_steps + self.head_dim // self.dim_split // 16 * key_tiles
        if self.kernel == "decode":  # S^T = K Q^T (D / 16 steps, paired on CDNA4) and O^T += V^T P^T (D / 16)
            return self.head_dim // 16 // self.steps_per_mfma + self.head_dim // 16
        tiles, steps = self.block // 32, self.block // 8
        dim_steps, out_tiles = self.head_dim // 8, self.head_dim // self.dim_split // 32
        per_product = {"fwd": (1, 1), "bwd_dq": (2, 1), "bwd_dkdv": (2, 2)}.get(self.kernel, (0, 0))
        return (per_product[0] * tiles * dim_steps + per_product[1] * out_tiles * steps) // self.steps_per_mfma


@dataclass(frozen=True)
class HeadDimConfig:
    head_dim: int
    fwd: KernelTile
    bwd_dq: Optional[KernelTile] = None  # None: the family has no backward (RDNA)
    bwd_dkdv: Optional[KernelTile] = None
    decode: Optional[KernelTile] = None

    @property
    def directions(self) -> tuple:
        """The instantiations built for this configuration (DIRECTIONS order)."""
        return tuple(d for d, present in (("fwd", True), ("bwd", self.bwd_dq is not None),
                                          ("decode", self.decode is not None)) if present)

    @property
    def decode_kernels(self) -> tuple:
        """The decode instantiation's kernels: decode, split combine, cache append."""
        if self.decode is None:
            return ()
        isa = self.decode.isa
        combine = KernelTile("decode_combine", self.head_dim, 0, COMBINE_WAVES_PER_SIMD, isa=isa)
        append = KernelTile("kvcache_append", self.head_dim, 0, APPEND_WAVES_PER_SIMD, isa=isa)
        return (self.decode, combine, append)

    @property
    def kernels(self) -> tuple:
        if self.bwd_dq is None:
            return (self.fwd, *self.decode_kernels)
        rowdot = KernelTile("bwd_rowdot", self.head_dim, 0, ROWDOT_WAVES_PER_SIMD, isa=self.bwd_dq.isa)
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

# RDNA3/4 (wave32 WMMA): the forward (csrc/wmma_fwd_kernel.h), the backward
# (csrc/wmma_bwd_kernel.h) and the decode (csrc/wmma_decode_kernel.h). The
# occupancy is what the VGPRs (1536 per SIMD lane, <= 256 a wave) and the WGP's
# 128 KiB of LDS allow. The forward at D=256 splits O's columns over 2
# workgroups and, like every gfx11 tile, reads Q from LDS
# (WmmaFwdTile::kQInLds), which takes 16-key blocks at D=256 to stay within
# 64 KiB. The backward stages every operand in LDS (its docblock says why):
# 32 / 61 / 55.5 KiB (dq) and 37 / 55 / 55.6 KiB (dkdv) at D = 64 / 128 / 256,
# the last two with 2-wave workgroups and the output head dim split over 2 (dq)
# and 4 (dkdv); prefetching the dkdv's next query block at D = 128 spills 18
# (gfx1100) / 3 (gfx1201) VGPRs. The
# decode stages Q, K and V^T of a 64-key stage in LDS (20 / 39 / 59 KiB at
# D = 64 / 128 / 256, the last with O's columns split over 2 workgroups), which
# sets its occupancy: 6 / 3 / 2 workgroups per WGP. The next block or stage is
# prefetched into registers where they have room (no spills;
# tests/test_rocm_isa.py).
def _wmma_config(head_dim, fwd, bwd_dq, bwd_dkdv, decode, isa) -> HeadDimConfig:
    return HeadDimConfig(head_dim, KernelTile("fwd", head_dim, *fwd, isa=isa),
                         bwd_dq=KernelTile("bwd_dq", head_dim, *bwd_dq, isa=isa),
                         bwd_dkdv=KernelTile("bwd_dkdv", head_dim, *bwd_dkdv, isa=isa),
                         decode=KernelTile("decode", head_dim, *decode, isa=isa))


# Backward tiles, (block, waves per SIMD, prefetch), the same on both generations.
_RDNA_BWD = {64: ((32, 4, True), (32, 3, True)), 128: ((32, 2, True), (16, 2, False)),
             256: ((16, 1, False), (16, 1, False))}

RDNA_CONFIGS = {
    "wmma11": (
        _wmma_config(64, (32, 6, True), *_RDNA_BWD[64], (64, 6, True), "wmma11"),
        # forward: 36 KiB of LDS, 3 workgroups per WGP
        _wmma_config(128, (32, 3, True), *_RDNA_BWD[128], (64, 3, True), "wmma11"),
        # forward: 53 KiB, 2 workgroups per WGP; decode: prefetching spills 41 VGPRs
        _wmma_config(256, (16, 2, False), *_RDNA_BWD[256], (64, 2, False), "wmma11"),
    ),
    "wmma12": (
        _wmma_config(64, (32, 6, True), *_RDNA_BWD[64], (64, 6, True), "wmma12"),
        # forward: prefetching spills 19 VGPRs
        _wmma_config(128, (32, 6, False), *_RDNA_BWD[128], (64, 3, True), "wmma12"),
        # decode: prefetching spills 23 VGPRs
        _wmma_config(256, (16, 2, True), *_RDNA_BWD[256], (64, 2, False), "wmma12"),
    ),
}

MAX_HEAD_DIM = max(config.head_dim for config in CONFIGS)

for _configs in RDNA_CONFIGS.values():
    assert [c.head_dim for c in _configs] == [c.head_dim for c in CONFIGS], "one head-dim ladder for every arch"
    for _config_ in _configs:
        for _tile in _config_.kernels:
            # A WGP's 4 SIMDs hold waves_per_simd * 4 / workgroup_waves workgroups.
            if _tile.lds_bytes * _tile.waves_per_simd * 4 // _tile.workgroup_waves > RDNA_LDS_BYTES_PER_WGP:
                raise AssertionError(f"{_tile}: LDS cannot hold {_tile.waves_per_simd} waves per SIMD")


# gfx950 (clang-22) runs the CDNA tiles with the double-depth MFMAs (half the
# instructions of every product but the decode's O^T) and 160 KiB of LDS per CU.
# Registers, not LDS, bound every tile's occupancy but one, so the extra LDS
# changes one tile: the D=256 forward takes 64-key blocks (66.5 KiB of LDS, which
# a CDNA3 CU cannot hold; 375 / 365 VGPR+AGPR bf16 / fp16 of its 512, one wave
# per SIMD as before), halving its barriers and softmax passes per key. The D=64
# forward does not prefetch: clang-22 spills 9 VGPRs of the bf16 variant with it
# (256 allocated; 246 without). What else the LDS could buy and why it does not:
# docs/rocm.md, "CDNA4".
def _cdna4(config: HeadDimConfig) -> HeadDimConfig:
    wide = {name: replace(getattr(config, name), steps_per_mfma=2, lds_per_cu=CDNA4_LDS_BYTES_PER_CU)
            for name in ("fwd", "bwd_dq", "bwd_dkdv", "decode")}
    if config.head_dim == 64:
        wide["fwd"] = replace(wide["fwd"], prefetch=False)
    if config.head_dim == 256:
        wide["fwd"] = replace(wide["fwd"], block=64)
    return replace(config, **wide)


CDNA4_CONFIGS = tuple(_cdna4(c) for c in CONFIGS)

for _config_ in CONFIGS + CDNA4_CONFIGS:
    for _tile in _config_.kernels:
        if _tile.lds_bytes * _tile.waves_per_simd > _tile.lds_per_cu:
            raise AssertionError(f"{_tile}: LDS cannot hold {_tile.waves_per_simd} workgroups per CU")


def configs_for(arch: str) -> tuple:
    """The head-dim configurations (tiles) built for `arch`."""
    isa = isa_of(arch)
    if isa == "mfma":
        return CDNA4_CONFIGS if arch in CDNA4_ARCHS else CONFIGS
    return RDNA_CONFIGS[isa]


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

    @property
    def directions(self) -> tuple:
        return self.config.directions


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
    wanted_dims = [config.head_dim for config in CONFIGS]
    if head_dims:
        wanted = set()
        for head_dim in head_dims:
            serving = [config for config in CONFIGS if config.head_dim >= head_dim]
            if not serving:
                raise ValueError(f"PORTATTN_HEADDIMS: {head_dim} exceeds the ROCm maximum {MAX_HEAD_DIM}")
            wanted.add(serving[0].head_dim)
        wanted_dims = [d for d in wanted_dims if d in wanted]
    names = {name: name for name in DTYPES} | {tag: name for name, (_, _, tag) in DTYPES.items()}
    chosen_dtypes = []
    for dtype in dtypes or DTYPES:
        if dtype.lower() not in names:
            raise ValueError(f"PORTATTN_DTYPES: {dtype!r} is not one of {', '.join(sorted(names))}")
        if names[dtype.lower()] not in chosen_dtypes:
            chosen_dtypes.append(names[dtype.lower()])
    return [Variant(arch, dtype, config) for arch in archs for dtype in chosen_dtypes
            for config in configs_for(arch) if config.head_dim in wanted_dims]


def _template(variant: Variant, tile: KernelTile, name: str) -> str:
    is_bf16 = DTYPES[variant.dtype][1]
    if tile.wmma:
        name = "Wmma" + name
    return (f"portattn::rocm::{variant.arch}::{name}<{tile.head_dim}, {tile.block}, {is_bf16}, "
            f"{tile.waves_per_simd}, {'true' if tile.prefetch else 'false'}>")


def _budget_line(tile: KernelTile) -> str:
    unit = "WMMAs" if tile.wmma else "MFMAs" if tile.steps_per_mfma == 1 else f"MFMAs ({' / '.join(tile.mfma_shapes)})"
    return (f"// {tile.kernel}: block {tile.block}, LDS {tile.lds_bytes} bytes, {tile.mfma_per_iteration} {unit} "
            f"per block per wave, {tile.waves_per_simd} wave(s) per SIMD (VGPR+AGPR <= {tile.register_budget})"
            f"{', next block prefetched' if tile.prefetch else ''}.")


def instantiation_source(variant: Variant, direction: str) -> str:
    config = variant.config
    header = (f"// Generated by portattn/backends/rocm/variants.py; do not edit.\n"
              f"// {variant.arch} {variant.dtype} head dim <= {config.head_dim}.\n")
    # The CDNA4 kernels' double-depth MFMAs (csrc/cdna.h); one tile of the instantiation says so for all.
    cdna4 = "#define PORTATTN_ROCM_CDNA4 1\n" if config.fwd.steps_per_mfma == 2 else ""
    if direction == "decode":
        tile = _template(variant, config.decode, "DecodeTile")
        include = cdna4 + '#include "decode_kernel.h"'
        if config.decode.wmma:
            include = f'#define PORTATTN_ROCM_WMMA_GEN {config.decode.isa[4:]}\n#include "wmma_decode_kernel.h"'
        return f"""{header}{_budget_line(config.decode)}
// Also the split combine and the cache append (with rotary) for this dtype.
#define PORTATTN_ROCM_ARCH_NS {variant.arch}
{include}

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
        isa = isa_of(variant.arch)
        include = cdna4 + '#include "fwd_kernel.h"'
        if isa != "mfma":
            include = f'#define PORTATTN_ROCM_WMMA_GEN {isa[4:]}\n#include "wmma_fwd_kernel.h"'
        return f"""{header}{_budget_line(config.fwd)}
#define PORTATTN_ROCM_ARCH_NS {variant.arch}
{include}

static_assert({fwd}::kLdsBytes == {config.fwd.lds_bytes}, "variants.py and fwd_kernel.h disagree on LDS");
static_assert({fwd}::kMfmaPerIter == {config.fwd.mfma_per_iteration}, "variants.py and fwd_kernel.h disagree");

extern "C" int {variant.entry_point("fwd")}(const PortattnFwdParams* params) {{
  return static_cast<int>(portattn::rocm::{variant.arch}::launch_fwd<{fwd}>(*params));
}}
"""
    dq = _template(variant, config.bwd_dq, "BwdDqTile")
    dkdv = _template(variant, config.bwd_dkdv, "BwdDkdvTile")
    include = cdna4 + '#include "bwd_kernel.h"'
    if config.bwd_dq.wmma:
        include = f'#define PORTATTN_ROCM_WMMA_GEN {config.bwd_dq.isa[4:]}\n#include "wmma_bwd_kernel.h"'
    return f"""{header}{_budget_line(config.bwd_dq)}
{_budget_line(config.bwd_dkdv)}
#define PORTATTN_ROCM_ARCH_NS {variant.arch}
{include}

static_assert({dq}::kLdsBytes == {config.bwd_dq.lds_bytes}, "variants.py and bwd_kernel.h disagree on LDS");
static_assert({dq}::kMfmaPerIter == {config.bwd_dq.mfma_per_iteration}, "variants.py and bwd_kernel.h disagree");
static_assert({dkdv}::kLdsBytes == {config.bwd_dkdv.lds_bytes}, "variants.py and bwd_kernel.h disagree on LDS");
static_assert({dkdv}::kMfmaPerIter == {config.bwd_dkdv.mfma_per_iteration}, "variants.py and bwd_kernel.h disagree");

extern "C" int {variant.entry_point("bwd")}(const PortattnBwdParams* params) {{
  return static_cast<int>(portattn::rocm::{variant.arch}::launch_bwd<{dq}, {dkdv}>(*params));
}}
"""


def registry_source(variants: list[Variant], compilers: dict) -> str:
    def entry(v: Variant, direction: str, point: str) -> str:
        return f"&{v.entry_point(point)}" if direction in v.directions else "nullptr"

    declarations = "\n".join(
        "\n".join([f'extern "C" int {v.entry_point("fwd")}(const PortattnFwdParams*);']
                   + ([f'extern "C" int {v.entry_point("bwd")}(const PortattnBwdParams*);']
                      if "bwd" in v.directions else [])
                   + ([f'extern "C" int {v.entry_point("decode")}(const PortattnDecodeParams*);',
                       f'extern "C" int {v.entry_point("append")}(const PortattnAppendParams*);']
                      if "decode" in v.directions else []))
        for v in variants
    )
    rows = "\n".join(
        f'    {{"{v.arch}", {DTYPES[v.dtype][0]}, {v.config.head_dim}, &{v.entry_point("fwd")}, '
        f'{entry(v, "bwd", "bwd")}, {v.config.fwd.lds_bytes}, '
        f'{max(v.config.bwd_dq.lds_bytes, v.config.bwd_dkdv.lds_bytes) if v.config.bwd_dq else 0}, '
        f'{entry(v, "decode", "decode")}, {entry(v, "decode", "append")}, '
        f'{v.config.decode.lds_bytes if v.config.decode else 0}, {v.config.decode.block if v.config.decode else 0}, '
        f'{DECODE_WAVES * v.config.decode.wave_size if v.config.decode else 0}}},'
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
