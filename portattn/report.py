"""`portattn-report` / `python -m portattn`: what this machine can run, and why.

Shows the host, every probed GPU, each backend's build and availability, which
backend a typical call selects, and the support matrix for the device. Without
torch it still prints the probe and the matrix (dispatch needs torch).

    portattn-report              # human-readable
    portattn-report --json       # the same data as JSON
    portattn-report --selftest   # also run the backends' self-check now
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict
from typing import List, Optional, Sequence

from .capability import matrix, probe, smem_cap
from .capability.callspec import CallSpec
from .capability.declare import BUDGET_VERIFIED, COMPILED, NO, VERIFIED
from .capability.probe import DeviceInfo

# The call the report evaluates selection for; specific calls: portattn.explain(...).
TYPICAL_DTYPE = "float16"
TYPICAL_HEAD_DIM = 128

_SYMBOL = {VERIFIED: "✅", BUDGET_VERIFIED: "🔷", COMPILED: "🟡", NO: "❌"}
_LABEL = {BUDGET_VERIFIED: "at-budget"}  # the matrix's text cells are 9 wide


def _torch_state() -> dict:
    if not probe.torch_installed():
        return {"version": None, "build": None}
    try:
        import torch
    except Exception as error:  # a broken install is reported, not raised
        return {"version": None, "build": f"import failed: {type(error).__name__}: {error}"}
    if torch.version.hip:
        build = f"ROCm {torch.version.hip}"
    elif torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
    else:
        build = "CPU-only"
    return {"version": torch.__version__, "build": build}


def _dispatch_state(torch_version: Optional[str]) -> dict:
    """dispatch.report_state(), or why it is not available."""
    if torch_version is None:
        return {"error": "torch not installed: backends cannot be loaded"}
    try:
        from . import dispatch

        return dispatch.report_state()
    except Exception as error:
        return {"error": f"dispatch not available ({type(error).__name__}: {error})"}


def _priority(state: dict) -> List[str]:
    names = [b["name"] for b in state.get("backends", [])]
    if names:
        return names
    compiled = [n for n in matrix.BACKEND_NAMES if matrix.get_spec(n).vendor is not None]
    return compiled + [n for n in matrix.BACKEND_NAMES if n not in compiled]


def _typical_call(device: Optional[DeviceInfo]) -> CallSpec:
    return CallSpec(
        dtype=TYPICAL_DTYPE,
        head_dim=TYPICAL_HEAD_DIM,
        head_dim_v=TYPICAL_HEAD_DIM,
        device_type="cuda" if device is not None else "cpu",
        features=frozenset({"forward"}),
    )


def _device_dict(d: DeviceInfo) -> dict:
    out = asdict(d)
    out["arch"] = {
        "name": d.arch.name,
        "vendor": d.arch.vendor,
        "family": d.arch.family,
        "known": d.arch.known,
        "note": d.arch.note,
    }
    return out


def collect(device_desc: Optional[str] = None, selftest: bool = False) -> dict:
    """Everything the report shows, as plain data (what --json prints)."""
    torch_info = _torch_state()
    if device_desc is not None:
        key = device_desc.strip().lower()
        devices = [] if key in ("cpu", "none") else [probe.with_smem_cap(probe.fake_device(key))]
        no_gpu = "described host has no GPU" if not devices else None
    else:
        devices = probe.probe_devices()
        no_gpu = probe.no_gpu_reason() if not devices else None
    device = devices[0] if devices else None
    state = _dispatch_state(torch_info["version"])
    live = {b["name"]: b for b in state.get("backends", [])}
    call = _typical_call(device)

    backends = []
    for name in _priority(state):
        entry = {"name": name, "title": None, "available": None, "why": None, "build_config": None}
        if name in live:
            entry.update({k: live[name].get(k) for k in ("available", "why", "build_config")})
            entry["selfcheck"] = live[name].get("selfcheck")
        else:
            entry["why"] = state.get("error", "not loaded by dispatch")
        try:
            spec = matrix.get_spec(name)
        except ValueError:
            entry["serves_typical_call"] = None
            backends.append(entry)
            continue
        entry["title"] = spec.title
        entry["enable_hint"] = spec.fallback_when_unbuilt if entry["available"] is False and not entry["build_config"] else ""
        # A described device is not this host: judge it on the declaration alone.
        build = entry["build_config"] if device_desc is None and isinstance(entry["build_config"], dict) else None
        entry["reasons"] = matrix.check_call(name, device, call, build)
        entry["serves_typical_call"] = not entry["reasons"]
        backends.append(entry)

    selected, why = _selection(backends, described=device_desc is not None)
    if state.get("forced") and device_desc is None:
        selected, why = state["forced"], "forced by PORTATTN_BACKEND (calls it cannot serve raise)"
    report = {
        "host": {"platform": platform.platform(), "machine": platform.machine()},
        "python": platform.python_version(),
        "portattn": _portattn_version(),
        "torch": torch_info,
        "described_device": device_desc,
        "devices": [_device_dict(d) for d in devices],
        "no_gpu_reason": no_gpu,
        "smem_cap": {"variable": smem_cap.ENV, "value": os.environ.get(smem_cap.ENV) or None,
                     "bytes": smem_cap.cap_bytes(), "error": smem_cap.config_error() or None},
        "probe_notes": [] if device_desc is not None else probe.probe_notes(),
        "dispatch": {"priority": [b["name"] for b in backends], "forced": state.get("forced"), "error": state.get("error")},
        "backends": backends,
        "typical_call": {"dtype": call.dtype, "head_dim": call.head_dim, "features": sorted(call.features)},
        "selected": selected,
        "selected_why": why,
        "matrix": {
            "device": None if device is None else f"{device.name} ({device.arch.name})",
            "rows": matrix.support_table(device),
        },
    }
    if selftest:
        report["selftest"] = _selftest(report_text=False)
    return report


def _selection(backends: List[dict], described: bool):
    """The first backend in priority order that is available and serves the typical call."""
    skipped = []
    for b in backends:
        # A described device is judged on the declarations alone: every backend counts as built.
        present = bool(b["available"]) or described
        if present and b.get("serves_typical_call"):
            why = "; ".join(skipped) if skipped else "first backend in priority order that serves the call"
            return b["name"], why + (" (assuming every backend is built)" if described else "")
        if present:
            skipped.append(f"{b['name']}: {'; '.join(b.get('reasons') or ['no support declaration'])}")
        else:
            skipped.append(f"{b['name']}: {b['why']}")
    return None, "; ".join(skipped) or "no backend"


def _portattn_version() -> Optional[str]:
    module = sys.modules.get(__package__ or "portattn")
    return getattr(module, "__version__", None)


def _selftest(report_text: bool):
    if not probe.torch_installed():
        return {"error": "self-check not available: torch not installed"}
    try:
        from .dispatch import DISPATCHER
        from .selfcheck import run_selftest
    except Exception as error:
        return {"error": f"self-check not available ({type(error).__name__}: {error})"}
    return run_selftest(DISPATCHER.slots, report=report_text)


# ---------------------------------------------------------------------------------------------
# Text rendering


def _size(nbytes: Optional[int], unit: str = "GiB") -> str:
    if nbytes is None:
        return "unknown"
    if unit == "KiB":
        return f"{nbytes / 1024:.0f} KiB"
    return f"{nbytes / (1 << 30):.1f} GiB"


def _build_text(config) -> str:
    if not config:
        return "-"
    if "error" in config:
        return f"build_config() failed: {config['error']}"
    parts = []
    for key in ("archs", "head_dims", "dtypes"):
        if key in config:
            parts.append(f"{key.replace('_', ' ')} {','.join(map(str, config[key]))}")
    parts += [f"{k} {v}" for k, v in config.items() if k not in ("archs", "head_dims", "dtypes")]
    return "; ".join(parts)


def render_text(r: dict) -> str:
    lines = [f"portattn {r['portattn'] or ''} support report".replace("  ", " ")]
    lines.append(f"host      {r['host']['platform']} ({r['host']['machine']}), Python {r['python']}")
    t = r["torch"]
    lines.append(f"torch     {t['version']} ({t['build']})" if t["version"] else f"torch     not installed{' (' + t['build'] + ')' if t['build'] else ''}")
    if r["described_device"]:
        lines.append(f"(described device '{r['described_device']}': numbers from portattn's presets, not probed)")
    lines.append("")

    cap = r.get("smem_cap") or {}
    if cap.get("error"):
        lines.append(f"{cap['error']} (every call raises this until it is fixed)")
    elif cap.get("bytes"):
        lines.append(f"{cap['variable']}={cap['value']}: NVIDIA GPUs are judged and launched with at most "
                     f"{_size(cap['bytes'], 'KiB')} of shared memory per block")
    if cap.get("error") or cap.get("bytes"):
        lines.append("")
    if not r["devices"]:
        lines.append(f"No GPU found: {r['no_gpu_reason']}.")
        lines.append("portattn runs on the reference backend (pure PyTorch).")
    for d in r["devices"]:
        a = d["arch"]
        known = "known" if a["known"] else f"not in portattn's arch table: {a['note']}"
        unit = "CUs" if d["vendor"] == "amd" else "SMs"
        smem = "LDS per workgroup" if d["vendor"] == "amd" else "shared memory opt-in per block"
        own = d.get("smem_per_block_optin_uncapped")
        budget = _size(d["smem_per_block_optin"], "KiB") + (
            f" (capped by {smem_cap.ENV}; the device has {_size(own, 'KiB')})" if own else "")
        lines += [
            f"GPU {d['index']}: {d['name']} ({d['vendor']})",
            f"  arch      {a['name']}, family {a['family']} ({known})",
            f"  {unit:<9} {d['sm_count'] if d['sm_count'] is not None else 'unknown'}, warp size {d['warp_size'] or 'unknown'}",
            f"  memory    {_size(d['total_memory'])}; {smem} {budget}",
            f"  versions  driver {d['driver_version'] or 'unknown'}, runtime {d['runtime_version'] or 'unknown'} (probed via {d['source']})",
        ]
    lines.append("")

    lines.append("Backends (dispatch priority order)" + (f"; forced: {r['dispatch']['forced']}" if r["dispatch"].get("forced") else ""))
    if r["dispatch"].get("error"):
        lines.append(f"  ({r['dispatch']['error']}; showing the support declarations only)")
    for b in r["backends"]:
        if b["available"] is None:
            avail = "not loaded"
        else:
            why = b["why"] or ""
            avail = "available" if b["available"] else (why if why.startswith("not available") else f"not available: {why}")
        if r["described_device"]:
            avail = f"on this host: {avail}"
        lines.append(f"  {b['name']:<10} {avail}")
        if b.get("enable_hint"):
            lines.append(f"  {'':<10} hint: {b['enable_hint']}")
        if b["build_config"]:
            lines.append(f"  {'':<10} build: {_build_text(b['build_config'])}")
        if b.get("selfcheck"):
            checks = ", ".join(f"{where} {verdict}" for where, verdict in b["selfcheck"].items())
            lines.append(f"  {'':<10} self-check: {checks}")
        if b.get("reasons") is not None:
            if b["reasons"]:
                lines.append(f"  {'':<10} cannot serve the typical call on this device, because:")
                lines += [f"  {'':<12} - {reason}" for reason in b["reasons"]]
            else:
                lines.append(f"  {'':<10} serves the typical call on this device")
    tc = r["typical_call"]
    lines.append("")
    lines.append(f"Selected for a typical call ({tc['dtype']}, head_dim {tc['head_dim']}, forward): {r['selected']}")
    lines.append(f"  why: {r['selected_why']}")
    lines.append("")

    names = [b["name"] for b in r["backends"] if b.get("reasons") is not None]
    where = r["matrix"]["device"] or "this host (no GPU)"
    lines.append(f"Support matrix on {where}")
    width = max(len(row["title"]) for row in r["matrix"]["rows"])
    lines.append(f"  {'feature':<{width}}  " + "".join(f"{n:<12}" for n in names))
    for row in r["matrix"]["rows"]:
        # An emoji is two columns wide: the symbol, a space, then the word padded to 9.
        cells = "".join(f"{_SYMBOL[row['status'][n]]} {_LABEL.get(row['status'][n], row['status'][n]):<9}"
                        for n in names)
        lines.append(f"  {row['title']:<{width}}  " + cells)
    lines.append("  ✅ verified: GPU suite passed on this arch · 🔷 at-budget: passed on other hardware at this "
                 "arch's shared-memory budget · 🟡 compiled: self-checked on first use · ❌ no: falls back")
    if "selftest" in r:
        lines += ["", "Self-check", json.dumps(r["selftest"], indent=2, default=str)]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `portattn-report | head`: the reader left, which is fine
        sys.stdout = open(os.devnull, "w")
        return 0


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = argparse.ArgumentParser(prog="portattn-report", description="What portattn can run on this machine, and why.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--selftest", action="store_true", help="run every compiled backend's self-check now")
    # Testing and docs: render the report for a preset device instead of probing.
    parser.add_argument("--device-desc", metavar="KIND", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device_desc is not None:
        kind = args.device_desc.strip().lower()
        if kind not in ("cpu", "none"):
            try:
                probe.fake_device(kind)
            except ValueError as error:
                parser.error(str(error))
    report = collect(args.device_desc, selftest=args.selftest and args.json)
    if args.json:
        print(json.dumps(report, indent=2, default=str, ensure_ascii=False))
        return 0
    print(render_text(report))
    if args.selftest:
        print("\nSelf-check")
        result = _selftest(report_text=True)
        if isinstance(result, dict) and "error" in result:
            print(f"  {result['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
