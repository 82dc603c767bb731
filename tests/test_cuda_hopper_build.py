"""CPU-side tests of the Hopper path's build rule (variants.py / build.py): csrc/hopper_*.cu
are compiled, for sm_90a only, when the archs include sm_90 (PORTATTN_CUDA_HOPPER=0 leaves
them out, =1 forces them), and PORTATTN_WITH_HOPPER is then defined for the binding. Nothing is compiled here: the ninja
steps are captured instead of run."""
from __future__ import annotations

import importlib.util
import os

import pytest

_BUILD_PY = os.path.join(os.path.dirname(__file__), "..", "portattn", "backends", "cuda", "build.py")
_SPEC = importlib.util.spec_from_file_location("_portattn_cuda_build_hopper_test", _BUILD_PY)
build = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(build)
variants = build.variants
HOPPER_GENCODE = "-gencode=arch=compute_90a,code=sm_90a"


def _library_compiles(monkeypatch, tmp_path, env):
    """{source file name: nvcc command} that build_library would run."""
    captured = []
    monkeypatch.setattr(build.ninja_build.NinjaBuild, "run", lambda self, env: captured.append(self))
    monkeypatch.setattr(build, "find_nvcc", lambda env=None: "/usr/local/cuda/bin/nvcc")
    build.build_library(str(tmp_path / "lib.so"), str(tmp_path / "tmp"), env)
    (ninja,) = captured
    return {os.path.basename(step.source): step.command for step in ninja.compiles}


@pytest.mark.parametrize("archs, value", [("80", None), ("80;86", ""), ("90", "0"), ("80;90", "0")])
def test_builds_without_sm90_or_opted_out_leave_the_hopper_sources_out(monkeypatch, tmp_path, archs, value):
    env = {"PORTATTN_CUDA_ARCHS": archs, "PORTATTN_HEADDIMS": "64", "PORTATTN_DTYPES": "bf16"}
    if value is not None:
        env["PORTATTN_CUDA_HOPPER"] = value
    compiles = _library_compiles(monkeypatch, tmp_path, env)
    assert "fwd_entry.cu" in compiles
    assert not any(variants.is_hopper_source(name) for name in compiles)
    assert not any(HOPPER_GENCODE in command for command in compiles.values())


@pytest.mark.parametrize("entry", ["hopper_fwd_entry.cu", "hopper_bwd_entry.cu"])
def test_builds_with_sm90_include_the_hopper_sources(monkeypatch, tmp_path, entry):
    env = {"PORTATTN_CUDA_ARCHS": "80;90", "PORTATTN_HEADDIMS": "64", "PORTATTN_DTYPES": "bf16"}
    compiles = _library_compiles(monkeypatch, tmp_path, env)
    assert [flag for flag in compiles[entry] if flag.startswith("-gencode")] == [HOPPER_GENCODE]


def test_opt_in_compiles_hopper_sources_for_sm90a_only(monkeypatch, tmp_path):
    env = {"PORTATTN_CUDA_ARCHS": "80;90", "PORTATTN_HEADDIMS": "64", "PORTATTN_DTYPES": "bf16",
           "PORTATTN_CUDA_HOPPER": "1"}
    compiles = _library_compiles(monkeypatch, tmp_path, env)
    hopper = {name: cmd for name, cmd in compiles.items() if variants.is_hopper_source(name)}
    assert "hopper_fwd_entry.cu" in hopper
    for command in hopper.values():
        gencodes = [flag for flag in command if flag.startswith("-gencode")]
        assert gencodes == [HOPPER_GENCODE]
    # The other sources keep the plan's arch flags, untouched by the opt-in.
    assert [f for f in compiles["fwd_entry.cu"] if f.startswith("-gencode")] == variants.gencode_flags(
        variants.plan_from_env(env))


def test_opt_in_value_is_checked():
    assert variants.hopper_enabled({"PORTATTN_CUDA_HOPPER": "1", "PORTATTN_CUDA_ARCHS": "80"})
    assert variants.hopper_enabled({})  # the default archs include sm_90
    assert not variants.hopper_enabled({"PORTATTN_CUDA_ARCHS": "80;89"})
    with pytest.raises(ValueError, match="PORTATTN_CUDA_HOPPER"):
        variants.hopper_enabled({"PORTATTN_CUDA_HOPPER": "yes"})


@pytest.mark.parametrize("value, defined", [("1", True), ("0", False)])
def test_binding_sees_the_hopper_define_only_with_the_opt_in(monkeypatch, tmp_path, value, defined):
    pytest.importorskip("pybind11")
    captured = []
    monkeypatch.setattr(build.ninja_build.NinjaBuild, "run", lambda self, env: captured.append(self))
    (tmp_path / build.LIBRARY_NAME).write_bytes(b"")  # build_binding only checks that it exists
    build.build_binding(str(tmp_path / "_C.so"), str(tmp_path / "tmp"), {"PORTATTN_CUDA_HOPPER": value})
    (ninja,) = captured
    (step,) = ninja.compiles
    assert (variants.HOPPER_BINDING_DEFINE in step.command) == defined


class _FakeModule:
    """Records which entry a backward call reached, with bwd()'s argument list."""

    def __init__(self):
        self.calls = []

    def bwd_workspace_bytes(self, *shape_and_deterministic):
        self.calls.append(("bwd_workspace_bytes", shape_and_deterministic))
        return 256

    def bwd(self, *args):
        self.calls.append(("bwd", args))

    def hopper_bwd(self, *args):
        self.calls.append(("hopper_bwd", args))


@pytest.mark.parametrize("deterministic", [False, True])
def test_sm90_backend_backward_calls_hopper_bwd_with_the_shared_workspace(monkeypatch, deterministic):
    torch = pytest.importorskip("torch")
    from portattn.backends import abi
    from portattn.backends.cuda import CudaSm90Backend

    monkeypatch.setattr(abi, "raw_stream", lambda device_index: 0)  # CPU tensors: no stream

    backend = object.__new__(CudaSm90Backend)  # no compiled module on this machine: a fake one
    backend.module = _FakeModule()
    q, k, v, out, dout, dq, dk, dv = (torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16) for _ in range(8))
    lse = torch.zeros(1, 2, 8)
    backend.backward(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=None, cu_seqlens_k=None,
                     max_seqlen_q=0, max_seqlen_k=0, softmax_scale=0.125, window_left=-1, window_right=0,
                     softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0,
                     deterministic=deterministic)
    names = [name for name, _ in backend.module.calls]
    assert names == ["bwd_workspace_bytes", "hopper_bwd"]
    size_query, (_, args) = backend.module.calls
    assert size_query[1][-1] is deterministic
    # bwd()'s layout: dout, its strides, dq, dk, dv (+ strides), workspace, its size, deterministic.
    assert args[0] == dout.data_ptr() and args[9] == 256 and args[10] is deterministic
