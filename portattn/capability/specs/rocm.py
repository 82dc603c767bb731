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
# the CUDA module's decode ABI). Nothing here has run on AMD hardware: every
# entry is "compiled".
SUPPORTED = ALL_FEATURES

UNSUPPORTED_NOTES = {}

# arch name -> features our GPU suite passed on that hardware.
VERIFIED = {}

SPEC = BackendSpec(
    name="rocm",
    title="ROCm",
    vendor="amd",
    # Two ranges, not gfx90a-gfx942: ordering alone would admit gfx90c (a GCN5 APU).
    archs=(ArchRange("amd", "gfx90a", "gfx90a"), ArchRange("amd", "gfx940", "gfx942")),
    arch_note="CDNA2/CDNA3; RDNA is not supported",
    ptx_forward_compatible=False,
    dtypes=("float16", "bfloat16"),
    head_dim_multiple=8,
    head_dim_max=256,
    supported=SUPPORTED,
    verified=VERIFIED,
    unsupported_notes=UNSUPPORTED_NOTES,
    build_arch_env="PORTATTN_HIP_ARCHS",
    fallback_when_unbuilt="install with ROCm (hipcc) available to build it",
    implementation="portattn.backends.rocm:RocmBackend",
)
