"""The one place that decides which backend runs a call, and can say why.

At import, the compiled backends are loaded (or their reason for being
unavailable is recorded) and put in priority order; PORTATTN_BACKEND forces
one. Per call, `backend_for` maps a small key (device, dtype, head dim,
feature bits) to the first backend whose support declaration accepts the
call; decisions are cached, so a warm call pays one dict lookup.

A call no compiled backend accepts runs on the reference backend with a
warning (once per distinct reason). If the user forced a backend, such a call
raises UnsupportedCallError instead.
"""
from __future__ import annotations

import importlib
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import selfcheck
from .backends.base import Backend
from .backends.reference import ReferenceBackend
from .capability import matrix, smem_cap
from .capability.callspec import FEATURES, CallSpec

# Priority order and implementations come from the specs (capability/matrix.DISPATCH_PRIORITY,
# each spec's `implementation`). Each entry: (name, module, class); the reference backend is
# constructed directly, last.
_COMPILED = tuple(
    (name, *matrix.get_spec(name).implementation.split(":"))
    for name in matrix.DISPATCH_PRIORITY if name != "reference"
)
BACKEND_NAMES = tuple(name for name, _, _ in _COMPILED) + ("reference",)

_BIT = {name: 1 << i for i, name in enumerate(FEATURES)}
DECODE_BIT = _BIT["decode"]
SEQUSED_K_BIT = _BIT["seqused_k"]
_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}


_UNDECIDED = object()  # decode_backend_for's cached answer may be None


class UnsupportedCallError(ValueError):
    """The backend the user forced cannot run this call (the message lists why)."""


def feature_bits(
    window_left: int,
    window_right: int,
    softcap: float,
    has_alibi: bool,
    dropout_p: float,
    gqa: bool,
    varlen: bool,
    backward: bool = False,
    deterministic: bool = False,
    paged_kv: bool = False,
    decode: bool = False,
    seqused_k: bool = False,
    fp8_kv: bool = False,
) -> int:
    """The features a call uses, as an int (cheap to hash; decoded by `call_spec`)."""
    bits = _BIT["forward"]
    if window_right == 0 and window_left < 0:
        bits |= _BIT["causal"]
    elif window_left >= 0 or window_right >= 0:
        bits |= _BIT["window"]
    if softcap > 0.0:
        bits |= _BIT["softcap"]
    if has_alibi:
        bits |= _BIT["alibi"]
    if dropout_p > 0.0:
        bits |= _BIT["dropout"]
    if gqa:
        bits |= _BIT["gqa"]
    if varlen:
        bits |= _BIT["varlen"]
    if backward:
        bits |= _BIT["backward"]
        if deterministic:
            bits |= _BIT["deterministic_backward"]
    if paged_kv:
        bits |= _BIT["paged_kv"]
    if decode:
        bits |= _BIT["decode"]
    if seqused_k:
        bits |= _BIT["seqused_k"]
    if fp8_kv:
        bits |= _BIT["fp8_kv"]
    return bits


def call_spec(device: torch.device, dtype: torch.dtype, head_dim: int, bits: int) -> CallSpec:
    features = frozenset(name for name, bit in _BIT.items() if bits & bit)
    return CallSpec(
        dtype=_DTYPE_NAMES[dtype],
        head_dim=head_dim,
        head_dim_v=head_dim,
        device_type=device.type,
        features=features,
        device_index=_device_index(device),
    )


def _device_index(device: torch.device) -> Optional[int]:
    # Tensors always carry their index; a bare torch.device("cuda") means the current one.
    if device.index is not None or device.type != "cuda":
        return device.index
    return torch.cuda.current_device()


@dataclass
class _BackendSlot:
    name: str
    backend: Optional[Backend]
    why_unavailable: str = ""
    # Per device index: None = not checked yet, "" = passed, else why it is disabled.
    selfcheck: dict = field(default_factory=dict)


