import os
import sys

import pytest

# Tests import the installed package (with its compiled backends) when it is
# installed; the checkout's tests/ folder holds the shared oracle (naive.py).
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    """GPU tests skip with a reason on machines without a usable GPU (never pass vacuously)."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_selfcheck_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PORTATTN_CACHE_DIR", str(tmp_path / "portattn-cache"))
