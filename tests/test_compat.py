"""portattn.compat.provide_flash_attn and the flash_attn.bert_padding / layers.rotary helpers."""
import importlib
import sys

import pytest
import torch

import portattn
from portattn import bert_padding, compat, flash_attn_interface, rotary


@pytest.fixture
def clean_flash_attn(monkeypatch):
    """Each test starts and ends with no flash_attn module in sys.modules."""
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]


def test_provide_makes_flash_attn_imports_resolve_to_portattn(clean_flash_attn, monkeypatch):
    monkeypatch.setattr(compat, "_real_flash_attn", lambda: "")
    message = compat.provide_flash_attn()
    assert "flash_attn.flash_attn_interface" in message and "flash_attn.layers.rotary" in message
    import flash_attn
    from flash_attn import flash_attn_func
    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
    from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
    from flash_attn.layers.rotary import apply_rotary_emb

    assert flash_attn_func is portattn.flash_attn_func
    assert _flash_attn_forward is flash_attn_interface._flash_attn_forward
    assert _flash_attn_backward is flash_attn_interface._flash_attn_backward
    assert (unpad_input, pad_input, index_first_axis) == (bert_padding.unpad_input, bert_padding.pad_input, bert_padding.index_first_axis)
    assert apply_rotary_emb is rotary.apply_rotary_emb
    assert flash_attn.__version__ == compat.FLASH_ATTN_API_VERSION
    assert importlib.util.find_spec("flash_attn") is not None  # what libraries probe with
    assert "nothing to do" in compat.provide_flash_attn()
    assert "removed" in compat.withdraw_flash_attn()
    assert "flash_attn" not in sys.modules


def test_a_real_flash_attn_is_not_shadowed_unless_forced(clean_flash_attn, monkeypatch):
    monkeypatch.setattr(compat, "_real_flash_attn", lambda: "installed at /site-packages/flash_attn/__init__.py")
    message = compat.provide_flash_attn()
    assert "left it in place" in message and "force=True" in message
    assert "flash_attn" not in sys.modules
    message = compat.provide_flash_attn(force=True)
    assert "shadowing the real flash_attn installed at" in message
    assert sys.modules["flash_attn"].flash_attn_func is portattn.flash_attn_func


def test_force_replaces_an_already_imported_real_module(clean_flash_attn):
    real = type(sys)("flash_attn")
    real.__file__ = "/real/flash_attn/__init__.py"
    sys.modules["flash_attn"] = real
    sys.modules["flash_attn.ops"] = type(sys)("flash_attn.ops")
    assert "already imported from /real/flash_attn" in compat.provide_flash_attn()
    assert sys.modules["flash_attn"] is real
    compat.provide_flash_attn(force=True)
    assert compat.is_provided() and "flash_attn.ops" not in sys.modules


# ---- bert_padding ---------------------------------------------------------------------


def test_unpad_and_pad_round_trip_with_flash_attn_tuple():
    hidden = torch.randn(3, 5, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    rows, indices, cu_seqlens, max_seqlen, seqused = bert_padding.unpad_input(hidden, mask)
    assert rows.shape == (9, 4)
    assert indices.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 8, 9]
    assert max_seqlen == 5 and isinstance(max_seqlen, int)
    assert seqused.tolist() == [3, 5, 1]
    assert torch.equal(rows, hidden.reshape(15, 4)[indices])
    padded = bert_padding.pad_input(rows, indices, 3, 5)
    assert torch.equal(padded, hidden * mask[..., None])
    padded.sum().backward()
    assert torch.equal(hidden.grad, mask[..., None].float().expand(3, 5, 4))


def test_unused_mask_rows_are_kept_but_not_counted_as_used():
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])
    _, indices, cu_seqlens, max_seqlen, seqused = bert_padding.unpad_input(hidden, mask, unused)
    assert cu_seqlens.tolist() == [0, 3, 6] and max_seqlen == 3
    assert seqused.tolist() == [2, 1]
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]


def test_unpad_names_a_bad_mask():
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        bert_padding.unpad_input(torch.randn(2, 4, 3), torch.ones(2, 5))


# ---- rotary ---------------------------------------------------------------------------


