"""A table of bad inputs: each gives a ValueError/TypeError naming the argument."""
import numpy as np
import pytest
import torch

import portattn


def t(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


Q, K, V = t(2, 8, 4, 64), t(2, 8, 2, 64), t(2, 8, 2, 64)
CU = torch.tensor([0, 3, 8], dtype=torch.int32)
VQ, VK = t(8, 4, 64), t(8, 2, 64)

DENSE_CASES = [
    # (id, kwargs overriding (q, k, v) or options, exception, message fragment)
    ("q not a tensor", dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    ("wrong rank", dict(q=t(8, 4, 64)), ValueError, "q must have 4 dimensions"),
    ("int dtype", dict(q=torch.zeros(2, 8, 4, 64, dtype=torch.int32)), TypeError, "supported dtypes"),
    ("mixed dtypes", dict(k=t(2, 8, 2, 64, dtype=torch.bfloat16)), TypeError, "share one dtype"),
    ("k/v shapes differ", dict(v=t(2, 9, 2, 64)), ValueError, "k and v must have the same shape"),
    ("head dim mismatch", dict(k=t(2, 8, 2, 32), v=t(2, 8, 2, 32)), ValueError, "same head dim"),
    ("head dim too large", dict(q=t(2, 8, 4, 264), k=t(2, 8, 2, 264), v=t(2, 8, 2, 264)), ValueError, "head dim must be in [1, 256]"),
    ("heads not divisible", dict(k=t(2, 8, 3, 64), v=t(2, 8, 3, 64)), ValueError, "multiple of the number of key/value heads"),
    ("batch mismatch", dict(k=t(1, 8, 2, 64), v=t(1, 8, 2, 64)), ValueError, "same batch size"),
    ("dropout >= 1", dict(dropout_p=1.0), ValueError, "dropout_p must be in [0, 1)"),
    ("dropout not a number", dict(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
    ("nan scale", dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    ("negative softcap", dict(softcap=-1.0), ValueError, "softcap must be a finite value >= 0"),
    ("nan softcap", dict(softcap=float("nan")), ValueError, "softcap must be a finite value >= 0"),
    ("window not a pair", dict(window_size=5), TypeError, "window_size must be a (left, right) pair"),
    ("window float", dict(window_size=(float("nan"), 0)), TypeError, "window_size left must be an int"),
    ("window below -1", dict(window_size=(-2, 0)), ValueError, "window_size left must be >= -1"),
    ("causal not bool", dict(causal=1), TypeError, "causal must be a bool"),
    ("alibi dtype", dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "alibi_slopes must be float32"),
    ("alibi shape", dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have shape (4,) or (2, 4)"),
    ("sm_margin negative", dict(sm_margin=-1), ValueError, "sm_margin must be an int >= 0"),
    ("sm_margin float", dict(sm_margin=8.0), TypeError, "sm_margin must be an int >= 0"),
    ("sm_margin bool", dict(sm_margin=True), TypeError, "sm_margin must be an int >= 0"),
    ("sm_margin None", dict(sm_margin=None), TypeError, "sm_margin must be an int >= 0"),
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
def test_bad_dense_input(case):
    _, overrides, error, fragment = case
    args = dict(q=Q, k=K, v=V)
    for name in ("q", "k", "v"):
        if name in overrides:
            args[name] = overrides.pop(name)
    with pytest.raises(error) as info:
        portattn.flash_attn_func(args["q"], args["k"], args["v"], **overrides)
    assert fragment in str(info.value)


VARLEN_CASES = [
    ("cu_seqlens int64", dict(cu_seqlens_q=CU.long()), TypeError, "cu_seqlens_q must be int32"),
    ("cu_seqlens 2-D", dict(cu_seqlens_k=CU[None]), ValueError, "cu_seqlens_k must be 1-D"),
    ("max_seqlen not int", dict(max_seqlen_k=5.0), TypeError, "max_seqlen_k must be an int"),
    ("max_seqlen negative", dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0"),
    ("max_seqlen float tensor", dict(max_seqlen_q=torch.tensor(5.0)), TypeError, "max_seqlen_q must be an int"),
    ("batch differs", dict(cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32)), ValueError, "same batch"),
    ("varlen rank", dict(q=t(1, 8, 4, 64)), ValueError, "q must have 3 dimensions"),
    ("sm_margin negative", dict(sm_margin=-8), ValueError, "sm_margin must be an int >= 0"),
    ("sm_margin string", dict(sm_margin="8"), TypeError, "sm_margin must be an int >= 0"),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_bad_varlen_input(case):
    _, overrides, error, fragment = case
    args = dict(q=VQ, k=VK, v=VK.clone(), cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=5, max_seqlen_k=5)
    args.update(overrides)
    with pytest.raises(error) as info:
        portattn.flash_attn_varlen_func(**args)
    assert fragment in str(info.value)


# Checks of cu_seqlens *values* read the tensor on the host (a device sync): they run only
# with PORTATTN_DEBUG_CHECKS=1 (ops._DEBUG_CHECKS, read once at import).
VALUE_CASES = [
    ("non-monotonic", dict(cu_seqlens_q=torch.tensor([0, 5, 3], dtype=torch.int32)), "non-decreasing"),
    ("first not zero", dict(cu_seqlens_k=torch.tensor([1, 3, 8], dtype=torch.int32)), "cu_seqlens_k[0] must be 0"),
    ("past the end", dict(cu_seqlens_q=torch.tensor([0, 3, 9], dtype=torch.int32)), "exceeds the 8 packed rows"),
    ("max_seqlen too small", dict(max_seqlen_q=4), "max_seqlen_q = 4 is smaller than the longest sequence"),
]


@pytest.mark.parametrize("case", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_debug_checks_read_cu_seqlens_values(case, monkeypatch):
    _, overrides, fragment = case
    monkeypatch.setattr(portattn.ops, "_DEBUG_CHECKS", True)
    args = dict(q=VQ, k=VK, v=VK.clone(), cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=5, max_seqlen_k=5)
    args.update(overrides)
    with pytest.raises(ValueError) as info:
        portattn.flash_attn_varlen_func(**args)
    assert fragment in str(info.value)


def test_cpu_varlen_calls_check_values_without_opt_in(monkeypatch):
    """CPU tensors are always checked (no device sync to save there); GPU tensors only with
    PORTATTN_DEBUG_CHECKS=1 (ops.run_forward tests the device type)."""
    calls = []
    monkeypatch.setattr(portattn.ops, "check_cu_seqlens_values", lambda *a: calls.append(a[0]))
    monkeypatch.setattr(portattn.ops, "_DEBUG_CHECKS", False)
    q = VQ.float().requires_grad_()
    out = portattn.flash_attn_varlen_func(q, VK.float(), VK.float(), CU, CU, 5, 5)
    out.sum().backward()
    assert calls == ["cu_seqlens_q", "cu_seqlens_k"] * 2  # forward and backward
    calls.clear()
    monkeypatch.setattr(portattn.ops, "_DEBUG_CHECKS", True)
    portattn.flash_attn_varlen_func(q, VK.float(), VK.float(), CU, CU, 5, 5).sum().backward()
    assert calls == ["cu_seqlens_q", "cu_seqlens_k"] * 2  # forward and backward


def test_integer_like_window_and_max_seqlen():
    np = pytest.importorskip("numpy")
    q, k, v = Q.float(), K.float(), V.float()
    want = portattn.flash_attn_func(q, k, v, window_size=(3, 1))
    for window in (torch.tensor([3, 1]), (torch.tensor(3), torch.tensor(1)), np.array([3, 1]),
                   (np.int64(3), np.int32(1)), [3, 1]):
        assert torch.equal(portattn.flash_attn_func(q, k, v, window_size=window), want), window
    vq, vk = VQ.float(), VK.float()
    want = portattn.flash_attn_varlen_func(vq, vk, vk, CU, CU, 5, 5)
    for max_seqlen in (np.int64(5), torch.tensor(5), torch.tensor([5], dtype=torch.int32)):
        assert torch.equal(portattn.flash_attn_varlen_func(vq, vk, vk, CU, CU, max_seqlen, max_seqlen), want)


@pytest.mark.parametrize("window,error,fragment", [
    (torch.tensor([3.0, 1.0]), TypeError, "window_size must be a (left, right) pair of ints"),
    (torch.tensor([3, 1, 0]), TypeError, "window_size must be a (left, right) pair of ints"),
    ((torch.tensor([3, 1]), 1), TypeError, "window_size left must be an int"),
    ((True, 1), TypeError, "window_size left must be an int"),
    ((1, "2"), TypeError, "window_size right must be an int"),
    (torch.tensor([-3, 1]), ValueError, "window_size left must be >= -1"),
])
def test_bad_window_sizes_name_the_argument(window, error, fragment):
    with pytest.raises(error) as info:
        portattn.flash_attn_func(Q, K, V, window_size=window)
    assert fragment in str(info.value)


class _OnGpu(torch.Tensor):
    """A CPU tensor that reports a CUDA device: the host-read rule without a GPU."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_device_tensors_are_read_back_only_for_window_size():
    from portattn.validation import _window_pair, as_int

    on_gpu = torch.tensor(5).as_subclass(_OnGpu)
    assert on_gpu.device.type == "cuda"
    with pytest.raises(TypeError, match=r"max_seqlen_q must be a host int .*tensor on cuda:0"):
        as_int("max_seqlen_q", on_gpu, ">= 0")
    # window_size: read back (one sync), as flash-attn does.
    assert _window_pair((on_gpu, torch.tensor(2).as_subclass(_OnGpu))) == (5, 2)


def test_devices_must_match():
    meta_k = torch.empty(2, 8, 2, 64, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="one device"):
        portattn.flash_attn_func(Q, meta_k, meta_k)


def test_packed_shapes():
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3"):
        portattn.flash_attn_qkvpacked_func(t(2, 8, 2, 4, 64))
    with pytest.raises(ValueError, match=r"kv must have shape \(total, 2"):
        portattn.flash_attn_varlen_kvpacked_func(VQ, t(8, 3, 2, 64), CU, CU, 5, 5)


# Every entry point that takes sm_margin (FlashAttention-3's), with its other arguments valid.
_KV_CACHE = t(2, 16, 2, 64)
SM_MARGIN_CALLS = {
    "flash_attn_func": lambda m: portattn.flash_attn_func(Q, K, V, sm_margin=m),
    "flash_attn_qkvpacked_func": lambda m: portattn.flash_attn_qkvpacked_func(
        torch.stack([Q, Q, Q], dim=2), sm_margin=m),
    "flash_attn_kvpacked_func": lambda m: portattn.flash_attn_kvpacked_func(Q, torch.stack([K, V], dim=2), sm_margin=m),
    "flash_attn_varlen_func": lambda m: portattn.flash_attn_varlen_func(VQ, VK, VK, CU, CU, 5, 5, sm_margin=m),
    "flash_attn_varlen_qkvpacked_func": lambda m: portattn.flash_attn_varlen_qkvpacked_func(
        torch.stack([VQ, VQ, VQ], dim=1), CU, 5, sm_margin=m),
    "flash_attn_varlen_kvpacked_func": lambda m: portattn.flash_attn_varlen_kvpacked_func(
        VQ, torch.stack([VK, VK], dim=1), CU, CU, 5, 5, sm_margin=m),
    "flash_attn_with_kvcache": lambda m: portattn.flash_attn_with_kvcache(Q[:, :1], _KV_CACHE, _KV_CACHE, sm_margin=m),
}


@pytest.mark.parametrize("name", sorted(SM_MARGIN_CALLS))
def test_sm_margin_is_checked_by_every_entry_point(name):
    call = SM_MARGIN_CALLS[name]
    with pytest.raises(ValueError, match=r"sm_margin must be an int >= 0 \(SMs left free for other kernels\), got -1"):
        call(-1)
    with pytest.raises(TypeError, match="sm_margin must be an int >= 0.*got float 2.5"):
        call(2.5)
    call(np.int64(8))  # integer-likes are accepted, as every int argument
