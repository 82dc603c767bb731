"""First-use self-verification of backends that were never run on this architecture.

A backend whose support-matrix status for the current arch is `compiled` (built
but not verified on such hardware: every ROCm arch, CUDA archs other than the
ones our GPU suite ran on) is checked once against the reference backend before
its first call: a few small shapes, forward and backward, each dtype it
supports, with and without causal. The verdict is cached per (backend, build,
arch, driver) in the user cache directory, so later processes pay nothing and a
warm call never does (dispatch caches its decisions). On failure the backend is
disabled for that device with a warning and dispatch falls back.

PORTATTN_SELFCHECK=0 skips it (trust the build); PORTATTN_SELFCHECK=force checks
every compiled backend, verified archs too, ignoring the cache (to vet an install);
PORTATTN_CACHE_DIR moves the cache.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from typing import Optional

import torch

from .backends.base import Backend
from .backends.reference import ReferenceBackend
from .capability.callspec import CallSpec

# Small shapes that still cross tile edges (odd lengths, seqlen_q != seqlen_k, GQA).
_SHAPES = (
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim
    (2, 17, 33, 4, 2, 64),
    (1, 130, 67, 2, 2, 128),
)
# A self-check catches broken kernels (errors of order 1), not last-bit precision:
# allowed error = factor x the error of plain PyTorch math in the same dtype + slack.
_OUT_FACTOR, _GRAD_FACTOR, _SLACK = 3.0, 4.0, 1e-2


def cache_dir() -> str:
    base = os.environ.get("PORTATTN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "portattn"
    )
    return base


def _cache_path() -> str:
    return os.path.join(cache_dir(), "selfcheck.json")


def _load_cache() -> dict:
    try:
        with open(_cache_path()) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def _store(key: str, verdict: str) -> None:
    cache = _load_cache()
    cache[key] = verdict
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=cache_dir())
        with os.fdopen(handle, "w") as out:
            json.dump(cache, out, indent=1, sort_keys=True)
        os.replace(tmp, _cache_path())  # atomic: concurrent processes never read half a file
    except OSError:
        pass  # a read-only home only costs a re-check next time


def _device_identity(device: torch.device) -> tuple[str, str]:
    """(arch, driver) of a device, as the cache key needs them."""
    if device.type != "cuda":
        return device.type, "none"
    props = torch.cuda.get_device_properties(device)
    arch = getattr(props, "gcnArchName", "") or f"sm{props.major}{props.minor}"
    driver = torch.version.hip or torch.version.cuda or "?"
    return arch.split(":")[0], str(driver)


def _build_identity(backend: Backend) -> str:
    config = {}
    if hasattr(backend, "build_config"):
        try:
            config = backend.build_config()
        except Exception:
            config = {}
    return hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def needs_selfcheck(backend: Backend, device: torch.device) -> bool:
    """True unless the support matrix says the backend was verified on this device's arch."""
    own = getattr(backend, "needs_selfcheck", None)
    if callable(own):
        return bool(own(device))
    if device.type != "cuda":
        return False
    try:
        from .capability import archs, matrix

        arch = archs.parse_arch(_device_identity(device)[0])
        status = matrix.feature_status(backend.name, arch).get("forward")
    except Exception:
        return True  # unknown status: verify rather than trust
    return status != "verified"


def ensure_verified(backend: Backend, device: torch.device) -> str:
    """'' if the backend may run on `device`, else why it is disabled. Cached on disk."""
    mode = os.environ.get("PORTATTN_SELFCHECK", "1")
    if mode == "0" or (mode != "force" and not needs_selfcheck(backend, device)):
        return ""
    arch, driver = _device_identity(device)
    key = f"{backend.name}|{_build_identity(backend)}|{arch}|{driver}"
    cached = None if mode == "force" else _load_cache().get(key)
    if cached is not None:
        return cached
    results = check_backend(backend, device)
    failures = [f"{case}: {detail}" for case, detail in results.items() if detail != "ok"]
    verdict = "" if not failures else "failed self-check against the reference backend (" + "; ".join(failures[:3]) + ")"
    _store(key, verdict)
    return verdict


