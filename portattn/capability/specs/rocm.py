"""The ROCm backend (backends/rocm): owned by the ROCm kernel engineer.

Declare a feature in SUPPORTED once the HIP kernels implement it, and an arch
in VERIFIED once the GPU suite passed on that hardware.
"""
from ..archs import ArchRange
from ..declare import BackendSpec

SUPPORTED = frozenset()

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
    build_arch_env="PORTATTN_HIP_ARCHS",
    fallback_when_unbuilt="install with ROCm (hipcc) available to build it",
)
