"""CPU-side tests of the Hopper path's build rule (variants.py / build.py): csrc/hopper_*.cu
and the generated Hopper families (one hopper_<family>_hd<D>_<dtype>.cu per variant of the
plan, and their table) are compiled, for sm_90a only, when the archs include sm_90
(PORTATTN_CUDA_HOPPER=0 leaves them out, =1 forces them), and PORTATTN_WITH_HOPPER is then
defined for the binding. The ninja steps are captured instead of run, except in one test that
compiles one generated Hopper TU, the table and the entry with nvcc (where installed)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

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

    # The binding's parameters (binding.cpp): ordered_dq may come by position or by keyword.
    def bwd_workspace_bytes(self, batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k, deterministic,
                            ordered_dq=False):
        shape_and_deterministic = (batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k, deterministic)
        self.calls.append(("bwd_workspace_bytes", shape_and_deterministic + (("ordered_dq", ordered_dq),)))
        return 512 if ordered_dq else 256

    def bwd(self, *args):
        self.calls.append(("bwd", args))

    def hopper_bwd(self, *args):
        self.calls.append(("hopper_bwd", args))


@pytest.mark.parametrize("deterministic", [False, True])
def test_sm90_backend_backward_calls_hopper_bwd_with_its_own_workspace_size(monkeypatch, deterministic):
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
    assert size_query[1][-2:] == (deterministic, ("ordered_dq", True))  # the Hopper layout
    # bwd()'s layout: dout, its strides, dq, dk, dv (+ strides), workspace, its size, deterministic.
    assert args[0] == dout.data_ptr() and args[9] == 512 and args[10] is deterministic


# ---------------------------------------------------------------------------------------------
# Generated Hopper families (Note [portattn cuda variants])


def _hopper_sources(env):
    """{file name: text} of the generated Hopper files (the table included) for env's plan."""
    sources = variants.generated_sources(variants.plan_from_env(env))
    return {name: text for name, text in sources.items() if variants.is_hopper_source(name)}


def _expected_units(head_dims, dtypes):
    """The generated files for a plan restricted to head_dims: each family keeps its own, one
    file per kernel (hd96 and hd128 share the hd128 forward and backward kernels' files)."""
    return sorted({f"{family.name}_hd{family.kernel_head_dim(d)}_{t}.cu" for family in variants.HOPPER_FAMILIES
                   for d in head_dims if d in family.head_dims for t in dtypes})


def _family(name):
    (family,) = [f for f in variants.HOPPER_FAMILIES if f.name == name]
    return family


def test_hopper_head_dims_are_the_specs():
    from portattn.capability.specs import cuda_sm90

    spec = cuda_sm90.SPEC
    admitted = spec.admitted_head_dims()
    assert admitted == variants.HOPPER_FWD_HEAD_DIMS == _family("hopper_fwd").head_dims
    # The backward serves the admitted head dims minus the forward-only ones, and nothing else.
    both_passes = tuple(d for d in admitted if d not in spec.forward_only_head_dims)
    assert both_passes == variants.HOPPER_BWD_HEAD_DIMS == _family("hopper_bwd").head_dims
    assert set(variants.HOPPER_FWD_HEAD_DIMS) <= set(variants.HEAD_DIMS)  # PORTATTN_HEADDIMS can name them
    assert spec.head_dims_exact  # no masked head-dim tail: a partial build serves only its own
    # Padded serving (Note [portattn hopper padded head dims]): both passes serve 96 on their
    # hd128 kernels (192 has its own: Notes [portattn hopper hd192] and [portattn hopper hd192
    # backward]); each padded kernel is one of its family's own.
    padded = _family("hopper_fwd").padded
    assert padded == variants.HOPPER_FWD_PADDED == {96: 128}
    assert 192 in variants.HOPPER_FWD_KERNEL_HEAD_DIMS
    assert set(padded.values()) <= set(variants.HOPPER_FWD_KERNEL_HEAD_DIMS) <= set(admitted)
    bwd_padded = _family("hopper_bwd").padded
    assert bwd_padded == variants.HOPPER_BWD_PADDED == {96: 128}
    assert 192 in variants.HOPPER_BWD_KERNEL_HEAD_DIMS and variants.hopper_bwd_acc_head_dim(192) == 192
    assert all(variants.hopper_bwd_acc_head_dim(d) == k for d, k in bwd_padded.items())
    assert set(bwd_padded.values()) <= set(variants.HOPPER_BWD_KERNEL_HEAD_DIMS) <= set(both_passes)
    assert set(padded) - set(bwd_padded) <= set(spec.forward_only_head_dims)
    assert tuple(variants.DTYPES[d][2] for d in variants.DTYPES) == spec.dtypes


