"""The Hopper path of the CUDA backend (csrc/hopper_*: TMA + wgmma, sm_90a), forward and backward.

Dispatch tries it before the sm80+ path; every call it does not declare here
(ALiBi, dropout, seqused_k, other head dims) goes to the sm80+ path
("cuda"), never silently served differently. The kernel is built
for sm_90a only: wgmma and setmaxnreg are arch-specific, so no newer GPU runs it.
"""
from ..archs import ArchRange
from ..declare import BackendSpec, ResourceRule

SUPPORTED = frozenset({"forward", "backward", "deterministic_backward", "causal", "gqa", "window", "softcap",
                       "varlen"})

# sm90 (H100 80GB HBM3): every feature above passes the GPU suites at every head dim this spec
# serves, with compute-sanitizer memcheck, initcheck and synccheck clean. The suites are
# tests/gpu/test_cuda_hopper_forward.py (every forward schedule, windows, softcap, varlen, calling
# the kernel directly; its dispatch test through the public API) and
# tests/gpu/test_cuda_hopper_backward.py (the backward and its deterministic mode, windows and
# softcap); their grids are this spec's head dims. Evidence, by feature:
#   forward and backward, hd64 / hd128: archive:2026-11-21-76e7159/summary.md (1917 tests);
#   the hd256 forward and the varlen backward: archive:2026-11-24-7b49e7e/summary.md (3181);
#   the hd96 forward: archive:2026-11-24-4a49676/summary.md (3753);
#   the hd96 backward: archive:2026-11-24-4507308/summary.md (4321);
#   the hd256 backward: archive:2026-11-26-27e080f/summary.md (6313);
#   hd192 on its own forward and backward kernels: archive:2026-11-26-81b5fdf/summary.md (751
#   hd192 tests; the whole suite 6291), its 80-key short causal forward:
#   archive:2026-11-26-6e31fc8/summary.md.
VERIFIED = {"sm90": SUPPORTED}

SPEC = BackendSpec(
    name="cuda-sm90",
    title="CUDA Hopper",
    vendor="nvidia",
    archs=(ArchRange("nvidia", "sm90", "sm90"),),
    arch_note="Hopper (sm_90a)",
    ptx_forward_compatible=False,
    dtypes=("float16", "bfloat16"),
    # Exactly the Hopper families' head dims (backends/cuda/variants.HOPPER_FWD_HEAD_DIMS and
    # HOPPER_BWD_HEAD_DIMS; a CPU test checks they agree): the kernels have no masked head-dim
    # tail, so only these are served. The forward has hd192 and hd256 (Notes [portattn hopper
    # hd192] and [portattn hopper hd256]) and hd96 on the hd128 kernel, padded by TMA's zero fill
    # (Note [portattn hopper padded head dims]: 33% more MMA work than a native kernel; measured on
    # an H100 at 1.2-1.5x the sm80+ path's forward, archive:2026-11-24-ee2d963/
    # padded_head_dims.md). The backward serves hd96 the same way, on its hd128 kernel (the sm80+
    # backward at 96 held training at 0.84-0.88x SDPA's FlashAttention-2, while the Hopper backward
    # at 128 runs 1.5-1.8x the sm80+ one), hd256 with the head dim split over two CTAs (Note
    # [portattn hopper split head dim] in csrc/hopper_bwd_kernel.cuh) and hd192 on its own kernel
    # (both column parts in one launch where that kernel compiles without spills) (Note [portattn hopper hd192 backward]): both passes serve every head dim
    # here (forward_only_head_dims would name one that trains elsewhere).
    head_dim_multiple=32,
    head_dim_max=256,
    head_dims_exact=True,
    head_dims=(64, 96, 128, 192, 256),
    supported=SUPPORTED,
    verified=VERIFIED,
    # Every sm90 part offers 227 KiB per block, and the Hopper tiles, stages and schedules are
    # sized for it (hopper_fwd_kernel.cuh / hopper_bwd_kernel.cuh: kSmemLimit). Only a budget
    # lowered by PORTATTN_MAX_SMEM_KIB is smaller: those calls then run on the sm80+ path, as
    # on the part whose budget it stands for.
    resource_rules=(ResourceRule(features=("forward",), head_dim_above=0, min_smem_optin=227 * 1024,
                                 why="the Hopper kernels are sized for sm90's full budget"),),
    unsupported_notes={
        "alibi": "runs on the sm80+ path (cuda)",
        "dropout": "runs on the sm80+ path (cuda)",
        "seqused_k": "runs on the sm80+ path (cuda)",
        "paged_kv": "is read by the sm80+ path's decode kernels (cuda)",
        "decode": "runs on the sm80+ path's decode kernels (cuda)",
        "fp8_kv": "is read by the sm80+ path's decode kernels (cuda)",
    },
    build_arch_env="PORTATTN_CUDA_ARCHS",
    fallback_when_unbuilt="build with sm_90 among PORTATTN_CUDA_ARCHS (the default) to include it",
    implementation="portattn.backends.cuda:CudaSm90Backend",
)
