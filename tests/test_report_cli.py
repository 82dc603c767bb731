"""`python -m portattn` / `portattn-report`: runs, prints what it promises, JSON parses."""
import json
import os
import subprocess
import sys

import pytest

from portattn import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args):
    out = subprocess.run(
        [sys.executable, "-m", "portattn", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    return out


def test_plain_report_on_this_host():
    out = run_cli()
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "Python" in text and "torch" in text
    assert "Backends (dispatch priority order)" in text
    assert "Support matrix on" in text
    assert "reference" in text
    # Either devices are listed or the report says plainly why there are none.
    assert ("GPU 0:" in text) or ("No GPU found:" in text and "reference backend (pure PyTorch)" in text)


def test_json_report_parses_and_matches_matrix():
    out = run_cli("--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"host", "python", "torch", "devices", "backends", "selected", "matrix"} <= set(data)
    names = [b["name"] for b in data["backends"]]
    assert "reference" in names and names[-1] == "reference"
    assert data["selected"] in names
    features = [row["feature"] for row in data["matrix"]["rows"]]
    assert "forward" in features and "dtype:float32" in features
    if not data["devices"]:
        assert data["no_gpu_reason"]


def test_device_desc_h100():
    out = run_cli("--device-desc", "h100")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "NVIDIA H100 80GB HBM3" in text
    assert "sm90, family hopper (known)" in text
    assert "132, warp size 32" in text and "227 KiB" in text
    assert "Selected for a typical call (float16, head_dim 128, forward): cuda" in text
    assert "is an NVIDIA GPU (rocm needs an AMD GPU" in text


def test_device_desc_mi300x_json():
    out = run_cli("--device-desc", "mi300x", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    (device,) = data["devices"]
    assert device["arch"]["name"] == "gfx942" and device["arch"]["family"] == "cdna3"
    assert device["warp_size"] == 64 and device["sm_count"] == 304 and device["smem_per_block_optin"] == 65536
    cuda = next(b for b in data["backends"] if b["name"] == "cuda")
    assert any("is an AMD GPU" in r for r in cuda["reasons"])
    rocm = next(b for b in data["backends"] if b["name"] == "rocm")
    assert not any("arch" in r for r in rocm["reasons"])  # gfx942 is in rocm's range


def test_device_desc_t4_and_cpu():
    out = run_cli("--device-desc", "t4")
    assert out.returncode == 0, out.stderr
    assert "arch sm75 (Tesla T4) below cuda's minimum sm80" in out.stdout
    out = run_cli("--device-desc", "cpu")
    assert out.returncode == 0, out.stderr
    assert "No GPU found: described host has no GPU." in out.stdout


def test_device_desc_unknown_is_a_usage_error():
    out = run_cli("--device-desc", "v100")
    assert out.returncode == 2
    assert "unknown fake device 'v100'" in out.stderr


def test_report_without_torch_shows_declarations(monkeypatch, capsys):
    # What a host without torch sees: no dispatch, but probe and matrix still print.
    monkeypatch.setattr(report, "_torch_state", lambda: {"version": None, "build": None})
    data = report.collect("a100")
    assert data["dispatch"]["error"].startswith("torch not installed")
    assert all(b["available"] is None for b in data["backends"])
    assert data["selected"] == "cuda"  # judged on declarations for a described device
    text = report.render_text(data)
    assert "torch     not installed" in text
    assert "showing the support declarations only" in text
    assert "Support matrix on NVIDIA A100-SXM4-80GB (sm80)" in text


def test_selftest_flag_runs():
    out = run_cli("--selftest")
    assert out.returncode == 0, out.stderr
    assert "Self-check" in out.stdout


def test_report_module_is_torch_free():
    # portattn/__init__ needs torch; report.py and capability/ must not, so a torch-less
    # install can still print the probe and the matrix. Load them under a bare package.
    code = (
        "import sys, types; sys.modules['torch'] = None;"
        "pkg = types.ModuleType('portattn'); pkg.__path__ = ['portattn']; sys.modules['portattn'] = pkg;"
        "from portattn import report; sys.exit(report.main(['--device-desc', 'mi300x']))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch     not installed" in out.stdout
    assert "AMD Instinct MI300X" in out.stdout and "gfx942" in out.stdout
