"""What one decode-step attention call does on the host, counted on the GPU path without a GPU.

bench/tools/host_decode.py's stand-in (the compiled module's entry points as no-ops, dispatch
deciding as for an H100) runs the real Python path; these tests count the torch ops each call
issues (a TorchDispatchMode sees every op, views included) and the cold-path work it repeats.
Every op and every decision here was paid per layer of every generated token before; each test
fails if that per-call work comes back (docs/host-overhead.md, "A decode step's call").
"""
from __future__ import annotations

import collections
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "tools"))
import host_decode  # noqa: E402

pytest.importorskip("transformers")

BATCH, KEYS = 2, 1024


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def gpu_path(monkeypatch):
    """The GPU path's Python over the stand-in module; every change undone afterwards."""
    host_decode.base.load()
    counts: dict = {}
    host_decode.install(counts, patch=monkeypatch.setattr)
    return counts


def _ops_of(call):
    """The torch ops of one warm call (the first calls fill dispatch's and the planner's caches)."""
    with torch.no_grad():
        for _ in range(3):
            call()
        with _Ops() as mode:
            call()
    return dict(mode.ops)


def test_transformers_decode_step_issues_one_allocation_and_no_view(gpu_path):
    # The output, allocated in portattn's layout with the strides the transpose of the query would
    # have: nothing else (no transposes of q, k, v to portattn's layout -- the call goes on
    # heads-first --, no contiguous copies, no mask or option tensors, no split workspace at 1k keys
    # eagerly).
    call = host_decode.make_call("hf_decode", BATCH, KEYS)
    assert _ops_of(call) == {"new_empty_strided": 1}
    assert gpu_path["decode"] == 4


def test_left_padded_decode_step_reads_the_key_bounds_without_new_views(gpu_path):
    # Every layer of a step passes the same key-bounds mask: its two rows are cut once per step
    # (three view ops), not once per layer; q, k and v go on heads-first, untransposed.
    call = host_decode.make_call("hf_decode_leftpad", BATCH, KEYS)
    assert _ops_of(call) == {"new_empty_strided": 1}
    assert gpu_path["decode"] == 4


def test_a_new_key_bounds_tensor_is_cut_again():
    from portattn.integrations import transformers as pt_hf

    bounds = torch.tensor([[0, 3], [9, 9]], dtype=torch.int32).view(2, 2, 1, 1)
    start, end = pt_hf._key_bounds(bounds, 2)
    assert start.tolist() == [0, 3] and end.tolist() == [9, 9]
    bounds.add_(1)  # in place: the version counter moves, so the rows are cut again
    start, end = pt_hf._key_bounds(bounds, 2)
    assert start.tolist() == [1, 4] and end.tolist() == [10, 10]
    other = torch.tensor([[5], [6]], dtype=torch.int32).view(2, 1, 1, 1)
    start, end = pt_hf._key_bounds(other, 1)
    assert start.tolist() == [5] and end.tolist() == [6]


@pytest.mark.parametrize("path", ["kvcache", "func", "varlen"])
def test_decode_shaped_api_calls_issue_one_allocation(gpu_path, path):
    call = host_decode.make_call(path, BATCH, KEYS)
    assert _ops_of(call) == {"empty_like": 1}
    assert gpu_path["decode"] == 4


def test_warm_decode_calls_repeat_no_decision(gpu_path, monkeypatch):
    """Dispatch and the split planner are looked up, never re-decided (a re-made error buffer
    would show as a `zeros` op in the counts above)."""
    from portattn import decode, dispatch

    calls = [host_decode.make_call(path, BATCH, KEYS) for path in ("hf_decode", "hf_decode_leftpad", "kvcache",
                                                                       "func", "varlen")]
    with torch.no_grad():
        for call in calls:
            call()
    cold = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            cold[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(dispatch.Dispatcher, "evaluate", counted("evaluate", dispatch.Dispatcher.evaluate))
    monkeypatch.setattr(decode, "choose_num_splits", counted("choose_num_splits", decode.choose_num_splits))
    monkeypatch.setattr(decode, "_remember_plan", counted("_remember_plan", decode._remember_plan))
    with torch.no_grad():
        for call in calls:
            call()
    assert cold == {}


def test_the_tool_times_every_portattn_path_on_the_stand_in(tmp_path):
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "host_decode.json"
    done = subprocess.run([sys.executable, "bench/tools/host_decode.py", "--repeat", "1", "--calls", "3", "--paths",
                           "hf_decode,hf_decode_leftpad,kvcache,func,varlen,sdpa_tiny", "--out", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    paths = json.loads(out.read_text())["paths"]
    for name in ("hf_decode", "hf_decode_leftpad", "kvcache", "func", "varlen"):
        assert paths[name]["entry_points"] == ["decode"] and paths[name]["us"] > 0, (name, paths[name])
    assert paths["sdpa_tiny"]["us"] > 0
    assert "\n| hf_decode | " in done.stdout