def _low_precision_error(q, k, v, ref_out, scale, causal):
    """Max error of plain PyTorch math on the same low-precision inputs (the baseline)."""
    groups = q.shape[2] // k.shape[2]
    kk = k.repeat_interleave(groups, dim=2)
    vv = v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        rows = torch.arange(sq, device=q.device).unsqueeze(1)
        cols = torch.arange(sk, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(cols > rows + sk - sq, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vv)
    return (out.float() - ref_out).abs().max().item()


def _supports(backend: Backend, dtype_name: str, head_dim: int, device: torch.device, features) -> bool:
    call = CallSpec(dtype_name, head_dim, head_dim, device.type, frozenset(features), device.index)
    try:
        return not backend.unsupported_reasons(call)
    except Exception:
        return False


def check_backend(backend: Backend, device: torch.device) -> dict:
    """Run the self-check now; {case: "ok" | what went wrong}. Used by selftest too."""
    reference = ReferenceBackend()
    results = {}
    generator = torch.Generator(device="cpu").manual_seed(1234)
    for dtype in (torch.float16, torch.bfloat16):
        dtype_name = str(dtype).replace("torch.", "")
        for batch, sq, sk, nheads, nheads_k, head_dim in _SHAPES:
            for causal in (False, True):
                features = {"forward", "causal"} if causal else {"forward"}
                if nheads != nheads_k:
                    features.add("gqa")
                if not _supports(backend, dtype_name, head_dim, device, features):
                    continue
                with_grad = _supports(backend, dtype_name, head_dim, device, features | {"backward"})
                case = f"{dtype_name} {batch}x{sq}x{sk} h{nheads}/{nheads_k} d{head_dim}{' causal' if causal else ''}"
                try:
                    results[case] = _check_case(
                        backend, reference, device, dtype, generator,
                        (batch, sq, sk, nheads, nheads_k, head_dim), causal, with_grad,
                    )
                except Exception as error:  # a crash is a failed check, reported, not raised
                    results[case] = f"raised {type(error).__name__}: {error}"
    return results


def _run(backend, q, k, v, scale, causal, dout: Optional[torch.Tensor]):
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32, device=q.device)
    options = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1],
                   softmax_scale=scale, window_left=-1, window_right=0 if causal else -1, softcap=0.0,
                   alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0)
    backend.forward(q, k, v, out, lse, **options)
    if dout is None:
        return out, None
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    backend.backward(dout, q, k, v, out, lse, *grads, deterministic=False, **options)
    return out, grads


def _check_case(backend, reference, device, dtype, generator, shape, causal, with_grad) -> str:
    batch, sq, sk, nheads, nheads_k, head_dim = shape
    scale = 1.0 / math.sqrt(head_dim)

    def draw(*dims):
        return torch.randn(*dims, generator=generator).to(device=device, dtype=dtype)

    q, k, v = draw(batch, sq, nheads, head_dim), draw(batch, sk, nheads_k, head_dim), draw(batch, sk, nheads_k, head_dim)
    dout = draw(batch, sq, nheads, head_dim) if with_grad else None
    ref_out, ref_grads = _run(reference, q.float(), k.float(), v.float(), scale, causal,
                              None if dout is None else dout.float())
    out, grads = _run(backend, q, k, v, scale, causal, dout)
    if torch.cuda.is_available() and device.type == "cuda":
        torch.cuda.synchronize(device)
    baseline = _low_precision_error(q, k, v, ref_out, scale, causal)
    error = (out.float() - ref_out).abs().max().item()
    if not error <= _OUT_FACTOR * baseline + _SLACK:  # also catches NaN (unwritten output)
        return f"out error {error:.3g} > {_OUT_FACTOR} x {baseline:.3g} + {_SLACK}"
    if grads is not None:
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
            error = (got.float() - want).abs().max().item()
            allowed = _GRAD_FACTOR * max(baseline, 1e-3) * max(1.0, want.abs().max().item()) + _SLACK
            if not error <= allowed:
                return f"{name} error {error:.3g} > {allowed:.3g}"
    return "ok"


def run_selftest(slots, report: bool = True) -> dict:
    """`portattn-report --selftest`: check every available compiled backend on every device now.

    `slots` are the dispatcher's backend slots (`dispatch.DISPATCHER.slots`), passed in so this
    module never imports the dispatcher that imports it."""
    results = {}
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    for slot in slots:
        if slot.name == "reference":
            continue
        if slot.backend is None:
            results[slot.name] = {"skipped": slot.why_unavailable}
            continue
        if not devices:
            results[slot.name] = {"skipped": "no GPU device visible"}
            continue
        for device in devices:
            results[f"{slot.name} on {device}"] = check_backend(slot.backend, device)
    if report:
        for name, cases in results.items():
            print(name)
            for case, verdict in cases.items():
                print(f"  {case}: {verdict}")
    return results
