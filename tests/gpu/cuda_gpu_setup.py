"""What every CUDA GPU test module shares: the skip rules and the parameter grid.

Importing this module skips the importing test module (with the reason) when there
is no NVIDIA GPU or the CUDA backend is not built, so GPU tests never pass vacuously.
"""
import pytest
import torch

from poison import POISON_BYTES, poison_free_memory  # noqa: F401  (re-exported to the test modules)

cuda_backend = pytest.importorskip("portattn.backends.cuda", reason="portattn CUDA backend not importable")
if cuda_backend._C is None:
    pytest.skip(f"portattn CUDA backend not built: {cuda_backend._IMPORT_ERROR}", allow_module_level=True)
if not torch.cuda.is_available() or torch.version.hip is not None:
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from grids import CUDA_DTYPES, CUDA_HEAD_DIMS, HOPPER_DTYPES, HOPPER_FWD_HEAD_DIMS, HOPPER_HEAD_DIMS  # noqa: E402,F401

BACKEND = cuda_backend.CudaBackend()
# From the spec and the variant table (tests/gpu/grids.py): instantiated head dims plus ones
# served by a larger variant with a masked tail.
DTYPES = [getattr(torch, name) for name in CUDA_DTYPES]
HEAD_DIMS = CUDA_HEAD_DIMS
HOPPER_DTYPES = [getattr(torch, name) for name in HOPPER_DTYPES]  # capability/specs/cuda_sm90.py
SEQLENS = [(1, 1), (17, 113), (113, 17), (1000, 1000), (1, 4097), (4097, 1000)]


def skip_unless_hopper(symbol):
    """Skips the calling test module unless `_C` has the sm_90a entry `symbol` and this GPU is sm_90."""
    if not hasattr(cuda_backend._C, symbol):
        pytest.skip("the CUDA backend was built without the Hopper path (sm_90 not among its archs)",
                    allow_module_level=True)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"the Hopper kernels are built for sm_90a only; this GPU is sm_"
                    f"{''.join(map(str, torch.cuda.get_device_capability()))}", allow_module_level=True)
    own = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", 0)
    if 0 < cuda_backend._C.smem_cap() < own:
        pytest.skip(f"PORTATTN_MAX_SMEM_KIB caps shared memory below this GPU's {own // 1024} KiB, which the "
                    f"Hopper kernels are sized for (capability/specs/cuda_sm90.py)", allow_module_level=True)


def rand(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def grid_inputs(dtype, head_dim, seqlens):
    """Fresh random q, k, v for one point of the (dtype, head dim, seqlens) grid; long
    sequences get a smaller batch so the float64 oracle stays affordable."""
    seqlen_q, seqlen_k = seqlens
    batch, heads = (2, 3) if seqlen_q * seqlen_k < 2**20 else (1, 2)
    return (rand(batch, seqlen_q, heads, head_dim, dtype=dtype),
            rand(batch, seqlen_k, heads, head_dim, dtype=dtype),
            rand(batch, seqlen_k, heads, head_dim, dtype=dtype))
