"""The CUDA backend (backends/cuda): owned by the CUDA kernel engineer.

Add an arch name to VERIFIED (with the features tests/gpu passed there) only
after the GPU suite ran green on that hardware.
"""
from ..archs import ArchRange
from ..declare import ALL_FEATURES, BackendSpec, ResourceRule

# The kernels do not read paged caches: kvcache.py gathers them into a packed varlen call first.
SUPPORTED = ALL_FEATURES - {"paged_kv"}

# arch name -> features our GPU suite passed on that hardware.
# sm90 (H100 80GB HBM3, 2026-11-21): tests/gpu/test_cuda_forward.py, 568 passed
# (bench/results/cuda_forward_tests.md). Backward features join after its suite.
VERIFIED = {
    "sm90": frozenset({"forward", "causal", "window", "softcap", "alibi", "dropout", "gqa", "varlen"}),
}

# The backward kernel for head dims above 192 keeps K, V, dK and dV tiles
# resident in shared memory; the kernel engineer sets the bytes its tile
# configuration needs. Parts with 99 KiB opt-in (sm86/sm89/sm120) fall back.
BWD_LARGE_HEADDIM = 192
BWD_LARGE_HEADDIM_SMEM = 144 * 1024

SPEC = BackendSpec(
    name="cuda",
    title="CUDA",
    vendor="nvidia",
    archs=(ArchRange("nvidia", "sm80"),),
    arch_note="Ampere and newer",
    ptx_forward_compatible=True,
    dtypes=("float16", "bfloat16"),
    head_dim_multiple=8,
    head_dim_max=256,
    supported=SUPPORTED,
    verified=VERIFIED,
    resource_rules=(
        ResourceRule(
            features=("backward",),
            head_dim_above=BWD_LARGE_HEADDIM,
            min_smem_optin=BWD_LARGE_HEADDIM_SMEM,
            why="backward tiles for large head dims",
        ),
    ),
    unsupported_notes={"paged_kv": "is gathered into a packed varlen call first (an O(cached tokens) copy)"},
    build_arch_env="PORTATTN_CUDA_ARCHS",
    fallback_when_unbuilt="install with nvcc available (CUDA_HOME) to build it",
)
