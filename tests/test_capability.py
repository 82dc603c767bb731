"""portattn/capability: arch parsing and ordering, support checks, build narrowing, probe parsers."""
import dataclasses
import os
import subprocess
import sys

import pytest

from portattn.capability import matrix, probe
from portattn.capability.archs import Arch, ArchRange, parse_arch
from portattn.capability.callspec import FEATURES, CallSpec
from portattn.capability.declare import BackendSpec
from portattn.capability.matrix import check_call
from portattn.capability.probe import fake_device
from portattn.capability.specs import cuda as cuda_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIB = 1024


def call(dtype="float16", head_dim=128, head_dim_v=None, device_type="cuda", features=("forward",)):
    return CallSpec(dtype, head_dim, head_dim_v or head_dim, device_type, frozenset(features))


# ---------------------------------------------------------------------------------------------
# torch-free import (setup.py loads the package by file path)


def test_capability_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.path.insert(0, 'portattn'); import capability;"
        "from capability import archs, probe, matrix, render, callspec;"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None];"
        "print(len(render.readme_table()) > 0, matrix.check_call('cuda', probe.fake_device('t4'),"
        " callspec.CallSpec('float16', 64, 64, 'cuda', frozenset({'forward'}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True") and "sm75" in out.stdout


# ---------------------------------------------------------------------------------------------
# archs


@pytest.mark.parametrize(
    "text, vendor, name",
    [
        ("sm_90", "nvidia", "sm90"),
        ("sm90", "nvidia", "sm90"),
        ("sm_90a", "nvidia", "sm90"),
        ("9.0", "nvidia", "sm90"),
        ((9, 0), "nvidia", "sm90"),
        ("compute_80", "nvidia", "sm80"),
        ("86", "nvidia", "sm86"),
        ("12.0", "nvidia", "sm120"),
        ("SM_100", "nvidia", "sm100"),
        ("gfx942:sramecc+:xnack-", "amd", "gfx942"),
        ("gfx90a", "amd", "gfx90a"),
        ("gfx1100", "amd", "gfx1100"),
    ],
)
def test_parse_arch_spellings(text, vendor, name):
    arch = parse_arch(text)
    assert (arch.vendor, arch.name) == (vendor, name)
    assert parse_arch(arch) is arch


@pytest.mark.parametrize("bad", ["", "sm", "hopper", "gfx", "gfx9", "9", "sm_9", "1.2.3", "gfxzz1"])
def test_parse_arch_rejects_garbage_with_valueerror(bad):
    with pytest.raises(ValueError, match="arch|gfx|compute capability"):
        parse_arch(bad)


def test_parse_arch_rejects_wrong_type():
    with pytest.raises(TypeError, match="arch must be"):
        parse_arch(9.0)


def test_families_and_known():
    assert parse_arch("sm80").family == "ampere"
    assert parse_arch("sm89").family == "ada"
    assert parse_arch("sm90").family == "hopper"
    assert parse_arch("sm100").family == "blackwell"
    assert parse_arch("sm120").family == "blackwell-consumer"
    assert parse_arch("gfx90a").family == "cdna2"
    assert parse_arch("gfx942").family == "cdna3"
    assert parse_arch("gfx950").family == "cdna4"
    assert parse_arch("gfx1100").family == "rdna3"
    assert all(parse_arch(a).known for a in ("sm80", "sm90", "gfx942"))


def test_unknown_newer_archs_are_treated_as_their_family():
    sm121 = parse_arch("sm_121")
    assert (sm121.family, sm121.known) == ("blackwell-consumer", False)
    assert "sm120" in sm121.note
    sm95 = parse_arch("sm_95")
    assert (sm95.family, sm95.known) == ("hopper", False)
    future = parse_arch("sm_130")
    assert (future.family, future.known) == ("unknown", False)
    assert "PTX" in future.note
    gfx943 = parse_arch("gfx943")
    assert (gfx943.family, gfx943.known) == ("cdna3", False)


