"""Per-device decisions use the call's tensors' device, never the current one (fake GPUs)."""
import contextlib

import pytest
import torch

from portattn import dispatch
from portattn.backends import compiled
from portattn.backends.cuda import CudaBackend, CudaSm90Backend
from portattn.capability import probe


class OnGpu(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1."""

    @property
    def device(self):
        return torch.device("cuda", 1)


@pytest.fixture
def two_gpus(monkeypatch):
    """cuda:0 is an A100 (current), cuda:1 an H100."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return [probe.fake_device("a100", 0), probe.fake_device("h100", 1)]


def _backend(cls, devices):
    backend = cls.__new__(cls)  # no compiled module here: only the device logic is under test
    backend._devices = devices
    return backend


def test_call_spec_carries_the_tensors_device_index(two_gpus):
    bits = dispatch.feature_bits(-1, -1, 0.0, False, 0.0, False, False)
    assert dispatch.call_spec(torch.device("cuda", 1), torch.float16, 128, bits).device_index == 1
    # A bare "cuda" device means the current one.
    assert dispatch.call_spec(torch.device("cuda"), torch.float16, 128, bits).device_index == 0
    assert dispatch.call_spec(torch.device("cpu"), torch.float32, 64, bits).device_index is None


@pytest.mark.parametrize("cls", [CudaBackend, CudaSm90Backend])
def test_cuda_device_info_is_the_calls_device(two_gpus, cls):
    backend = _backend(cls, two_gpus)
    bits = dispatch.feature_bits(-1, -1, 0.0, False, 0.0, False, False)
    on_second = dispatch.call_spec(torch.device("cuda", 1), torch.bfloat16, 128, bits)
    on_first = dispatch.call_spec(torch.device("cuda", 0), torch.bfloat16, 128, bits)
    assert backend._device_info(on_second).name == two_gpus[1].name  # not the current cuda:0
    assert backend._device_info(on_first).name == two_gpus[0].name
    from portattn.capability.matrix import check_call

    # The Hopper path's verdict follows the device: refused on the A100, served on the H100.
    if cls is CudaSm90Backend:
        assert check_call(backend.name, backend._device_info(on_first), on_first)
        assert check_call(backend.name, backend._device_info(on_second), on_second) == []


def test_dispatch_caches_decisions_per_device_index(two_gpus):
    seen = []

    class Recording:
        name = "recording"

        def unsupported_reasons(self, call):
            seen.append(call.device_index)
            return [] if call.device_index == 1 else ["wrong device"]

    slots = [dispatch._BackendSlot("recording", Recording()),
             dispatch._BackendSlot("reference", dispatch.ReferenceBackend())]
    dispatcher = dispatch.Dispatcher(slots, None)
    dispatcher._selfcheck = lambda slot, device: ""
    bits = dispatch.feature_bits(-1, -1, 0.0, False, 0.0, False, False)
    assert dispatcher.backend_for(torch.device("cuda", 1), torch.float16, 64, bits).name == "recording"
    with pytest.warns(RuntimeWarning, match="recording: wrong device"):
        assert dispatcher.backend_for(torch.device("cuda", 0), torch.float16, 64, bits).name == "reference"
    assert seen == [1, 0]


def test_compiled_calls_run_with_the_tensors_device_current(two_gpus, monkeypatch):
    switched = []

    @contextlib.contextmanager
    def device(index):
        switched.append(index)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(compiled, "_current_device", lambda: 0)
    ran_on = []

    class Fake:
        @compiled.on_tensors_device
        def forward(self, q):
            ran_on.append(list(switched))

    Fake().forward(torch.zeros(2).as_subclass(OnGpu))
    assert ran_on == [[1]]
    switched.clear()
    Fake().forward(torch.zeros(2))  # CPU tensors: no device switch
    assert switched == []


def test_compiled_forward_launches_with_the_tensors_device_current(two_gpus, monkeypatch):
    """forward/backward switch device around their one C call (compiled.launch), not the whole method."""
    from portattn.backends import abi

    current = []

    @contextlib.contextmanager
    def device(index):
        current.append(index)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(compiled, "_current_device", lambda: 0)
    monkeypatch.setattr(abi, "raw_stream", lambda index: 0)
    ran_on = []

    class Module:
        def fwd(self, *args):
            ran_on.append(("fwd", list(current)))

        def hopper_fwd(self, *args):
            ran_on.append(("hopper_fwd", list(current)))

    for cls, entry in ((CudaBackend, "fwd"), (CudaSm90Backend, "hopper_fwd")):
        backend = cls.__new__(cls)
        backend.module = Module()
        for q, expect in ((torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16).as_subclass(OnGpu), [1]),
                          (torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16), [])):  # CPU: no switch
            ran_on.clear()
            backend.forward(q, q, q, q, None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=4, max_seqlen_k=4,
                            softmax_scale=0.5, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                            dropout_p=0.0, rng_seed=0, rng_offset=0)
            assert ran_on == [(entry, expect)]
    # The helper itself: only a different, known index switches.
    calls = []
    for index in (None, 0, 1):
        compiled.launch(index, lambda *args: calls.append((args, list(current))), (index, "x"))
    assert calls == [((None, "x"), []), ((0, "x"), []), ((1, "x"), [1])]
