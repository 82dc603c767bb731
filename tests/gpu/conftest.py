"""GPU tests run on dirty memory: every test starts with the caching allocator's free
memory NaN-filled (tests/gpu/poison.py), so workspaces and outputs a kernel reads
before writing show up as NaN instead of passing on a fresh device's zeros."""
import functools
import re

import pytest


@pytest.fixture(autouse=True)
def _poisoned_free_memory():
    import torch

    if torch.cuda.is_available():
        from poison import poison_free_memory

        poison_free_memory()
    yield


# A restricted build (PORTATTN_HEADDIMS / PORTATTN_DTYPES, README "Fast builds") has kernels for
# some head dims and dtypes only. Its tests of the others skip with the reason instead of failing
# on "no kernel for head_dim ...". A full build is never restricted, so there every such
# failure stays a failure.
@functools.lru_cache(maxsize=None)
def _built():
    """(sm80+ head dims, dtypes, Hopper head dims, Hopper dtypes) of the built backend, or None
    (read once: the autouse fixture below asks for every test)."""
    try:
        from portattn.backends.cuda import _C
    except ImportError:
        return None
    if _C is None:
        return None
    config = _C.build_config()
    hopper = config.get("hopper", {})
    return (tuple(config["head_dims"]), tuple(config["dtypes"]), tuple(hopper.get("head_dims", [])),
            tuple(hopper.get("dtypes", [])))


def _restricted(built) -> bool:
    """Whether the build lacks a head dim or dtype the declarations have (grids.py reads them)."""
    from grids import CUDA_DTYPES, HOPPER_DTYPES

    from portattn.backends.cuda import variants

    sm80_dims, sm80_dtypes, hopper_dims, hopper_dtypes = built
    return (set(sm80_dims) != set(variants.HEAD_DIMS) or set(sm80_dtypes) != set(CUDA_DTYPES)
            or (bool(hopper_dims) and set(hopper_dims) != set(variants.HOPPER_FWD_HEAD_DIMS))
            or (bool(hopper_dtypes) and set(hopper_dtypes) != set(HOPPER_DTYPES)))


def _unserved(module: str, params: dict, built):
    """Why this build cannot run a test with these parameters, or None."""
    sm80_dims, sm80_dtypes, hopper_dims, hopper_dtypes = built
    hopper = "hopper" in module
    dtype = params.get("dtype")
    dtype_name = str(dtype).replace("torch.", "") if dtype is not None else None
    if dtype_name is not None and dtype_name not in (hopper_dtypes if hopper else sm80_dtypes):
        return f"this build has no {dtype_name} kernels (restricted build)"
    head_dim = params.get("head_dim")
    if isinstance(head_dim, int):
        if hopper:
            # (The build reports served head dims, padded ones included: variants.HOPPER_FWD_PADDED.)
            if head_dim not in hopper_dims:
                return f"this build has no Hopper kernel for head dim {head_dim} (restricted build: {hopper_dims})"
        elif not any(b >= head_dim for b in sm80_dims):
            return f"this build has no kernel serving head dim {head_dim} (restricted build: {sm80_dims})"
    return None


@pytest.fixture(autouse=True)
def _skip_what_a_restricted_build_lacks(request):
    callspec = getattr(request.node, "callspec", None)
    built = _built() if callspec is not None else None
    if built is not None and _restricted(built):
        reason = _unserved(request.node.fspath.basename, callspec.params, built)
        if reason:
            pytest.skip(reason)
    yield


_MISSING_KERNEL = re.compile(r"no (?:backward )?kernel for head_dim \d+ dtype \w+ \(built: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In a restricted build, a test that hard-codes a head dim or dtype the build lacks reports
    a skip with the backend's own message (parametrized ones skip before they run, above)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or call.excinfo is None:
        return
    match = _MISSING_KERNEL.search(str(call.excinfo.value))
    built = _built() if match else None
    if built is not None and _restricted(built):
        report.outcome = "skipped"
        report.longrepr = (str(item.fspath), item.location[1] or 0,
                           f"Skipped: restricted build: {str(call.excinfo.value).splitlines()[0]}")
