"""The CUDA backend (backends/cuda): owned by the CUDA kernel engineer.

Add an arch name to VERIFIED (with the features tests/gpu passed there) only
after the GPU suite ran green on that hardware.
"""
from ..archs import ArchRange
from ..declare import ALL_FEATURES, BackendSpec, ResourceRule

# Paged caches are read in place by the decode kernels (csrc/decode_*; portattn/decode.py
# routes flash_attn_with_kvcache and short-query calls there); a long-query varlen call
# with block_table is gathered into a packed varlen call first. FP8 (e4m3) caches are read by
# the decode_fp8 kernels (Note [portattn fp8 kv cache] in common/params.h): not yet run on a
# GPU, so "compiled" (tests/gpu/test_cuda_decode_fp8.py is their suite).
SUPPORTED = ALL_FEATURES

# arch name -> features our GPU suite passed on that hardware.
VERIFIED = {
    # sm90 (H100 80GB HBM3): the forward suite (tests/gpu/test_cuda_forward.py, 568 passed,
    # archive:2026-11-21-9ba93e8/cuda_forward_tests.md) and the forward and backward suites
    # (archive:2026-11-21-0a4116c/summary.md).
    "sm90": frozenset({"forward", "backward", "deterministic_backward", "causal", "window", "softcap",
                       "alibi", "dropout", "gqa", "varlen",
                       # the decode kernels: tests/gpu/test_cuda_decode.py, H100, 2026-11-24
                       # (bench/results: gpu_suite run of 56c1cd6, 2676 GPU tests passed)
                       "decode", "paged_kv"}),
}

# Shared memory per block that the forward tiles need above 192 (measured from
# the kernels' own budget functions, portattn_cuda_fwd_smem_bytes: 96 KiB at
# hd192, 112 KiB at hd224, 128 KiB at hd256). Parts with 99 KiB of opt-in
# shared memory (sm86, sm89, sm120) run those head dims on another backend.
# The backward needs at most 88.5 KiB at any head dim (every sm80+ part has it),
# so it needs no rule. With the module built, its build_config()["smem_bytes"]
# gives the exact per-head-dim numbers and takes precedence over these.
FWD_HEADDIM_SMEM = ((192, 112 * 1024), (224, 128 * 1024))

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
    resource_rules=tuple(
        ResourceRule(
            features=("forward",),
            head_dim_above=above,
            min_smem_optin=need,
            why="forward tiles for large head dims",
        )
        for above, need in FWD_HEADDIM_SMEM
    ),
    unsupported_notes={},
    build_arch_env="PORTATTN_CUDA_ARCHS",
    fallback_when_unbuilt="install with nvcc available (CUDA_HOME) to build it",
    implementation="portattn.backends.cuda:CudaBackend",
)