@pytest.mark.parametrize("head_dim", [192, 256])
def test_hd192_256_train_on_the_hopper_path(head_dim):
    # Both passes at 256 (the backward with the head dim split over two CTAs) and at 192 (its own
    # kernels; the backward in two launches), in the default build.
    from portattn.capability import matrix, probe
    from portattn.capability.callspec import CallSpec

    training = CallSpec("bfloat16", head_dim, head_dim, "cuda", frozenset({"forward", "backward", "causal"}))
    built = variants.plan_from_env({}).build_config()["hopper"]
    assert head_dim in variants.HOPPER_BWD_HEAD_DIMS and head_dim in built["head_dims"]
    assert matrix.check_call("cuda-sm90", probe.fake_device("h100"), training, built) == []


def test_head_dims_without_a_hopper_serving_are_refused():
    from portattn.capability import matrix, probe
    from portattn.capability.callspec import CallSpec

    # 160 is a multiple of 32 below the maximum, but no Hopper kernel serves it (the padded
    # table names 96 and 192 only, not "the smallest kernel >= it").
    hd160 = CallSpec("bfloat16", 160, 160, "cuda", frozenset({"forward"}))
    assert matrix.check_call("cuda-sm90", probe.fake_device("h100"), hd160) == [
        "head_dim 160 is not one of 64, 96, 128, 192, 256 (cuda-sm90 supports head dims 64, 96, 128, 192, 256)"]


def test_default_plan_generates_every_hopper_variant_and_its_tables():
    sources = _hopper_sources({})
    units = sorted(name for name in sources if name != variants.HOPPER_TABLE_SOURCE)
    assert units == _expected_units(variants.HOPPER_HEAD_DIMS, variants.DTYPES)
    unit = sources["hopper_fwd_hd128_bf16.cu"]
    assert unit.startswith("// generated by portattn/backends/cuda/variants.py")
    assert '#include "hopper_fwd_launch.cuh"' in unit
    assert "template cudaError_t portattn::hopper::run_hopper_fwd<128, __nv_bfloat16>(" in unit
    assert "portattn::hopper::run_hopper_bwd<64, __half>(\n    const PortattnBwdParams&);" in sources[
        "hopper_bwd_hd64_fp16.cu"]
    assert "template cudaError_t portattn::hopper::run_hopper_fwd<256, __nv_bfloat16>(" in sources[
        "hopper_fwd_hd256_bf16.cu"]
    # The backward's hd256 kernel splits the head dim over two CTAs (Note [portattn hopper split head dim]).
    assert "template cudaError_t portattn::hopper::run_hopper_bwd<256, __nv_bfloat16>(" in sources[
        "hopper_bwd_hd256_bf16.cu"]
    # hd192 has its own kernels (Notes [portattn hopper hd192], [portattn hopper hd192 backward]).
    assert "template cudaError_t portattn::hopper::run_hopper_fwd<192, __half>(" in sources["hopper_fwd_hd192_fp16.cu"]
    assert "template cudaError_t portattn::hopper::run_hopper_bwd<192, __half>(" in sources["hopper_bwd_hd192_fp16.cu"]
    assert not any("_hd96_" in name for name in sources)  # padded: no kernel of its own
    table = sources[variants.HOPPER_TABLE_SOURCE]
    for family in variants.HOPPER_FAMILIES:
        assert f"const int {family.count} = {2 * len(family.head_dims)};" in table
        for d in family.head_dims:
            kernel = family.kernel_head_dim(d)
            assert f"{{{d}, PORTATTN_BF16, &{family.run_template}<{kernel}, __nv_bfloat16>}}" in table
            assert f"{{{d}, PORTATTN_FP16, &{family.run_template}<{kernel}, __half>}}" in table
    # The served head dim keys the entry; the kernel that serves it is the larger one.
    assert "{96, PORTATTN_BF16, &portattn::hopper::run_hopper_fwd<128, __nv_bfloat16>}" in table
    assert "{192, PORTATTN_FP16, &portattn::hopper::run_hopper_fwd<192, __half>}" in table
    assert "{96, PORTATTN_BF16, &portattn::hopper::run_hopper_bwd<128, __nv_bfloat16>}" in table
    assert "{256, PORTATTN_BF16, &portattn::hopper::run_hopper_bwd<256, __nv_bfloat16>}" in table
    assert "{192, PORTATTN_BF16, &portattn::hopper::run_hopper_bwd<192, __nv_bfloat16>}" in table
    # The sm80+ table stays free of Hopper symbols (it is compiled for every arch).
    assert "hopper" not in variants.generated_sources(variants.plan_from_env({}))["variants_generated.cu"]