class Dispatcher:
    def __init__(self, slots: list, forced: Optional[str]):
        if forced is not None and forced not in [slot.name for slot in slots]:
            known = ", ".join(slot.name for slot in slots)
            raise ValueError(f"PORTATTN_BACKEND={forced!r} is not a backend; choose one of: {known}")
        self.slots = slots
        self.forced = forced
        self._decisions: dict = {}
        self._warned: set = set()
        self._lock = threading.Lock()
        # Set when PORTATTN_BACKEND names no backend (_initial_dispatcher) or PORTATTN_MAX_SMEM_KIB
        # is invalid (capability/smem_cap.py): every call raises it.
        self.config_error = smem_cap.config_error()

    # ---- the hot path -------------------------------------------------------------
    def backend_for(self, device: torch.device, dtype: torch.dtype, head_dim: int, bits: int) -> Backend:
        # The device object itself is the key's first part: hashing it is cheaper than reading
        # its type and index (two attribute reads that build objects) on every call.
        key = (device, dtype, head_dim, bits)
        backend = self._decisions.get(key)
        if backend is None:
            backend = self._decide(key, device, dtype, head_dim, bits)
        return backend

    def decode_backend_for(self, device: torch.device, dtype: torch.dtype, head_dim: int, bits: int):
        """The compiled backend whose decode kernels serve this call (`bits` has "decode"),
        or None: the caller then gathers the cache into a packed varlen call, which
        dispatches (and warns, or raises for a forced backend) like any other call."""
        key = ("decode", device, dtype, head_dim, bits)
        chosen = self._decisions.get(key, _UNDECIDED)
        if chosen is not _UNDECIDED:
            return chosen
        if self.config_error:
            raise ValueError(self.config_error)
        call = call_spec(device, dtype, head_dim, bits)
        chosen = None
        for slot, reasons in self.evaluate(call, device):
            if self.forced is not None and slot.name != self.forced:
                continue
            if not reasons and getattr(slot.backend, "has_decode", lambda: False)():
                chosen = slot.backend
                break
        with self._lock:
            self._decisions[key] = chosen
        return chosen

    # ---- the cold path ------------------------------------------------------------
    def _decide(self, key, device, dtype, head_dim, bits) -> Backend:
        if self.config_error:
            raise ValueError(self.config_error)
        call = call_spec(device, dtype, head_dim, bits)
        verdicts = self.evaluate(call, device)
        chosen = next((slot for slot, reasons in verdicts if not reasons), None)
        if self.forced is not None:
            slot, reasons = next((s, r) for s, r in verdicts if s.name == self.forced)
            if reasons:
                raise UnsupportedCallError(
                    f"PORTATTN_BACKEND={self.forced} cannot run this call ({_describe(call)}): "
                    + "; ".join(reasons)
                )
            chosen = slot
        elif chosen is not None and chosen.name == "reference":
            self._warn_fallback(call, verdicts)
        with self._lock:
            self._decisions[key] = chosen.backend
        return chosen.backend

    def evaluate(self, call: CallSpec, device: torch.device) -> list:
        """[(slot, reasons)] in priority order; reasons == [] means the backend would run."""
        verdicts = []
        for slot in self.slots:
            if slot.backend is None:
                verdicts.append((slot, [slot.why_unavailable]))
                continue
            reasons = list(slot.backend.unsupported_reasons(call))
            if not reasons and slot.name != "reference":
                failed = self._selfcheck(slot, device)
                if failed:
                    reasons.append(failed)
            verdicts.append((slot, reasons))
        return verdicts

    def _selfcheck(self, slot: _BackendSlot, device: torch.device) -> str:
        index = _device_index(device)
        verdict = slot.selfcheck.get((device.type, index))
        if verdict is None:
            verdict = selfcheck.ensure_verified(slot.backend, device)
            slot.selfcheck[(device.type, index)] = verdict
            if verdict:
                warnings.warn(f"portattn: backend {slot.name} disabled on {device}: {verdict}", RuntimeWarning, stacklevel=4)
        return verdict

    def _warn_fallback(self, call: CallSpec, verdicts) -> None:
        compiled = [(slot, reasons) for slot, reasons in verdicts if slot.name != "reference"]
        if call.device_type == "cpu" or not compiled:
            return  # the reference backend is the natural one on CPU
        why = "; ".join(f"{slot.name}: {', '.join(reasons)}" for slot, reasons in compiled)
        message = f"portattn: running {_describe(call)} on the reference backend (pure PyTorch, slower) because {why}"
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, RuntimeWarning, stacklevel=5)


