"""The GPU test grids follow the declarations: every feature a CUDA backend declares has a GPU
test (tests/gpu/grids.py COVERAGE), and the head dims / dtypes tested are the declared ones."""
import ast
import importlib.util
import os

import pytest

from portattn.backends.cuda import variants
from portattn.capability.specs import cuda, cuda_sm90

GPU_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu")


def _grids():
    spec = importlib.util.spec_from_file_location("gpu_grids", os.path.join(GPU_TESTS, "grids.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _test_functions(filename):
    with open(os.path.join(GPU_TESTS, filename)) as handle:
        tree = ast.parse(handle.read())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


@pytest.mark.parametrize("spec", [cuda.SPEC, cuda_sm90.SPEC], ids=lambda s: s.name)
def test_every_declared_feature_has_a_gpu_test(spec):
    coverage = _grids().COVERAGE[spec.name]
    missing = sorted(set(spec.supported) - set(coverage))
    assert not missing, f"{spec.name} declares {missing} but tests/gpu/grids.py COVERAGE names no GPU test for them"
    undeclared = sorted(set(coverage) - set(spec.supported))
    assert not undeclared, f"COVERAGE[{spec.name!r}] lists features the spec does not declare: {undeclared}"
    for feature, entries in coverage.items():
        assert entries, f"{spec.name}: {feature} has an empty entry"
        for entry in entries:
            filename, test = entry.split("::")
            assert test in _test_functions(filename), f"{spec.name}: {feature}: no {test} in tests/gpu/{filename}"


def test_gpu_grids_are_the_declared_head_dims_and_dtypes():
    grids = _grids()
    assert set(variants.HEAD_DIMS) <= set(grids.CUDA_HEAD_DIMS)
    assert all(d % cuda.SPEC.head_dim_multiple == 0 and d <= cuda.SPEC.head_dim_max for d in grids.CUDA_HEAD_DIMS)
    assert set(grids.PADDED_HEAD_DIMS).isdisjoint(variants.HEAD_DIMS)  # they test the masked tail
    assert grids.CUDA_DTYPES == list(cuda.SPEC.dtypes)
    assert grids.HOPPER_FWD_HEAD_DIMS == list(variants.HOPPER_FWD_HEAD_DIMS)
    assert grids.HOPPER_HEAD_DIMS == list(variants.HOPPER_BWD_HEAD_DIMS)  # the backward's grid
    assert grids.HOPPER_DTYPES == list(cuda_sm90.SPEC.dtypes)
