"""flash-attn's own test suite run against portattn (issue 12's conformance run).

bench/conformance/run.sh copies this file next to flash-attn's tests/test_flash_attn.py
(fetched from the flash-attention repository at run time, never committed) and runs
pytest there. This conftest:
- makes `import flash_attn` resolve to portattn (`portattn.compat.provide_flash_attn`);
- gives flash-attn's internal names the test module imports but that only its dropout
  mask decoding uses (`_get_block_size_n`, `USE_TRITON_ROCM`) values for this run, on
  the aliased module only: portattn does not return flash-attn's internal dropout mask
  (`return_attn_probs` gives `(out, lse, None)`), so those cases are left out;
- leaves out every case with dropout_p > 0 for that reason, and runs a deterministic
  sample of the rest (a case is kept when crc32 of its id modulo a stride is 0; the
  stride is chosen so that about PORTATTN_CONFORMANCE_CASES cases run, default 900);
- writes per-test-function counts and the failing ids to
  $PORTATTN_CONFORMANCE_OUT/flash_attn_conformance.{json,md}.
"""
from __future__ import annotations

import collections
import datetime
import json
import os
import zlib

import torch

from portattn.compat import provide_flash_attn

provide_flash_attn(force=True)

import flash_attn.flash_attn_interface as _interface  # noqa: E402  (the alias just installed)

_interface.USE_TRITON_ROCM = False
_interface._get_block_size_n = lambda *args, **kwargs: 128  # read only when decoding S_dmask

EXCLUDED_WHY = "dropout_p > 0: the test decodes flash-attn's internal dropout-mask layout (S_dmask)"
_STATE = {"excluded": collections.Counter(), "selected": collections.Counter(),
          "outcomes": collections.defaultdict(collections.Counter), "failures": [], "stride": 1}


def _function(item) -> str:
    return item.nodeid.split("::")[-1].split("[")[0]


def pytest_collection_modifyitems(config, items):
    kept = []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("dropout_p", 0.0) > 0.0:
            _STATE["excluded"][_function(item)] += 1
        else:
            kept.append(item)
    target = int(os.environ.get("PORTATTN_CONFORMANCE_CASES", "900"))
    stride = max(1, len(kept) // max(1, target))
    _STATE["stride"] = stride
    sample = [item for item in kept if zlib.crc32(item.nodeid.encode()) % stride == 0]
    for item in sample:
        _STATE["selected"][_function(item)] += 1
    _STATE["candidates"] = len(kept)
    config.hook.pytest_deselected(items=[item for item in items if item not in set(sample)])
    items[:] = sample


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[-1].split("[")[0]
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = report.outcome
        _STATE["outcomes"][name][outcome] += 1
        if outcome == "failed":
            message = str(report.longrepr).strip().splitlines()[-1][:300] if report.longrepr else ""
            _STATE["failures"].append({"id": report.nodeid, "error": message})


def pytest_sessionfinish(exitstatus):  # pluggy passes only the arguments a hook names
    out = os.environ.get("PORTATTN_CONFORMANCE_OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {
        "device": device, "date": datetime.date.today().isoformat(),
        "commit": os.environ.get("PORTATTN_COMMIT", "unknown"),
        "flash_attn_tests": os.environ.get("PORTATTN_CONFORMANCE_SOURCE", "tests/test_flash_attn.py"),
        "stride": _STATE["stride"], "candidates": _STATE.get("candidates", 0),
        "excluded": dict(_STATE["excluded"]), "excluded_why": EXCLUDED_WHY,
        "selected": dict(_STATE["selected"]),
        "outcomes": {name: dict(counts) for name, counts in _STATE["outcomes"].items()},
        "failures": _STATE["failures"],
    }
    with open(os.path.join(out, "flash_attn_conformance.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    lines = [
        "# flash-attn's test suite against portattn (provide_flash_attn)", "",
        f"device: {device}; date: {result['date']}; commit: {result['commit']}; source: {result['flash_attn_tests']}", "",
        f"Deterministic sample: every case whose crc32(id) % {result['stride']} == 0 among the "
        f"{result['candidates']} cases without dropout. Left out: {sum(result['excluded'].values())} cases, "
        f"because {EXCLUDED_WHY}.", "",
        "| test function | run | passed | failed | skipped | left out (dropout) |", "|---|---|---|---|---|---|",
    ]
    names = sorted(set(result["selected"]) | set(result["excluded"]))
    for name in names:
        counts = result["outcomes"].get(name, {})
        lines.append(f"| {name} | {result['selected'].get(name, 0)} | {counts.get('passed', 0)} | "
                     f"{counts.get('failed', 0)} | {counts.get('skipped', 0)} | {result['excluded'].get(name, 0)} |")
    totals = collections.Counter()
    for counts in result["outcomes"].values():
        totals.update(counts)
    lines += ["", f"Total: {totals.get('passed', 0)} passed, {totals.get('failed', 0)} failed, "
                  f"{totals.get('skipped', 0)} skipped.", ""]
    if result["failures"]:
        lines += ["Failures (first 40):", ""] + [f"- `{f['id']}`: {f['error']}" for f in result["failures"][:40]]
    with open(os.path.join(out, "flash_attn_conformance.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