def _describe(call: CallSpec) -> str:
    used = sorted(call.features - {"forward"})
    return f"{call.dtype} head_dim={call.head_dim} on {call.device_type}" + (f" with {', '.join(used)}" if used else "")


def _load_slots() -> list:
    slots = []
    for name, module_name, class_name in _COMPILED:
        try:
            backend = getattr(importlib.import_module(module_name), class_name)()
        except Exception as error:  # a missing or broken build must not break `import portattn`
            slots.append(_BackendSlot(name, None, f"not available ({type(error).__name__}: {error})"))
            continue
        why = getattr(backend, "unavailable_reason", "") or ""
        slots.append(_BackendSlot(name, None if why else backend, why))
    slots.append(_BackendSlot("reference", ReferenceBackend()))
    return slots


def _forced_from_env() -> Optional[str]:
    value = os.environ.get("PORTATTN_BACKEND", "").strip().lower()
    return value or None


def _initial_dispatcher() -> Dispatcher:
    """The dispatcher PORTATTN_BACKEND asks for. A name that is no backend must not break
    `import portattn` (nor the report CLI, which says what is wrong): dispatch then runs
    automatically but every call raises the ValueError until force_backend() is called.
    An invalid PORTATTN_MAX_SMEM_KIB does the same, for as long as the process runs."""
    slots = _load_slots()
    try:
        return Dispatcher(slots, _forced_from_env())
    except ValueError as error:
        dispatcher = Dispatcher(slots, None)
        dispatcher.config_error = "; ".join(e for e in (str(error), dispatcher.config_error) if e)
        return dispatcher


DISPATCHER = _initial_dispatcher()


def force_backend(name: Optional[str]) -> None:
    """Force one backend for every later call (None: automatic). Same as PORTATTN_BACKEND."""
    global DISPATCHER
    DISPATCHER = Dispatcher(DISPATCHER.slots, name)


def selected_backends() -> list:
    """Names of the usable backends in the order dispatch tries them."""
    if DISPATCHER.forced:
        return [DISPATCHER.forced]
    return [slot.name for slot in DISPATCHER.slots if slot.backend is not None]


def report_state(device_index: Optional[int] = None) -> dict:
    """What the report CLI shows: availability, build configuration, priority order."""
    backends = []
    for slot in DISPATCHER.slots:
        build_config = None
        if slot.backend is not None and hasattr(slot.backend, "build_config"):
            try:
                build_config = slot.backend.build_config()
            except Exception as error:  # reported, not raised: the report must always print
                build_config = {"error": str(error)}
        backends.append(
            {
                "name": slot.name,
                "available": slot.backend is not None,
                "why": slot.why_unavailable if slot.backend is None else "available",
                "build_config": build_config,
                "selfcheck": {f"{t}:{i}": (v or "passed") for (t, i), v in slot.selfcheck.items()},
            }
        )
    state = {"selected": selected_backends(), "forced": DISPATCHER.forced, "backends": backends}
    if DISPATCHER.config_error:
        state["error"] = DISPATCHER.config_error
    return state


def get_backend(name: str) -> Backend:
    for slot in DISPATCHER.slots:
        if slot.name == name:
            if slot.backend is None:
                raise UnsupportedCallError(f"backend {name} is not available: {slot.why_unavailable}")
            return slot.backend
    raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)}")
