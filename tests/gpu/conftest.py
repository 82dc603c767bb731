"""GPU tests run on dirty memory: every test starts with the caching allocator's free
memory NaN-filled (tests/gpu/poison.py), so workspaces and outputs a kernel reads
before writing show up as NaN instead of passing on a fresh device's zeros."""
import pytest


@pytest.fixture(autouse=True)
def _poisoned_free_memory():
    import torch

    if torch.cuda.is_available():
        from poison import poison_free_memory

        poison_free_memory()
    yield
