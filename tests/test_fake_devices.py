"""What each backend says about the parts people actually run on (fake devices, no GPU needed).

Each row is a device as it reports itself; the expectations are what a user of
that part should be told. ROCm's feature list is its engineer's declaration,
so its rows check the arch verdict, not feature support.
"""
import pytest

from portattn.capability import matrix, probe
from portattn.capability.callspec import FEATURES, CallSpec

FWD = CallSpec("float16", 128, 128, "cuda", frozenset({"forward"}))
BWD_256 = CallSpec("bfloat16", 256, 256, "cuda", frozenset({"forward", "backward"}))

# kind: (family, cuda serves fwd?, substring of cuda's first reason, rocm arch ok?, cuda hd256 fwd+bwd ok?
#        (the 99 KiB consumer parts run its 96 KiB forward tile and 83.25 KiB backward tile))
CASES = {
    "a100": ("ampere", True, None, False, True),
    "rtx3090": ("ampere", True, None, False, True),
    "rtx4090": ("ada", True, None, False, True),
    "l4": ("ada", True, None, False, True),
    "h100": ("hopper", True, None, False, True),
    "h200": ("hopper", True, None, False, True),
    "b200": ("blackwell", True, None, False, True),
    "rtx5090": ("blackwell-consumer", True, None, False, True),
    "gb10": ("blackwell-consumer", True, None, False, True),
    "t4": ("turing", False, "below cuda's minimum sm80", False, False),
    "mi250x": ("cdna2", False, "is an AMD GPU", True, False),
    "mi300x": ("cdna3", False, "is an AMD GPU", True, False),
    "rx7900xtx": ("rdna3", False, "is an AMD GPU", True, False),
}


def test_every_preset_has_a_row():
    assert set(CASES) == set(probe.FAKE_DEVICE_KINDS)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_device_verdicts(kind):
    family, cuda_fwd, cuda_reason, rocm_arch_ok, cuda_bwd256 = CASES[kind]
    device = probe.fake_device(kind)
    assert device.arch.family == family

    reasons = matrix.check_call("cuda", device, FWD)
    assert (reasons == []) is cuda_fwd, reasons
    if cuda_reason:
        assert cuda_reason in reasons[0]
    assert (matrix.check_call("cuda", device, BWD_256) == []) is cuda_bwd256

    rocm_reasons = matrix.check_call("rocm", device, FWD)
    arch_reasons = [r for r in rocm_reasons if "arch" in r or "GPU" in r]
    assert (arch_reasons == []) is rocm_arch_ok, rocm_reasons

    # The reference backend serves every device, every feature.
    everything = CallSpec("float32", 100, 100, "cuda", frozenset(FEATURES))
    assert matrix.check_call("reference", device, everything) == []


@pytest.mark.parametrize("kind", ["a100", "rtx4090", "h100", "b200", "rtx5090", "gb10"])
def test_cuda_status_on_supported_nvidia_parts(kind):
    status = matrix.feature_status("cuda", probe.fake_device(kind).arch)
    usable = ("compiled", "verified-at-budget", "verified")
    assert status["forward"] in usable
    assert status["paged_kv"] in usable and status["decode"] in usable


def test_sm121_is_served_as_sm120_family():
    gb10 = probe.fake_device("gb10")
    assert gb10.arch.name == "sm121" and not gb10.arch.known
    assert "sm120" in gb10.arch.note
    assert matrix.feature_status("cuda", gb10.arch) == matrix.feature_status("cuda", "sm120")


def test_rtx5090_is_not_verified_by_family_rule():
    # Until the GPU suite runs on an sm120 part, the declaration cannot claim it: at most its
    # 99 KiB budget was verified on other hardware (VERIFIED_AT_BUDGET).
    assert "sm120" not in matrix.get_spec("cuda").verified
    assert matrix.feature_status("cuda", "sm120")["forward"] == "verified-at-budget"


def test_t4_reason_names_the_minimum():
    reasons = matrix.check_call("cuda", probe.fake_device("t4"), FWD)
    assert reasons == ["arch sm75 (Tesla T4) below cuda's minimum sm80"]
    assert set(matrix.feature_status("cuda", "sm75").values()) == {"no"}


def test_rdna3_gets_the_rocm_forward_backward_and_decode():
    device = probe.fake_device("rx7900xtx")
    assert matrix.check_call("rocm", device, FWD) == []
    assert matrix.check_call("rocm", device, BWD_256) == []
    status = matrix.feature_status("rocm", "gfx1100")
    assert status["forward"] == status["backward"] == status["decode"] == status["paged_kv"] == "compiled"
    # RDNA2 (no matrix instructions) is outside every range.
    assert "arch gfx1030" in matrix.check_call("rocm", _with_arch(probe.fake_device("rx7900xtx"), "gfx1030"), FWD)[0]


def _with_arch(device, arch):
    import dataclasses

    from portattn.capability.archs import amd_arch

    return dataclasses.replace(device, arch=amd_arch(arch))


def test_mi300x_and_mi250x_archs_are_in_rocm_range():
    for kind in ("mi300x", "mi250x"):
        assert matrix.arch_supported(matrix.get_spec("rocm"), probe.fake_device(kind).arch)


def test_cpu_host():
    assert matrix.check_call("reference", None, CallSpec("float32", 64, 64, "cpu", frozenset({"forward"}))) == []
    for backend in ("cuda", "rocm"):
        assert matrix.check_call(backend, None, CallSpec("float16", 64, 64, "cpu", frozenset({"forward"})))
        assert set(matrix.feature_status(backend, None).values()) == {"no"}
    rows = matrix.support_table(None)
    assert all(row["status"]["reference"] == "verified" for row in rows)
    assert all(row["status"]["cuda"] == "no" for row in rows)
