"""Backend choice, explain(), forced backends, fallback warnings and the first-use self-check,
exercised on CPU with injected backends."""
import warnings

import pytest
import torch

import portattn
from portattn import dispatch, selfcheck
from portattn.backends.reference import ReferenceBackend


class FakeCompiled(ReferenceBackend):
    """A 'compiled' backend that runs on CPU, supports only causal float32 calls with
    head dims <= 32, and (optionally) computes a wrong answer."""

    name = "fake"

    def __init__(self, wrong=False, verified=False):
        self.wrong, self.verified, self.calls = wrong, verified, 0

    def unsupported_reasons(self, call):
        reasons = []
        if call.dtype not in ("float32", "float16", "bfloat16"):
            reasons.append(f"dtype {call.dtype} not supported (fake: float32, float16, bfloat16)")
        if call.head_dim > 128:
            reasons.append(f"head_dim {call.head_dim} > 128 (fake supports up to 128)")
        if call.uses("softcap"):
            reasons.append("feature softcap not supported by fake")
        return reasons

    def needs_selfcheck(self, device):
        return not self.verified

    def forward(self, q, k, v, out, lse, **kwargs):
        self.calls += 1
        super().forward(q, k, v, out, lse, **kwargs)
        if self.wrong:
            out.mul_(1.5)


@pytest.fixture
def use_backends(monkeypatch):
    def install(backend, forced=None):
        slots = [dispatch._BackendSlot("fake", backend), dispatch._BackendSlot("reference", ReferenceBackend())]
        monkeypatch.setattr(dispatch, "DISPATCHER", dispatch.Dispatcher(slots, forced))
        return backend

    return install


def qkv(head_dim=32, dtype=torch.float32):
    return [torch.randn(1, 6, 2, head_dim, dtype=dtype) for _ in range(3)]


def test_first_fitting_backend_runs_and_decision_is_cached(use_backends):
    fake = use_backends(FakeCompiled(verified=True))
    q, k, v = qkv()
    portattn.flash_attn_func(q, k, v, causal=True)
    portattn.flash_attn_func(q, k, v, causal=True)
    assert fake.calls == 2
    assert len(dispatch.DISPATCHER._decisions) == 1


def test_unsupported_call_falls_back_with_one_warning_naming_the_reason(use_backends):
    fake = use_backends(FakeCompiled(verified=True))
    # CPU calls never warn (the reference is the natural CPU backend), so describe a
    # GPU call to the warning logic directly.
    q, k, v = qkv(head_dim=160)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call = dispatch.call_spec(torch.device("cuda", 0), torch.float32, 160, dispatch.feature_bits(-1, -1, 0.0, False, 0.0, False, False))
        dispatch.DISPATCHER._warn_fallback(call, dispatch.DISPATCHER.evaluate(call, torch.device("cpu")))
        dispatch.DISPATCHER._warn_fallback(call, dispatch.DISPATCHER.evaluate(call, torch.device("cpu")))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert "reference backend" in messages[0] and "head_dim 160 > 128" in messages[0]
    portattn.flash_attn_func(q, k, v)
    assert fake.calls == 0  # served by the reference backend


def test_explain_lists_every_backend_and_reason(use_backends):
    use_backends(FakeCompiled(verified=True))
    q, k, v = qkv(head_dim=160)
    explanation = portattn.explain(q, k, v, softcap=3.0)
    assert explanation.chosen == "reference"
    assert explanation.reasons["fake"] == ["head_dim 160 > 128 (fake supports up to 128)", "feature softcap not supported by fake"]
    assert explanation.reasons["reference"] == []
    assert "fake: head_dim 160 > 128" in str(explanation)
    q, k, v = qkv()
    assert portattn.explain(q, k, v, causal=True).chosen == "fake"


def test_forced_backend_raises_instead_of_falling_back(use_backends):
    use_backends(FakeCompiled(verified=True), forced="fake")
    q, k, v = qkv(head_dim=160)
    with pytest.raises(portattn.UnsupportedCallError, match="head_dim 160 > 128"):
        portattn.flash_attn_func(q, k, v)