def test_arch_ordering():
    order = ["sm75", "sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "sm121"]
    archs = [parse_arch(a) for a in order]
    assert sorted(reversed(archs)) == archs
    assert parse_arch("gfx908") < parse_arch("gfx90a") < parse_arch("gfx940") < parse_arch("gfx942") < parse_arch("gfx950")
    assert parse_arch("sm90") >= parse_arch("9.0") and parse_arch("sm90") <= parse_arch((9, 0))
    with pytest.raises(TypeError, match="cannot order"):
        parse_arch("sm90") < parse_arch("gfx942")


def test_arch_range():
    sm80_up = ArchRange("nvidia", "sm80")
    assert str(sm80_up) == "sm80+"
    assert sm80_up.contains("sm86") and sm80_up.contains("sm121") and "sm300" in sm80_up
    assert not sm80_up.contains("sm75") and not sm80_up.contains("gfx942") and not sm80_up.contains(None)
    cdna = ArchRange("amd", "gfx90a", "gfx942")
    assert str(cdna) == "gfx90a-gfx942"
    assert cdna.contains("gfx940") and not cdna.contains("gfx950") and not cdna.contains("gfx1100")
    assert str(ArchRange("amd", "gfx90a", "gfx90a")) == "gfx90a"
    with pytest.raises(ValueError, match="empty arch range"):
        ArchRange("nvidia", "sm90", "sm80")
    with pytest.raises(ValueError, match="not a nvidia arch"):
        ArchRange("nvidia", "gfx942")
    with pytest.raises(ValueError, match="vendor"):
        ArchRange("intel", "sm80")


def test_rocm_ranges_exclude_gfx90c_apu():
    # gfx90c sorts between gfx90a and gfx942 but is a GCN5 APU.
    spec = matrix.get_spec("rocm")
    assert matrix.arch_supported(spec, "gfx90a") and matrix.arch_supported(spec, "gfx942")
    assert not matrix.arch_supported(spec, "gfx90c")


# ---------------------------------------------------------------------------------------------
# check_call


def test_check_call_lists_every_reason():
    reasons = matrix.check_call("cuda-sm90", probe.fake_device("t4"), call("float32", 264, features=("forward", "paged_kv")))
    assert len(reasons) == 6, reasons  # arch, dtype, head dim (range and multiple), paged_kv, the budget
    reasons += matrix.check_call("cuda", probe.fake_device("t4"), call("float32", 264, features=("forward", "paged_kv")))
    text = "\n".join(reasons)
    assert "forward with head_dim 264 > 224 needs 96 KiB of opt-in shared memory per block" in text
    assert "arch sm75 (Tesla T4) below cuda's minimum sm80" in text
    assert "dtype float32 not supported (cuda: float16, bfloat16)" in text
    assert "head_dim 264 > 256 (cuda supports multiples of 8 up to 256)" in text
    assert "feature paged_kv not supported by cuda-sm90" in text


def test_check_call_head_dim_rules():
    h100 = probe.fake_device("h100")
    assert matrix.check_call("cuda", h100, call(head_dim=256)) == []
    assert matrix.check_call("cuda", h100, call(head_dim=100)) == [
        "head_dim 100 is not a multiple of 8 (cuda supports multiples of 8 up to 256)"
    ]
    assert "head_dim_v 64 != head_dim 128" in matrix.check_call("cuda", h100, call(head_dim=128, head_dim_v=64))[0]
    assert matrix.check_call("reference", None, call("float32", 100, 36, device_type="cpu")) == []


def test_check_call_device_and_vendor():
    assert matrix.check_call("cuda", None, call(device_type="cpu")) == [
        "tensors are on cpu (cuda needs an NVIDIA GPU, sm80+)"
    ]
    assert "no GPU device found" in matrix.check_call("cuda", None, call())[0]
    assert "is an AMD GPU (cuda needs an NVIDIA GPU" in matrix.check_call("cuda", probe.fake_device("mi300x"), call())[0]
    assert "is an NVIDIA GPU (rocm needs an AMD GPU" in matrix.check_call("rocm", probe.fake_device("h100"), call())[0]


def test_check_call_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'metal'"):
        matrix.check_call("metal", None, call())


def test_resource_rule_is_decided_from_device_memory_not_arch():
    big = call(head_dim=256, features=("forward", "backward"))
    h100, rtx4090 = probe.fake_device("h100"), probe.fake_device("rtx4090")
    # Every sm80+ part (99 KiB or more) serves every head dim: 256 runs its 96 KiB tile there.
    assert matrix.check_call("cuda", h100, big) == []
    assert matrix.check_call("cuda", rtx4090, big) == []
    # Same arch, less memory: the memory decides, and the reason names the need and the budget.
    need = cuda_spec.SMEM_BYTES["forward"][256]
    cut_down_4090 = dataclasses.replace(rtx4090, smem_per_block_optin=need - KIB)
    reasons = matrix.check_call("cuda", cut_down_4090, big)
    assert len(reasons) == 1 and "forward with head_dim 256 > 224 needs 96 KiB" in reasons[0], reasons
    assert "95 KiB" in reasons[0], reasons
    assert matrix.check_call("cuda", cut_down_4090, call(head_dim=224, features=("forward", "backward"))) == []
    assert matrix.check_call("cuda", dataclasses.replace(rtx4090, smem_per_block_optin=KIB), big) != []
    # Unknown opt-in memory (a text-tool probe) is not a reason.
    assert matrix.check_call("cuda", dataclasses.replace(rtx4090, smem_per_block_optin=None), big) == []


# ---------------------------------------------------------------------------------------------
# build_config narrowing


def test_build_head_dims_served_by_smallest_built_at_least():
    h100 = probe.fake_device("h100")
    build = {"archs": ["sm90"], "head_dims": [64, 128], "dtypes": ["float16", "bfloat16"]}
    assert matrix.check_call("cuda", h100, call(head_dim=96), build) == []
    assert matrix.check_call("cuda", h100, call(head_dim=128), build) == []
    reasons = matrix.check_call("cuda", h100, call(head_dim=192), build)
    assert reasons == [
        "head_dim 192 not built (this build: PORTATTN_HEADDIMS=64,128; a head dim is served by the smallest built one >= it)"
    ]
    # Beyond the declared maximum the declaration's reason is enough; no duplicate build reason.
    assert len(matrix.check_call("cuda", h100, call(head_dim=264), build)) == 1


def test_exact_head_dim_spec_is_served_only_by_its_own_built_head_dim():
    h100 = probe.fake_device("h100")
    partial = {"archs": ["sm_90a"], "head_dims": [128], "dtypes": ["bfloat16"]}
    assert matrix.check_call("cuda-sm90", h100, call("bfloat16", head_dim=128), partial) == []
    assert matrix.check_call("cuda-sm90", h100, call("bfloat16", head_dim=64), partial) == [
        "head_dim 64 not built (this build: PORTATTN_HEADDIMS=128; cuda-sm90 serves only the built head dims themselves)"
    ]
    # An empty list is a build without any kernel of the backend, not an unrestricted one.
    empty = {"archs": ["sm_90a"], "head_dims": [], "dtypes": []}
    (reason,) = matrix.check_call("cuda-sm90", h100, call("bfloat16", head_dim=64), empty)
    assert reason.startswith("head_dim 64 not built (this build has no cuda-sm90 kernel")
    assert matrix.check_call("cuda-sm90", h100, call("bfloat16", head_dim=64), {"archs": ["sm_90a"]}) == []


def test_build_dtypes():
    build = {"dtypes": ["float16"]}
    reasons = matrix.check_call("cuda", probe.fake_device("a100"), call("bfloat16"), build)
    assert reasons == ["dtype bfloat16 not built (this build: PORTATTN_DTYPES=float16)"]


@pytest.mark.parametrize(
    "device, archs, ptx, served",
    [
        ("rtx3090", ["sm80"], False, True),  # same major, higher minor: cubin compatible
        ("rtx4090", ["80", "86"], False, True),
        ("h100", ["sm80", "sm86"], False, False),  # other major, no PTX
        ("h100", ["8.0+PTX"], False, True),
        ("h100", ["compute_80"], False, True),
        ("h100", ["sm80"], True, True),  # ptx=True: PTX of the highest built arch
        ("a100", ["sm90"], True, False),  # PTX never runs on an older arch
        ("rtx5090", ["sm80", "sm90"], ["sm90"], True),
        ("mi300x", ["gfx942"], False, True),
        ("mi300x", ["gfx90a"], False, False),  # AMD code objects are per target
        ("mi250x", ["gfx90a:xnack-"], False, True),
    ],
)
def test_build_archs(device, archs, ptx, served):
    dev = probe.fake_device(device)
    assert matrix.build_serves_arch(archs, dev.arch, ptx) is served
    backend = "cuda" if dev.vendor == "nvidia" else "rocm"
    reasons = [r for r in matrix.check_call(backend, dev, call(), {"archs": archs, "ptx": ptx}) if "not built" in r]
    assert (reasons == []) is served
    if not served:
        assert f"arch {dev.arch.name} not built" in reasons[0]
        assert ("PORTATTN_CUDA_ARCHS" if backend == "cuda" else "PORTATTN_HIP_ARCHS") in reasons[0]


# ---------------------------------------------------------------------------------------------
# feature_status and declarations


def test_feature_status_reference_everywhere():
    for arch in (None, "sm75", "sm90", "gfx1100"):
        assert set(matrix.feature_status("reference", arch).values()) == {"verified"}


def test_feature_status_cuda():
    assert set(matrix.feature_status("cuda", None).values()) == {"no"}
    assert set(matrix.feature_status("cuda", "sm75").values()) == {"no"}
    assert set(matrix.feature_status("cuda", "gfx942").values()) == {"no"}
    status = matrix.feature_status("cuda", "sm121")
    # Every feature, paged KV and decode included (csrc/decode_*).
    assert {status[f] for f in FEATURES} <= {"compiled", "verified-at-budget", "verified"}
    assert matrix.feature_status("rocm", "gfx942")["decode"] in ("no", "compiled")


def test_verified_list_moves_status(monkeypatch):
    spec = matrix.get_spec("cuda")
    patched = dataclasses.replace(spec, verified={"sm90": frozenset({"forward", "causal"})}, verified_at_budget=())
    monkeypatch.setitem(matrix._SPECS, "cuda", patched)
    on_h100 = matrix.feature_status("cuda", "sm90")
    assert on_h100["forward"] == on_h100["causal"] == "verified"
    assert on_h100["backward"] == "compiled"
    assert matrix.feature_status("cuda", "sm89")["forward"] == "compiled"  # verification is per arch


def test_declaration_validation():
    with pytest.raises(ValueError, match="unknown feature names"):
        BackendSpec(name="x", title="x", vendor=None, supported=frozenset({"flash"}))
    with pytest.raises(ValueError, match="verified but not declared supported"):
        BackendSpec(name="x", title="x", vendor=None, supported=frozenset(), verified={"sm90": frozenset({"forward"})})


def test_support_table_rows():
    rows = matrix.support_table(probe.fake_device("h100"))
    by_feature = {row["feature"]: row["status"] for row in rows}
    assert set(FEATURES) <= set(by_feature)
    assert by_feature["forward"]["reference"] == "verified"
    assert by_feature["paged_kv"]["cuda-sm90"] == "no"
    assert by_feature["decode"]["cuda"] in ("compiled", "verified")
    assert by_feature["dtype:float32"]["cuda"] == "no"
    assert by_feature["dtype:float32"]["reference"] == "verified"


# ---------------------------------------------------------------------------------------------
# probe


def test_probe_is_quiet_and_explains_itself():
    devices = probe.probe_devices()
    assert isinstance(devices, list)
    if not devices:
        assert probe.probe_notes(), "an empty probe must say why"
        assert probe.no_gpu_reason() != "no probe has run"
    assert [d.index for d in devices] == list(range(len(devices)))


def test_fake_device_presets():
    a100 = probe.fake_device("a100")
    assert (a100.arch.name, a100.sm_count, a100.smem_per_block_optin, a100.warp_size) == ("sm80", 108, 163 * KIB, 32)
    mi250x = probe.fake_device("MI250X")
    assert (mi250x.arch.name, mi250x.sm_count, mi250x.smem_per_block_optin, mi250x.warp_size) == ("gfx90a", 110, 64 * KIB, 64)
    assert probe.fake_device("rx7900xtx").warp_size == 32
    assert probe.fake_device("h200").arch == probe.fake_device("h100").arch
    with pytest.raises(ValueError, match="unknown fake device 'v100'"):
        probe.fake_device("v100")


def test_parse_nvidia_smi():
    text = "0, NVIDIA H100 80GB HBM3, 9.0, 81559, 570.124.06\n1, NVIDIA GeForce RTX 5090, 12.0, 32607, 570.124.06\n"
    devices = probe.parse_nvidia_smi(text)
    assert [d.arch.name for d in devices] == ["sm90", "sm120"]
    assert devices[0].total_memory == 81559 << 20 and devices[0].driver_version == "570.124.06"
    assert devices[1].smem_per_block_optin is None  # nvidia-smi cannot tell
    assert probe.parse_nvidia_smi("garbage\n\n") == []


ROCMINFO_SAMPLE = """\
*******
Agent 1
*******
  Name:                    AMD EPYC 9654 96-Core Processor
  Marketing Name:          AMD EPYC 9654 96-Core Processor
  Device Type:             CPU
  Compute Unit:            192
*******
Agent 2
*******
  Name:                    gfx942
  Marketing Name:          AMD Instinct MI300X
  Device Type:             GPU
  Compute Unit:            304
  Wavefront Size:          64(0x40)
  Pool Info:
    Pool 1
      Segment:                 GLOBAL; FLAGS: COARSE GRAINED
      Size:                    201310208(0xbffc000) KB
    Pool 2
      Segment:                 GROUP
      Size:                    64(0x40) KB
  ISA Info:
    ISA 1
      Name:                    amdgcn-amd-amdhsa--gfx942:sramecc+:xnack-
"""


def test_parse_rocminfo():
    agents = probe.parse_rocminfo(ROCMINFO_SAMPLE)
    assert agents == [{"gfx": "gfx942", "name": "AMD Instinct MI300X", "cus": 304, "wave": 64, "lds": 64 * KIB}]
    assert probe.parse_rocminfo("no agents here") == []


def test_arch_dataclass_is_frozen():
    arch = parse_arch("sm90")
    with pytest.raises(dataclasses.FrozenInstanceError):
        arch.name = "sm80"
    assert isinstance(arch, Arch)


def test_device_info_matches_probe(monkeypatch):
    monkeypatch.setattr(probe, "_cache", {})
    devices = probe.probe_devices()
    assert probe.device_info(len(devices)) is None
    assert probe.device_info(-1) is None
    if devices:
        assert probe.device_info(0).name == devices[0].name
    else:
        assert probe.device_info() is None
    fakes = [probe.fake_device("h100"), probe.fake_device("h200", index=1)]
    monkeypatch.setattr(probe, "_cache", {True: (fakes, [])})
    assert probe.device_info(1).name == "NVIDIA H200"


def test_build_reported_smem_budgets_replace_the_static_rule():
    bwd256 = call(head_dim=256, features=("forward", "backward"))
    rtx4090 = probe.fake_device("rtx4090")
    # The kernel's own budget (82 KiB for hd256) fits 99 KiB: the 144 KiB default no longer applies.
    fits = {"head_dims": [128, 256], "smem_bytes": {"forward": {"128": 64 * KIB, "256": 96 * KIB},
                                                     "backward": {"128": 73 * KIB, "256": 82 * KIB}}}
    assert matrix.check_call("cuda", rtx4090, bwd256, fits) == []
    # A head dim is judged by the built variant that serves it (hd 136 -> the hd 256 kernel).
    too_big = {"head_dims": [128, 256], "smem_bytes": {"forward": {128: 64 * KIB, 256: 96 * KIB},
                                                        "backward": {128: 73 * KIB, 256: 100 * KIB}}}
    reasons = matrix.check_call("cuda", rtx4090, call(head_dim=136, features=("forward", "backward")), too_big)
    assert reasons == [
        "backward with head_dim 136 needs 100 KiB of opt-in shared memory per block "
        "(this build's smallest tile for head dim 256); NVIDIA GeForce RTX 4090 has 99 KiB"
    ]
    assert matrix.check_call("cuda", rtx4090, call(head_dim=136), too_big) == []  # forward only


def _fake_torch(hip, props):
    from types import SimpleNamespace

    cuda = SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: len(props),
        get_device_properties=lambda i: props[i],
        current_device=lambda: 0,
    )
    version = SimpleNamespace(hip=hip, cuda=None if hip else "12.8")
    return SimpleNamespace(__version__="9.9", cuda=cuda, version=version)


