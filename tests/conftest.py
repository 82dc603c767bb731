import os
import sys

import pytest

# Tests import the installed package (with its compiled backends) when it is
# installed; the checkout's tests/ folder holds the shared oracle (naive.py).
sys.path.insert(0, os.path.dirname(__file__))


# The families of the ROCm emulation (tests/test_rocm_emulated.py): each builds its own
# emulated module (minutes of one clang process each), so each is a group of its own.
_EMU_FAMILIES = ("emu_gfx11", "emu_gfx12", "emu")


def _xdist_group(item) -> str:
    """The worker group of a test under `pytest -n 2 --dist loadgroup` (README's command): its
    file, so module-scoped fixtures (compiled drivers, models) are built once; the ROCm
    emulation's tests split further by the family they build, so the three builds run on
    both workers instead of one."""
    name = os.path.basename(str(item.fspath))
    if name == "test_rocm_emulated.py":
        params = getattr(getattr(item, "callspec", None), "params", {})
        family = next((value for value in params.values() if value in _EMU_FAMILIES), "emu")
        return f"{name}:{family}"
    return name


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the groups
def pytest_collection_modifyitems(config, items):
    """GPU tests skip with a reason on machines without a usable GPU (never pass vacuously).
    Every test gets its xdist group (_xdist_group)."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_xdist_group(item)))
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


@pytest.fixture
def sm_margin_seen(monkeypatch):
    """A list that collects (method, sm_margin) for every forward/backward call the reference
    backend receives."""
    from portattn import dispatch

    reference = dispatch.get_backend("reference")
    seen = []
    for method in ("forward", "backward"):
        original = getattr(reference, method)
        monkeypatch.setattr(reference, method,
                            lambda *a, _m=method, _o=original, **kw: seen.append((_m, kw["sm_margin"])) or _o(*a, **kw))
    return seen