def _tables(seqlen_ro, half):
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * freqs
    return angles.cos(), angles.sin()


def _rotate_by_hand(x, cos, sin, positions, interleaved):
    """Complex multiplication per pair, in float64 (the definition)."""
    x = x.double()
    half = cos.shape[1]
    out = x.clone()
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            p = positions[b][s]
            if not 0 <= p < cos.shape[0]:
                continue
            if interleaved:
                pair = torch.complex(x[b, s, :, 0:2 * half:2], x[b, s, :, 1:2 * half:2])
            else:
                pair = torch.complex(x[b, s, :, :half], x[b, s, :, half:2 * half])
            turned = pair * torch.complex(cos[p], sin[p])
            if interleaved:
                out[b, s, :, 0:2 * half:2], out[b, s, :, 1:2 * half:2] = turned.real, turned.imag
            else:
                out[b, s, :, :half], out[b, s, :, half:2 * half] = turned.real, turned.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", [0, 3, "tensor"])
def test_rotary_matches_the_definition(interleaved, offsets):
    x = torch.randn(2, 5, 3, 10)
    cos, sin = _tables(9, 3)  # rotary_dim 6 < headdim 10: the last 4 dims pass through
    seqlen_offsets = torch.tensor([0, 6]) if offsets == "tensor" else offsets
    shift = [0, 6] if offsets == "tensor" else [offsets, offsets]
    positions = [[s + shift[b] for s in range(5)] for b in range(2)]  # 6 + 4 = 10 >= 9: unrotated
    got = rotary.apply_rotary_emb(x, cos.float(), sin.float(), interleaved=interleaved,
                                  seqlen_offsets=seqlen_offsets)
    want = _rotate_by_hand(x, cos, sin, positions, interleaved)
    assert (got.double() - want).abs().max() < 1e-5
    assert torch.equal(got[..., 6:], x[..., 6:])


def test_rotary_varlen_counts_positions_from_each_sequence_start():
    x = torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    cos, sin = _tables(8, 4)
    got = rotary.apply_rotary_emb(x, cos.float(), sin.float(), cu_seqlens=cu, max_seqlen=4,
                                  seqlen_offsets=torch.tensor([1, 2]))
    first = _rotate_by_hand(x[None, :3], cos, sin, [[1, 2, 3]], False)[0]
    second = _rotate_by_hand(x[None, 3:], cos, sin, [[2, 3, 4, 5]], False)[0]
    assert (got.double() - torch.cat([first, second])).abs().max() < 1e-5


def test_rotary_inplace_and_gradient_is_the_inverse_rotation():
    cos, sin = _tables(6, 4)
    x = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    out = rotary.apply_rotary_emb(x, cos, sin)
    g = torch.randn_like(out)
    out.backward(g)
    # A rotation is orthogonal: its gradient is the rotation by -theta.
    assert torch.allclose(x.grad, rotary.apply_rotary_emb(g, cos, -sin))
    y = x.detach().clone()
    assert rotary.apply_rotary_emb(y, cos, sin, inplace=True) is y
    assert torch.allclose(y, out.detach())


def test_rotary_bad_arguments_are_named():
    x = torch.randn(1, 4, 2, 8)
    cos, sin = _tables(4, 8)
    with pytest.raises(ValueError, match="rotary_dim = 2 \\* cos.shape\\[1\\] = 16"):
        rotary.apply_rotary_emb(x, cos.float(), sin.float())
    cos, sin = _tables(4, 2)
    with pytest.raises(ValueError, match="seqlen_offsets must be an int or an integer tensor of shape \\(1,\\)"):
        rotary.apply_rotary_emb(x, cos.float(), sin.float(), seqlen_offsets=torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="seqlen_offsets must be an int"):
        rotary.apply_rotary_emb(x, cos.float(), sin.float(), seqlen_offsets=1.5)


# ---- ring-flash-attn's calls with sm_margin (Note [ring sm_margin] in portattn/compat.py) ----
needs_ring = pytest.mark.skipif(importlib.util.find_spec("ring_flash_attn") is None,
                                reason="ring-flash-attn is not installed (pip install -e '.[test]')")