def test_probe_through_torch_nvidia(monkeypatch):
    from types import SimpleNamespace

    props = [
        SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                        total_memory=80 << 30, warp_size=32, shared_memory_per_block_optin=227 * KIB),
        SimpleNamespace(name="NVIDIA GB10", major=12, minor=1, multi_processor_count=48, total_memory=119 << 30),
    ]
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(None, props))
    devices = probe.probe_devices()
    assert [d.arch.name for d in devices] == ["sm90", "sm121"]
    assert devices[0].smem_per_block_optin == 227 * KIB and devices[0].source == "torch"
    assert devices[0].runtime_version == "12.8" and devices[0].vendor == "nvidia"
    # An older torch without the optin / warp_size fields: unknown memory, warp 32.
    assert devices[1].smem_per_block_optin is None and devices[1].warp_size == 32


def test_probe_through_torch_rocm(monkeypatch):
    from types import SimpleNamespace

    props = [
        SimpleNamespace(name="AMD Instinct MI300X", major=9, minor=4, multi_processor_count=304,
                        total_memory=192 << 30, warp_size=64, gcnArchName="gfx942:sramecc+:xnack-",
                        shared_memory_per_block_optin=0, shared_memory_per_block=64 * KIB),
        SimpleNamespace(name="odd", major=9, minor=4, multi_processor_count=1, total_memory=1, gcnArchName="???"),
    ]
    monkeypatch.setitem(sys.modules, "torch", _fake_torch("6.3.1", props))
    devices = probe.probe_devices()
    assert devices[0].vendor == "amd" and devices[0].arch.name == "gfx942"
    assert devices[0].smem_per_block_optin == 64 * KIB  # 0 opt-in falls back to the per-block limit
    assert devices[0].runtime_version == "6.3.1"
    assert devices[1].arch.family == "unknown" and not devices[1].arch.known