@pytest.mark.parametrize(
    "env, head_dims, dtypes",
    [
        ({"PORTATTN_HEADDIMS": "64"}, (64,), ("fp16", "bf16")),
        ({"PORTATTN_HEADDIMS": "32,128,256"}, (128, 256), ("fp16", "bf16")),
        ({"PORTATTN_HEADDIMS": "256", "PORTATTN_DTYPES": "bf16"}, (256,), ("bf16",)),
        ({"PORTATTN_DTYPES": "bf16"}, (64, 96, 128, 192, 256), ("bf16",)),
        ({"PORTATTN_HEADDIMS": "128", "PORTATTN_DTYPES": "fp16"}, (128,), ("fp16",)),
        # Padded head dims build their serving kernel (hd128 / hd256) and serve only themselves.
        ({"PORTATTN_HEADDIMS": "96", "PORTATTN_DTYPES": "bf16"}, (96,), ("bf16",)),
        ({"PORTATTN_HEADDIMS": "96,192", "PORTATTN_DTYPES": "bf16"}, (96, 192), ("bf16",)),
        ({"PORTATTN_HEADDIMS": "64,96,128"}, (64, 96, 128), ("fp16", "bf16")),
    ],
)
def test_restrictions_apply_to_the_hopper_families(env, head_dims, dtypes):
    sources = _hopper_sources(env)
    assert sorted(n for n in sources if n != variants.HOPPER_TABLE_SOURCE) == _expected_units(head_dims, dtypes)
    table = sources[variants.HOPPER_TABLE_SOURCE]
    entries = [line for line in table.splitlines() if "&portattn::hopper::" in line]
    per_family = {f.name: [d for d in head_dims if d in f.head_dims] for f in variants.HOPPER_FAMILIES}
    assert len(entries) == sum(len(dims) for dims in per_family.values()) * len(dtypes)
    for family in variants.HOPPER_FAMILIES:
        assert f"const int {family.count} = {len(per_family[family.name]) * len(dtypes)};" in table
        left_out = set(variants.HOPPER_HEAD_DIMS) - set(per_family[family.name])
        assert not any(f"{{{d}, " in line for d in left_out for line in entries if family.run_template in line)
    assert variants.plan_from_env(env).build_config()["hopper"] == {
        "archs": ["sm_90a"], "head_dims": list(head_dims), "dtypes": [variants.DTYPES[d][2] for d in dtypes]}


