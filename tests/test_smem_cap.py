"""PORTATTN_MAX_SMEM_KIB (capability/smem_cap.py, Note [portattn smem budget]): the probe, the
support matrix, dispatch and the report judge a GPU by min(the cap, its own opt-in limit), and
bad values are a clear error. No GPU needed; tests/gpu/test_cuda_smem_budget.py runs the
kernels under a cap."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from portattn.capability import declare, matrix, probe, render, smem_cap
from portattn.capability.callspec import CallSpec
from portattn.capability.specs import cuda as cuda_spec

KIB = 1024
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call(head_dim, *features):
    return CallSpec("bfloat16", head_dim, head_dim, "cuda", frozenset(("forward",) + features))


@pytest.mark.parametrize("text, expected", [(None, None), ("", None), (" ", None), ("99", 99 * KIB),
                                            (" 163 ", 163 * KIB), ("48", 48 * KIB), ("1024", 1024 * KIB)])
def test_valid_values(text, expected):
    assert smem_cap.parse(text) == expected


@pytest.mark.parametrize("text", ["abc", "99.5", "-99", "47", "1025", "101376", "99KiB", "0"])
def test_bad_values_name_the_variable_and_the_range(text):
    with pytest.raises(ValueError) as info:
        smem_cap.parse(text)
    message = str(info.value)
    assert "PORTATTN_MAX_SMEM_KIB" in message and repr(text) in message
    assert f"from {smem_cap.MIN_KIB} to {smem_cap.MAX_KIB}" in message
    assert smem_cap.cap_bytes({smem_cap.ENV: text}) is None
    assert smem_cap.config_error({smem_cap.ENV: text}) == message


def test_cap_lowers_nvidia_devices_only(monkeypatch):
    monkeypatch.setenv(smem_cap.ENV, "99")
    h100 = probe.with_smem_cap(probe.fake_device("h100"))
    assert (h100.smem_per_block_optin, h100.smem_per_block_optin_uncapped) == (99 * KIB, 227 * KIB)
    # Already within the cap: unchanged.
    l4 = probe.with_smem_cap(probe.fake_device("l4"))
    assert (l4.smem_per_block_optin, l4.smem_per_block_optin_uncapped) == (99 * KIB, None)
    # AMD LDS is not capped (the ROCm kernels read no budget).
    mi300x = probe.with_smem_cap(probe.fake_device("mi300x"), cap=48 * KIB)
    assert mi300x.smem_per_block_optin == 64 * KIB
    # A later cap applies to the device's own limit, not to the earlier budget.
    assert probe.with_smem_cap(h100, cap=163 * KIB).smem_per_block_optin == 163 * KIB
    assert probe.with_smem_cap(h100, cap=1024 * KIB).smem_per_block_optin_uncapped is None


def _fake_torch_h100():
    from types import SimpleNamespace

    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                            total_memory=80 << 30, warp_size=32, shared_memory_per_block_optin=227 * KIB)
    cuda = SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                           get_device_properties=lambda i: props, current_device=lambda: 0)
    return SimpleNamespace(__version__="9.9", cuda=cuda, version=SimpleNamespace(hip=None, cuda="12.8"))


def test_probe_reports_the_budget(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch_h100())
    monkeypatch.setenv(smem_cap.ENV, "99")
    (device,) = probe.probe_devices()
    assert (device.smem_per_block_optin, device.smem_per_block_optin_uncapped) == (99 * KIB, 227 * KIB)
    monkeypatch.setenv(smem_cap.ENV, "oops")
    (device,) = probe.probe_devices()  # a probe never raises: the device's own limit, and a note
    assert device.smem_per_block_optin == 227 * KIB and device.smem_per_block_optin_uncapped is None
    assert any("PORTATTN_MAX_SMEM_KIB='oops'" in note for note in probe.probe_notes())


def test_spec_budgets_are_what_the_kernels_say():
    """specs/cuda.py SMEM_BYTES against a built module's build_config()["smem_bytes"] (the kernels'
    own constexpr budgets), for the head dims the build has."""
    cuda = pytest.importorskip("portattn.backends.cuda")
    if cuda._C is None:
        pytest.skip(f"the CUDA module is not built: {cuda._IMPORT_ERROR}")
    built = cuda._C.build_config()["smem_bytes"]
    assert set(built) == set(cuda_spec.SMEM_BYTES)
    for feature, per_head_dim in built.items():
        assert {int(d): n for d, n in per_head_dim.items()} == {
            d: n for d, n in cuda_spec.SMEM_BYTES[feature].items() if d in per_head_dim}, feature


def test_every_sm80_part_serves_every_head_dim_and_the_backward_needs_at_most_88_5_kib():
    assert max(cuda_spec.SMEM_BYTES["backward"].values()) == 88.5 * KIB
    assert max(need for table in cuda_spec.SMEM_BYTES.values() for need in table.values()) == 96 * KIB
    for kind in ("rtx3090", "rtx4090", "l4", "rtx5090", "gb10", "a100"):
        device = probe.fake_device(kind)
        for head_dim in range(8, 257, 8):
            assert matrix.check_call("cuda", device, call(head_dim, "backward", "dropout")) == [], (kind, head_dim)
            assert matrix.check_call("cuda", device, call(head_dim, "decode")) == [], (kind, head_dim)


@pytest.mark.parametrize("cap_kib, hopper_serves", [(99, False), (163, False), (227, True), (None, True)])
def test_matrix_under_a_cap(cap_kib, hopper_serves):
    """An H100 under the cap is judged as the part the cap stands for: the Hopper path, sized for
    227 KiB, steps aside and the sm80+ path serves every head dim from 99 KiB on."""
    h100 = probe.with_smem_cap(probe.fake_device("h100"), cap=None if cap_kib is None else cap_kib * KIB)
    reasons = matrix.check_call("cuda-sm90", h100, call(128))
    assert (reasons == []) is hopper_serves, reasons
    if not hopper_serves:
        assert reasons == [f"forward needs 227 KiB of opt-in shared memory per block (the Hopper kernels are "
                           f"sized for sm90's full budget); PORTATTN_MAX_SMEM_KIB leaves {cap_kib} KiB of "
                           f"NVIDIA H100 80GB HBM3's 227 KiB"]
    for head_dim in (64, 128, 192, 224, 256):
        assert matrix.check_call("cuda", h100, call(head_dim, "backward")) == []


def test_matrix_under_a_cap_smaller_than_every_part():
    h100 = probe.with_smem_cap(probe.fake_device("h100"), cap=64 * KIB)
    assert matrix.check_call("cuda", h100, call(128)) == []
    reasons = matrix.check_call("cuda", h100, call(128, "backward"))
    assert reasons == ["backward with head_dim 128 > 96 needs 74240 bytes of opt-in shared memory per block "
                       "(the backward's smallest tile at head dim 128); PORTATTN_MAX_SMEM_KIB leaves 64 KiB of "
                       "NVIDIA H100 80GB HBM3's 227 KiB"]
    # A build's own numbers decide for the features it reports.
    build = {"smem_bytes": {"forward": {"256": 96 * KIB}, "backward": {"256": 85248}}}
    reasons = matrix.check_call("cuda", h100, call(256, "backward"), build)
    assert len(reasons) == 2 and all("this build's smallest tile for head dim 256" in r for r in reasons), reasons


def test_bad_value_makes_every_call_raise_but_import_works(monkeypatch):
    pytest.importorskip("torch")
    from portattn import dispatch

    monkeypatch.setenv(smem_cap.ENV, "99000")
    dispatcher = dispatch.Dispatcher(dispatch.DISPATCHER.slots, None)
    assert "PORTATTN_MAX_SMEM_KIB='99000'" in dispatcher.config_error
    import torch

    with pytest.raises(ValueError, match=r"PORTATTN_MAX_SMEM_KIB='99000' is not valid: expected an integer "
                                         r"number of KiB from 48 to 1024"):
        dispatcher.backend_for(torch.device("cpu"), torch.float32, 64, dispatch.feature_bits(-1, -1, 0.0, False, 0.0,
                                                                                             False, False))
    monkeypatch.setenv(smem_cap.ENV, "99")
    assert dispatch.Dispatcher(dispatch.DISPATCHER.slots, None).config_error == ""


def _cli(*args, env_value=None):
    env = dict(os.environ)
    env.pop(smem_cap.ENV, None)
    if env_value is not None:
        env[smem_cap.ENV] = env_value
    return subprocess.run([sys.executable, "-m", "portattn", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_report_under_a_cap():
    out = _cli("--device-desc", "h100", env_value="99")
    assert out.returncode == 0, out.stderr
    assert "PORTATTN_MAX_SMEM_KIB=99: NVIDIA GPUs are judged and launched with at most 99 KiB" in out.stdout
    assert "shared memory opt-in per block 99 KiB (capped by PORTATTN_MAX_SMEM_KIB; the device has 227 KiB)" in out.stdout
    assert "Selected for a typical call (float16, head_dim 128, forward): cuda\n" in out.stdout
    data = json.loads(_cli("--device-desc", "h100", "--json", env_value="163").stdout)
    assert data["smem_cap"] == {"variable": "PORTATTN_MAX_SMEM_KIB", "value": "163", "bytes": 163 * KIB, "error": None}
    assert data["devices"][0]["smem_per_block_optin"] == 163 * KIB
    assert data["selected"] == "cuda"


def test_report_shows_a_bad_value():
    out = _cli("--device-desc", "h100", env_value="lots")
    assert out.returncode == 0, out.stderr
    assert "PORTATTN_MAX_SMEM_KIB='lots' is not valid" in out.stdout
    assert "every call raises this until it is fixed" in out.stdout


def test_readme_table_does_not_depend_on_the_cap(monkeypatch):
    plain = render.readme_table()
    monkeypatch.setenv(smem_cap.ENV, "64")
    assert render.readme_table() == plain


def test_verified_at_budget_is_its_own_status(monkeypatch):
    """Verified on sm90 hardware at sm86/sm89's budget is neither "verified" there nor "compiled"."""
    at_budget = declare.BudgetVerification(archs=("sm86", "sm89"), budget_kib=99, hardware="sm90",
                                           features=frozenset({"forward", "backward"}))
    spec = dataclasses.replace(cuda_spec.SPEC, verified_at_budget=(at_budget,))
    monkeypatch.setitem(matrix._SPECS, "cuda", spec)
    assert matrix.feature_status("cuda", "sm89")["forward"] == declare.BUDGET_VERIFIED
    assert matrix.feature_status("cuda", "sm89")["dropout"] == declare.COMPILED
    assert matrix.feature_status("cuda", "sm80")["forward"] == declare.COMPILED
    assert matrix.feature_status("cuda", "sm90")["forward"] == declare.VERIFIED
    table = render.readme_table()
    assert "| forward | ✅ | 🔷 sm86/sm89 🟡 sm80 |" in table
    assert "🔷 verified on other hardware at that arch's shared-memory budget" in table
    with pytest.raises(ValueError, match="verified at a budget but not declared supported"):
        dataclasses.replace(cuda_spec.SPEC, supported=frozenset({"forward"}),
                            verified={}, verified_at_budget=(at_budget,))