def test_forward_only_features_serve_inference_and_refuse_training_calls(monkeypatch):
    # A backend whose forward serves window and softcap but whose backward does not: an
    # inference call with them stays on it, a training call goes elsewhere with the reason.
    spec = dataclasses.replace(matrix.get_spec("cuda-sm90"), name="fwd-only",
                               forward_only={"window": "runs elsewhere", "softcap": "runs elsewhere"})
    monkeypatch.setitem(matrix._SPECS, "fwd-only", spec)
    h100 = fake_device("h100")
    for feature in ("window", "softcap"):
        assert check_call("fwd-only", h100, call(features=("forward", feature))) == []
        reasons = check_call("fwd-only", h100, call(features=("forward", "backward", feature)))
        assert reasons == [f"feature {feature} is forward-only on fwd-only; with a backward it runs elsewhere"]
        training = call(features=("forward", "backward", feature))
        assert check_call("cuda-sm90", h100, training) == []  # the Hopper backward serves both


def test_forward_only_features_must_be_declared_supported():
    with pytest.raises(ValueError, match="forward-only features must be declared supported"):
        BackendSpec(name="x", title="x", vendor=None, supported=frozenset({"forward"}),
                    forward_only={"window": "runs elsewhere"})


def test_forward_only_head_dims_serve_inference_and_refuse_training_calls(monkeypatch):
    # A backend whose forward serves a head dim its backward does not (cuda-sm90 declared 192 and
    # 256 so until both passes had them): an inference call stays on it, a training call goes
    # whole elsewhere with the reason.
    spec = dataclasses.replace(matrix.get_spec("cuda-sm90"), name="fwd-only-hd",
                               forward_only_head_dims={192: "runs its backward on the sm80+ path (cuda)"})
    monkeypatch.setitem(matrix._SPECS, "fwd-only-hd", spec)
    h100 = fake_device("h100")
    assert check_call("fwd-only-hd", h100, call(head_dim=192, features=("forward", "causal"))) == []
    training = call(head_dim=192, features=("forward", "backward", "causal"))
    assert check_call("fwd-only-hd", h100, training) == [
        "head_dim 192 is forward-only on fwd-only-hd; with a backward it runs its backward on the sm80+ path (cuda)"]
    assert check_call("cuda", h100, training) == []
    # cuda-sm90 itself trains at every head dim it admits: 96 padded on the hd128 kernels.
    for head_dim in (64, 96, 128, 192, 256):
        assert check_call("cuda-sm90", h100, call(head_dim=head_dim, features=("forward", "backward", "causal"))) == []


def test_an_explicit_head_dim_list_admits_nothing_between_its_entries():
    h100 = fake_device("h100")
    assert check_call("cuda-sm90", h100, call(head_dim=160)) == [
        "head_dim 160 is not one of 64, 96, 128, 192, 256 (cuda-sm90 supports head dims 64, 96, 128, 192, 256)"]
    assert check_call("cuda-sm90", h100, call(head_dim=80)) == [
        "head_dim 80 is not a multiple of 32 (cuda-sm90 supports head dims 64, 96, 128, 192, 256)"]


def test_head_dims_must_follow_the_rule_and_forward_only_head_dims_be_admitted():
    with pytest.raises(ValueError, match="break the rule"):
        BackendSpec(name="x", title="x", vendor=None, head_dim_multiple=64, head_dim_max=256, head_dims=(64, 96))
    with pytest.raises(ValueError, match="forward-only head dims must be admitted"):
        BackendSpec(name="x", title="x", vendor=None, head_dim_multiple=64, head_dim_max=256, head_dims=(64, 128),
                    forward_only_head_dims={256: "runs elsewhere"})