def test_a_padded_head_dim_builds_the_kernel_that_serves_it(monkeypatch, tmp_path):
    env = {"PORTATTN_CUDA_ARCHS": "90", "PORTATTN_HEADDIMS": "96", "PORTATTN_DTYPES": "bf16"}
    sources = _hopper_sources(env)
    assert sorted(sources) == ["hopper_bwd_hd128_bf16.cu", "hopper_fwd_hd128_bf16.cu", variants.HOPPER_TABLE_SOURCE]
    assert "run_hopper_fwd<128, __nv_bfloat16>(" in sources["hopper_fwd_hd128_bf16.cu"]
    assert "run_hopper_bwd<128, __nv_bfloat16>(" in sources["hopper_bwd_hd128_bf16.cu"]
    table = sources[variants.HOPPER_TABLE_SOURCE]
    # Both passes serve 96, and only 96: the hd128 kernels are built but 128 is not claimed.
    assert "const int kNumHopperFwdVariants = 1;" in table and "const int kNumHopperBwdVariants = 1;" in table
    assert "{96, PORTATTN_BF16, &portattn::hopper::run_hopper_bwd<128, __nv_bfloat16>}" in table
    assert "{128, " not in table
    compiles = _library_compiles(monkeypatch, tmp_path, env)
    assert {"hopper_fwd_hd128_bf16.cu", "hopper_bwd_hd128_bf16.cu", "fwd_hd96_bf16.cu"} <= set(compiles)  # + sm80+ hd96
    # 96 and 128 together share the one hd128 file per family; the table has an entry for each.
    both = _hopper_sources(dict(env, PORTATTN_HEADDIMS="96,128"))
    assert [n for n in sorted(both) if n.startswith("hopper_fwd_")] == ["hopper_fwd_hd128_bf16.cu"]
    assert [n for n in sorted(both) if n.startswith("hopper_bwd_")] == ["hopper_bwd_hd128_bf16.cu"]
    table = both[variants.HOPPER_TABLE_SOURCE]
    for family in ("fwd", "bwd"):
        assert "{96, PORTATTN_BF16, &portattn::hopper::run_hopper_%s<128" % family in table
        assert "{128, PORTATTN_BF16, &portattn::hopper::run_hopper_%s<128" % family in table
    # 192 builds its own kernels, and serves 192 only.
    only192 = _hopper_sources(dict(env, PORTATTN_HEADDIMS="192"))
    assert sorted(only192) == ["hopper_bwd_hd192_bf16.cu", "hopper_fwd_hd192_bf16.cu", variants.HOPPER_TABLE_SOURCE]
    assert "const int kNumHopperBwdVariants = 1;" in only192[variants.HOPPER_TABLE_SOURCE]
    assert "{192, PORTATTN_BF16, &portattn::hopper::run_hopper_bwd<192, __nv_bfloat16>}" in only192[
        variants.HOPPER_TABLE_SOURCE]


def test_a_plan_without_hopper_head_dims_builds_empty_tables(monkeypatch, tmp_path):
    env = {"PORTATTN_CUDA_ARCHS": "80;90", "PORTATTN_HEADDIMS": "32,160"}
    sources = _hopper_sources(env)
    assert list(sources) == [variants.HOPPER_TABLE_SOURCE]
    table = sources[variants.HOPPER_TABLE_SOURCE]
    for family in variants.HOPPER_FAMILIES:
        assert f"const int {family.count} = 0;" in table  # the entries report "built: none"
    assert variants.plan_from_env(env).build_config()["hopper"]["head_dims"] == []
    # The entries are still built (they answer every call with that reason).
    compiles = _library_compiles(monkeypatch, tmp_path, env)
    assert {"hopper_fwd_entry.cu", "hopper_bwd_entry.cu", variants.HOPPER_TABLE_SOURCE} <= set(compiles)


def test_generated_hopper_sources_compile_for_sm90a_only(monkeypatch, tmp_path):
    env = {"PORTATTN_CUDA_ARCHS": "80;90", "PORTATTN_HEADDIMS": "64", "PORTATTN_DTYPES": "bf16"}
    compiles = _library_compiles(monkeypatch, tmp_path, env)
    generated = _expected_units((64,), ("bf16",)) + [variants.HOPPER_TABLE_SOURCE]
    for name in generated:
        assert [flag for flag in compiles[name] if flag.startswith("-gencode")] == [HOPPER_GENCODE], name
    for name in ("fwd_hd64_bf16.cu", "variants_generated.cu"):
        assert HOPPER_GENCODE not in compiles[name]
    # Opted out: no generated Hopper file either.
    opted_out = _library_compiles(monkeypatch, tmp_path, dict(env, PORTATTN_CUDA_HOPPER="0"))
    assert not any(variants.is_hopper_source(name) for name in opted_out)


