"""bench/bench_hf_generate.py on the CPU (--dry-run): a tiny random model through every mode,
warm and cold, written by bench/peers.py's writer. Its timings mean nothing; the GPU machine
runs the real one (the README of bench/results says how)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="the benchmark drives Hugging Face generate()")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_writes_every_cell(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "bench/bench_hf_generate.py", "--dry-run", "--impls", "portattn,sdpa",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "hf_generate.json").read_text())
    assert result["dry_run"] and "DRY RUN" in result["device"] and result["commit"] and result["date"]
    assert [(r["mode"], r["batch"], r["prompt"]) for r in result["rows"]] == [
        ("eager_dynamic", 2, 16), ("static_compile", 2, 16)]
    for row in result["rows"]:
        assert not row["na"], row["na"]
        for when in ("warm", "cold"):
            for name in ("portattn", "sdpa"):
                assert row["tokens_per_s"][when][name] == pytest.approx(2 * 3 / row["seconds"][when][name])
    markdown = (tmp_path / "hf_generate.md").read_text()
    assert "## Warm tokens/s" in markdown and "## Cold tokens/s" in markdown and "portattn / SDPA" in markdown
    assert (tmp_path / "hf_generate.png").stat().st_size > 0


def test_budget_spent_cells_are_na(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "bench/bench_hf_generate.py", "--dry-run", "--budget-s", "0",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "hf_generate.json").read_text())
    reasons = [why for row in result["rows"] for per in row["na"].values() for why in per.values()]
    assert len(reasons) == 2 * 3 * 2 and all("time budget" in why for why in reasons)
