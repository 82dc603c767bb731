"""Device memory handed back to torch's caching allocator full of NaN (no skips here:
tests/gpu/conftest.py imports it on every machine)."""
import torch

# Bytes handed back to the caching allocator NaN-filled before each backward: more
# than any test's workspace, and several times an H100's 50 MB L2, so the poisoning
# also leaves the cache cold (the state in which unordered copies were seen to land
# out of order, issue 12 item 7).
POISON_BYTES = 256 << 20
# torch serves requests of at most 1 MiB from a separate pool of 2 MiB segments (a small
# call's workspace lands there): this many 1 MiB blocks poison that pool too.
_SMALL_BLOCKS = 32
# 0x7FFF7FFF is NaN read as fp32 and, per half, as fp16 and bf16.
_POISON_WORD = 0x7FFF7FFF


def poison_free_memory(nbytes: int = POISON_BYTES) -> None:
    """Fill `nbytes` of device memory with NaN and free it to torch's caching allocator.

    The next allocations (a backward's workspace, torch.empty outputs) are then cut
    from memory that holds NaN in every dtype instead of whatever a fresh cudaMalloc
    or an earlier test left, so a kernel that reads scratch it never wrote (or
    accumulates into scratch nobody zeroed) produces NaN, which the tests catch.
    """
    small = [torch.full(((1 << 20) // 4,), _POISON_WORD, dtype=torch.int32, device="cuda")
             for _ in range(_SMALL_BLOCKS)]
    torch.full((nbytes // 4,), _POISON_WORD, dtype=torch.int32, device="cuda")
    del small
