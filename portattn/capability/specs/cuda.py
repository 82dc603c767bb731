"""The CUDA backend (backends/cuda): owned by the CUDA kernel engineer.

Add an arch name to VERIFIED (with the features tests/gpu passed there) only
after the GPU suite ran green on that hardware.
"""
from ..archs import ArchRange
from ..declare import ALL_FEATURES, BackendSpec, BudgetVerification, ResourceRule

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
                       "decode", "paged_kv",
                       # tests/gpu/test_serving_surface_gpu.py (varlen forward and backward, paged), H100
                       "seqused_k",
                       # tests/gpu/test_cuda_decode_fp8.py (408 passed), H100
                       "fp8_kv"}),
}

# Features whose GPU suite passed on one arch's hardware under another part's shared-memory
# budget (PORTATTN_MAX_SMEM_KIB, capability/smem_cap.py): the tile configurations those parts
# run, compiled for the hardware's arch. Status "verified-at-budget" on the parts' archs
# (Note [support status] in declare.py); a part's own arch still self-checks on first use.
# Add an entry only after tests/gpu ran green under that cap. The suites
# tests/gpu/test_cuda_{forward,backward,decode,decode_fp8,smem_budget}.py and
# test_serving_surface_gpu.py on an H100 under each budget: 2895 passed at 99 KiB and at 163 KiB.
# The backward's full-head-dim kernel from head dim 64 up (the default, Note [portattn sm80 wide
# backward]) and its blocked dQ (Note [portattn sm80 blocked dQ]): test_cuda_backward.py,
# test_cuda_smem_budget.py and test_adversarial_bounds.py on an H200, 2773 passed uncapped and 2547
# at 99 KiB (the sm_90a cases skip under a cap; 2743 at 163 KiB before the hd64 tiles, whose 163 KiB
# tile is the uncapped one); its smallest tiles need more than bwd_kernel's below (88320 B at hd256,
# 98816 at hd160, 99328 at hd64, 132096 at hd96), and under a budget below them bwd_kernel runs, so
# these needs stay bwd_kernel's.
# (The one case that failed then, a sinks gradient, was the test's error base, tests/error_rule.py
# assert_sink_grad; the sinks tests pass under both budgets.)
_AT_BUDGET_FEATURES = frozenset({"forward", "backward", "deterministic_backward", "causal", "window", "softcap",
                                 "alibi", "dropout", "gqa", "varlen", "decode", "paged_kv", "seqused_k",
                                 "fp8_kv"})
VERIFIED_AT_BUDGET = (
    BudgetVerification(archs=("sm86", "sm89", "sm120", "sm121"), budget_kib=99, hardware="sm90",
                       features=_AT_BUDGET_FEATURES, evidence="the GPU suites above under PORTATTN_MAX_SMEM_KIB=99"),
    BudgetVerification(archs=("sm80",), budget_kib=163, hardware="sm90",
                       features=_AT_BUDGET_FEATURES, evidence="the GPU suites above under PORTATTN_MAX_SMEM_KIB=163"),
)

# Opt-in shared memory per block (bytes) of the smallest tile of each kernel family per
# instantiated head dim: the numbers the kernels' own budgets give (fwd_kernel.cuh
# FwdConfigsFor, bwd_launch.cuh BwdConfigsFor, decode_kernel.cuh DecodeTileConfig; a built
# module reports them in build_config()["smem_bytes"], which takes precedence, and
# tests/test_smem_cap.py checks these against it). Every sm80+ part offers 99 KiB or more, so
# none of them falls back: the largest need is 96 KiB (the forward at 192 and 256, where 256 runs
# the 64 x 64 tile on 99 KiB parts, and the decode kernels); the backward's is 88.5 KiB (96, 160).
# A smaller budget (PORTATTN_MAX_SMEM_KIB) sends what does not fit to another backend.
_KIB = 1024
SMEM_BYTES = {
    "forward": {32: 24 * _KIB, 64: 48 * _KIB, 96: 48 * _KIB, 128: 64 * _KIB, 160: 80 * _KIB,
                192: 96 * _KIB, 224: 84 * _KIB, 256: 96 * _KIB},
    "backward": {32: 50176, 64: 82944, 96: 90624, 128: 74240, 160: 90624, 192: 78080, 224: 90368,
                 256: 85248},
    "decode": {32: 48 * _KIB, 64: 96 * _KIB, 96: 72 * _KIB, 128: 96 * _KIB, 160: 60 * _KIB,
               192: 72 * _KIB, 224: 84 * _KIB, 256: 96 * _KIB},
}
_WHY = {"forward": "the forward's smallest tile", "backward": "the backward's smallest tile",
        "decode": "the decode kernel's stages"}


def _steps(feature):
    """One rule per instantiated head dim: a call is served by the smallest one >= its own."""
    dims = sorted(SMEM_BYTES[feature])
    return tuple(ResourceRule(features=(feature,), head_dim_above=above, min_smem_optin=SMEM_BYTES[feature][dim],
                              why=f"{_WHY[feature]} at head dim {dim}")
                 for above, dim in zip([0] + dims[:-1], dims))


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
    verified_at_budget=VERIFIED_AT_BUDGET,
    resource_rules=tuple(rule for feature in SMEM_BYTES for rule in _steps(feature)),
    unsupported_notes={},
    build_arch_env="PORTATTN_CUDA_ARCHS",
    fallback_when_unbuilt="install with nvcc available (CUDA_HOME) to build it",
    implementation="portattn.backends.cuda:CudaBackend",
)
