"""A table of bad inputs: each gives a ValueError/TypeError naming the argument."""
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
    ("non-monotonic", dict(cu_seqlens_q=torch.tensor([0, 5, 3], dtype=torch.int32)), ValueError, "non-decreasing"),
    ("first not zero", dict(cu_seqlens_k=torch.tensor([1, 3, 8], dtype=torch.int32)), ValueError, "cu_seqlens_k[0] must be 0"),
    ("past the end", dict(cu_seqlens_q=torch.tensor([0, 3, 9], dtype=torch.int32)), ValueError, "exceeds the 8 packed rows"),
    ("max_seqlen too small", dict(max_seqlen_q=4), ValueError, "max_seqlen_q = 4 is smaller than the longest sequence"),
    ("max_seqlen not int", dict(max_seqlen_k=5.0), TypeError, "max_seqlen_k must be an int"),
    ("batch differs", dict(cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32)), ValueError, "same batch"),
    ("varlen rank", dict(q=t(1, 8, 4, 64)), ValueError, "q must have 3 dimensions"),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_bad_varlen_input(case):
    _, overrides, error, fragment = case
    args = dict(q=VQ, k=VK, v=VK.clone(), cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=5, max_seqlen_k=5)
    args.update(overrides)
    with pytest.raises(error) as info:
        portattn.flash_attn_varlen_func(**args)
    assert fragment in str(info.value)


def test_devices_must_match():
    meta_k = torch.empty(2, 8, 2, 64, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="one device"):
        portattn.flash_attn_func(Q, meta_k, meta_k)


def test_packed_shapes():
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3"):
        portattn.flash_attn_qkvpacked_func(t(2, 8, 2, 4, 64))
    with pytest.raises(ValueError, match=r"kv must have shape \(total, 2"):
        portattn.flash_attn_varlen_kvpacked_func(VQ, t(8, 3, 2, 64), CU, CU, 5, 5)