@pytest.mark.slow
@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed")
def test_one_generated_hopper_unit_the_table_and_the_entry_compile_with_nvcc(monkeypatch, tmp_path):
    """The build's own nvcc commands (captured from build_library) for hd64 bf16, run for real."""
    env = {"PORTATTN_CUDA_ARCHS": "90", "PORTATTN_HEADDIMS": "64", "PORTATTN_DTYPES": "bf16"}
    nvcc = build.find_nvcc()
    captured = []
    monkeypatch.setattr(build.ninja_build.NinjaBuild, "run", lambda self, env: captured.append(self))
    build.build_library(str(tmp_path / "lib.so"), str(tmp_path / "tmp"), env)
    (ninja,) = captured
    steps = {os.path.basename(step.source): step for step in ninja.compiles}
    for name in ("hopper_fwd_hd64_bf16.cu", variants.HOPPER_TABLE_SOURCE, "hopper_fwd_entry.cu"):
        step = steps[name]
        command = [{"$in": step.source, "$out": step.output, "$depfile": step.depfile}.get(a, a)
                   for a in step.command]
        assert command[0] == nvcc and HOPPER_GENCODE in command
        done = subprocess.run(command, capture_output=True, text=True)
        assert done.returncode == 0, f"{name}:\n{done.stderr[-4000:]}"
    if shutil.which("nm"):
        symbols = subprocess.run(["nm", "-C", steps["hopper_fwd_hd64_bf16.cu"].output], capture_output=True,
                                 text=True, check=True).stdout
        assert "portattn::hopper::run_hopper_fwd<64, __nv_bfloat16>(PortattnFwdParams const&)" in symbols
        table = subprocess.run(["nm", "-C", steps[variants.HOPPER_TABLE_SOURCE].output], capture_output=True,
                               text=True, check=True).stdout
        assert "portattn::cuda::kHopperFwdVariants" in table and "run_hopper_fwd<128" not in table


@pytest.mark.parametrize(
    "built, head_dim, reason",
    [
        ([64, 128], 64, None),
        ([128], 128, None),
        # No masked head-dim tail: a 64 call is not served by the 128 kernel; it falls back.
        ([128], 64, "head_dim 64 not built (this build: PORTATTN_HEADDIMS=128; cuda-sm90 serves only the "
                    "built head dims themselves)"),
        # A build of hd128 has the kernel that could serve 96, but serves what it names only.
        ([128], 96, "head_dim 96 not built (this build: PORTATTN_HEADDIMS=128; cuda-sm90 serves only the "
                    "built head dims themselves)"),
        ([96], 96, None),
        ([], 64, "head_dim 64 not built (this build has no cuda-sm90 kernel: PORTATTN_HEADDIMS / PORTATTN_DTYPES "
                 "left none of its head dims)"),
    ],
)
def test_sm90_backend_judges_a_partial_or_empty_hopper_build(monkeypatch, built, head_dim, reason):
    torch = pytest.importorskip("torch")
    from portattn.backends.cuda import CudaSm90Backend
    from portattn.capability.callspec import CallSpec
    from portattn.capability.probe import fake_device

    backend = object.__new__(CudaSm90Backend)  # no compiled module on this machine: its build_config
    backend.module, backend.unavailable_reason, backend._devices = None, None, [fake_device("h100")]
    backend._build_config = {"archs": ["sm_80", "sm_90"], "head_dims": [32, 64, 128], "dtypes": ["bfloat16"],
                             "hopper": {"archs": ["sm_90a"], "head_dims": built,
                                        "dtypes": ["bfloat16"] if built else []}}
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reasons = backend.unsupported_reasons(CallSpec("bfloat16", head_dim, head_dim, "cuda", frozenset({"forward"}), 0))
    assert reasons == ([] if reason is None else [reason])