def test_unknown_forced_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="is not a backend; choose one of"):
        dispatch.Dispatcher(dispatch.DISPATCHER.slots, "tpu")


def test_wrong_backend_is_disabled_by_the_selfcheck(use_backends):
    fake = use_backends(FakeCompiled(wrong=True))
    q, k, v = qkv()
    with pytest.warns(RuntimeWarning, match="disabled.*failed self-check"):
        out = portattn.flash_attn_func(q, k, v, causal=True)
    from naive import naive_attention

    assert (out.double() - naive_attention(q, k, v, causal=True)[0]).abs().max() < 1e-5
    # The verdict is cached on disk: a new process (a new dispatcher) does not re-run it.
    cache = selfcheck._load_cache()
    assert any(key.startswith("fake|") and value for key, value in cache.items())
    calls = fake.calls
    assert selfcheck.ensure_verified(fake, torch.device("cpu")) != ""
    assert fake.calls == calls


def test_correct_backend_passes_the_selfcheck(use_backends):
    fake = use_backends(FakeCompiled(wrong=False))
    q, k, v = qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        portattn.flash_attn_func(q, k, v, causal=True)
    assert fake.calls > 1  # the self-check ran it, then the call itself
    assert selfcheck.check_backend(fake, torch.device("cpu"))
    assert all(v == "ok" for v in selfcheck.check_backend(fake, torch.device("cpu")).values())


def test_selfcheck_can_be_disabled(use_backends, monkeypatch):
    monkeypatch.setenv("PORTATTN_SELFCHECK", "0")
    fake = use_backends(FakeCompiled(wrong=True))
    q, k, v = qkv()
    portattn.flash_attn_func(q, k, v, causal=True)
    assert fake.calls == 1


def test_report_state_and_selected_backends():
    state = dispatch.report_state()
    names = [b["name"] for b in state["backends"]]
    assert names[-1] == "reference" and "cuda" in names and "rocm" in names
    assert portattn.selected_backends()[-1] == "reference"
    for entry in state["backends"]:
        assert entry["available"] or entry["why"]


def test_reference_forced_by_name(monkeypatch):
    monkeypatch.setattr(dispatch, "DISPATCHER", dispatch.Dispatcher(dispatch.DISPATCHER.slots, "reference"))
    q, k, v = qkv()
    assert portattn.explain(q, k, v).chosen == "reference"
    assert portattn.selected_backends() == ["reference"]


def test_selfcheck_force_checks_verified_backends_and_ignores_the_cache(use_backends, monkeypatch):
    monkeypatch.setenv("PORTATTN_SELFCHECK", "force")
    fake = use_backends(FakeCompiled(wrong=True, verified=True))
    q, k, v = qkv()
    with pytest.warns(RuntimeWarning, match="failed self-check"):
        portattn.flash_attn_func(q, k, v, causal=True)
    calls = fake.calls
    assert selfcheck.ensure_verified(fake, torch.device("cpu")) != ""
    assert fake.calls > calls  # ran again: force never trusts the cache


def test_one_backend_registry_specs_name_their_classes_and_dispatch_follows_the_priority_list():
    """The specs are the registry: dispatch's order is matrix.DISPATCH_PRIORITY, and each spec's
    `implementation` is a Backend class whose `name` is the spec's (so the two cannot diverge)."""
    import importlib

    from portattn.backends.base import Backend
    from portattn.capability import matrix

    assert sorted(matrix.DISPATCH_PRIORITY) == sorted(matrix.BACKEND_NAMES)
    assert matrix.DISPATCH_PRIORITY[-1] == "reference"  # serves every call: the last resort
    assert dispatch.BACKEND_NAMES == matrix.DISPATCH_PRIORITY
    assert [slot.name for slot in dispatch.DISPATCHER.slots] == list(matrix.DISPATCH_PRIORITY)
    for spec in matrix.backend_specs():
        module_name, class_name = spec.implementation.split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        assert issubclass(cls, Backend) and cls.name == spec.name, spec.implementation
