"""The ROCm backend (backends/rocm): owned by the ROCm kernel engineer.

Declare a feature in SUPPORTED once the HIP kernels implement it, and an arch
in VERIFIED once the GPU suite passed on that hardware.
"""
from ..archs import ArchRange
from ..declare import ALL_FEATURES, BackendSpec

# Exactly the features the HIP kernels implement: module.cpp's build_config()
# ["features"] lists the same set and tests/test_rocm_isa.py keeps them equal.
# The backward has no atomics, so it is always deterministic. Paged and
# contiguous caches are read in place by the decode kernels (csrc/decode_kernel.h,
# csrc/wmma_decode_kernel.h; the CUDA module's decode ABI). Nothing here has run on AMD hardware: every
# entry is "compiled". FP8 (e4m3) KV caches are read by the same decode kernels
# (decode_kernel<Tile, true>), converted exactly with integer operations on every arch
# (csrc/fp8.h says why not gfx942's native e4m3 "fnuz"); compiled, ISA-checked and
# emulated, never run on AMD hardware.
SUPPORTED = ALL_FEATURES - {"seqused_k"}

# RDNA3/4 (wave32 WMMA): the forward (csrc/wmma_fwd_kernel.h), the backward
# (csrc/wmma_bwd_kernel.h, no atomics: always deterministic) and the decode over
# contiguous and paged caches (csrc/wmma_decode_kernel.h): every feature CDNA
# has. module.cpp's build_config()["features_by_arch"] reports the same and
# tests/test_rocm_isa.py keeps them equal.
RDNA_FEATURES = SUPPORTED

UNSUPPORTED_NOTES = {
    "seqused_k": "runs on the reference backend: the HIP kernels' sequence bounds read seqused_k "
                 "(common/seq_bounds.h), but no emulated test covers it yet",
}

# arch name -> features our GPU suite passed on that hardware.
VERIFIED = {}

# What the 🟡 of an arch rests on where it differs from its family's kernels.
ARCH_NOTES = {
    "gfx950": "the CDNA kernels (forward, backward, decode) built with CDNA4's double-depth MFMAs "
              "(32x32x16, 16x16x32) and, at head dim 256, a 64-key forward block in its 160 KiB of LDS; "
              "compiled (clang-22), ISA-checked and run by a CPU emulation of the documented MFMA layout "
              "(docs/rocm.md), never on an MI350/MI355X",
}

SPEC = BackendSpec(
    name="rocm",
    title="ROCm",
    vendor="amd",
    # One range per built family, not gfx90a-gfx1201: ordering alone would admit gfx90c
    # (a GCN5 APU), gfx1030 (RDNA2, no matrix instructions) and every unbuilt RDNA part.
    archs=(ArchRange("amd", "gfx90a", "gfx90a"), ArchRange("amd", "gfx940", "gfx942"),
           ArchRange("amd", "gfx950", "gfx950"), ArchRange("amd", "gfx1100", "gfx1100"),
           ArchRange("amd", "gfx1201", "gfx1201")),
    arch_note="CDNA2/CDNA3/CDNA4 (gfx90a, gfx942, gfx950); RDNA3 gfx1100 and RDNA4 gfx1201",
    ptx_forward_compatible=False,
    dtypes=("float16", "bfloat16"),
    head_dim_multiple=8,
    head_dim_max=256,
    supported=SUPPORTED,
    arch_features=((ArchRange("amd", "gfx1100", "gfx1100"), RDNA_FEATURES),
                   (ArchRange("amd", "gfx1201", "gfx1201"), RDNA_FEATURES)),
    verified=VERIFIED,
    unsupported_notes=UNSUPPORTED_NOTES,
    arch_notes=ARCH_NOTES,
    build_arch_env="PORTATTN_HIP_ARCHS",
    fallback_when_unbuilt="install with ROCm (hipcc) available to build it",
    implementation="portattn.backends.rocm:RocmBackend",
)