@pytest.fixture
def ring_with_margin():
    """ring_flash_attn imported on portattn; its modules call plain portattn functions afterwards."""
    compat.import_ring_flash_attn(merge="ring")
    yield
    compat.install_ring_sm_margin(0)


@needs_ring
def test_ring_modules_pass_sm_margin_through_their_own_keyword_building(ring_with_margin, monkeypatch):
    from ring_flash_attn import stripe_flash_attn, zigzag_ring_flash_attn_varlen
    from ring_flash_attn.utils import get_default_args

    assert "sm_margin=8" in compat.install_ring_sm_margin(8)
    assert compat.ring_sm_margin() == 8
    seen = []
    # The shared bodies take sm_margin last, by position.
    for body in ("_forward", "_backward"):
        original = getattr(flash_attn_interface, body)
        monkeypatch.setattr(flash_attn_interface, body,
                            lambda *a, _b=body, _o=original: seen.append((_b, a[-1])) or _o(*a))
    # Called as ring-flash-attn calls them: a keyword dict from get_default_args, its own keys set.
    q, k, v = (torch.randn(1, 6, 2, 8) for _ in range(3))
    params = get_default_args(stripe_flash_attn._flash_attn_forward).copy()
    params.update(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=None, causal=True, alibi_slopes=None,
                  return_softmax=False, window_size_left=-1, window_size_right=-1)
    out, lse, _, rng_state = stripe_flash_attn._flash_attn_forward(**params)
    params = get_default_args(stripe_flash_attn._flash_attn_backward).copy()
    params.update(dout=torch.randn_like(out), q=q, k=k, v=v, out=out, softmax_lse=lse, dq=None, dk=None, dv=None,
                  dropout_p=0.0, softmax_scale=None, causal=True, alibi_slopes=None, deterministic=False,
                  window_size_left=-1, window_size_right=-1)
    stripe_flash_attn._flash_attn_backward(**params)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    zigzag_ring_flash_attn_varlen._flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 6, 6, 0.0, None, True)
    zigzag_ring_flash_attn_varlen._flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 6, 6, 0.0, None, True,
                                                             sm_margin=2)  # the caller's own value stands
    assert seen == [("_forward", 8), ("_backward", 8), ("_forward", 8), ("_forward", 2)]


@needs_ring
def test_ring_sm_margin_0_restores_portattns_functions_and_bad_values_are_named(ring_with_margin):
    from ring_flash_attn import ring_flash_attn, ring_flash_attn_varlen

    compat.install_ring_sm_margin(131)
    assert ring_flash_attn._flash_attn_forward is not flash_attn_interface._flash_attn_forward
    compat.install_ring_sm_margin(16)  # wraps portattn's function again, not the last wrapper
    assert ring_flash_attn._flash_attn_backward.__wrapped__ is flash_attn_interface._flash_attn_backward
    compat.install_ring_sm_margin(0)
    assert ring_flash_attn._flash_attn_forward is flash_attn_interface._flash_attn_forward
    assert ring_flash_attn_varlen._flash_attn_varlen_backward is flash_attn_interface._flash_attn_varlen_backward
    assert compat.ring_sm_margin() == 0
    with pytest.raises(ValueError, match="sm_margin must be an int >= 0"):
        compat.import_ring_flash_attn(sm_margin=-1)
    with pytest.raises(TypeError, match="sm_margin must be an int >= 0"):
        compat.install_ring_sm_margin(1.0)


@needs_ring
def test_ring_sm_margin_refuses_a_real_flash_attn_2_left_in_place(ring_with_margin, monkeypatch):
    from ring_flash_attn import ring_flash_attn

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                            softcap, alibi_slopes, return_softmax):  # flash-attn 2's: no sm_margin
        raise AssertionError("not called")

    monkeypatch.setattr(ring_flash_attn, "_flash_attn_forward", _flash_attn_forward)
    with pytest.raises(ValueError, match="ring_flash_attn.ring_flash_attn._flash_attn_forward takes no sm_margin"):
        compat.install_ring_sm_margin(8)
    assert ring_flash_attn._flash_attn_backward is flash_attn_interface._flash_attn_backward  # nothing patched
