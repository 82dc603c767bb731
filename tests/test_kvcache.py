"""flash_attn_with_kvcache and paged varlen calls, against a direct computation."""
import pytest
import torch

import portattn
from naive import naive_attention
from portattn.kvcache import apply_rotary


def rand(*shape):
    return torch.randn(*shape)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
def test_append_then_attend(paged, rotary):
    batch, heads, heads_k, dim, capacity, new = 2, 4, 2, 16, 24, 3
    q = rand(batch, new, heads, dim)
    k_new, v_new = rand(batch, new, heads_k, dim), rand(batch, new, heads_k, dim)
    dense_k, dense_v = rand(batch, capacity, heads_k, dim), rand(batch, capacity, heads_k, dim)
    cache_seqlens = torch.tensor([5, 17], dtype=torch.int32)
    cos = sin = None
    if rotary:
        angles = torch.rand(capacity, 4)
        cos, sin = angles.cos(), angles.sin()

    if paged:
        page = 8
        order = torch.randperm(batch * capacity // page)
        block_table = order.reshape(batch, capacity // page).to(torch.int32)
        k_cache = torch.empty(batch * capacity // page, page, heads_k, dim)
        v_cache = torch.empty_like(k_cache)
        k_cache.view(-1, heads_k, dim)[(block_table.long()[:, :, None] * page + torch.arange(page)).flatten()] = dense_k.reshape(-1, heads_k, dim)
        v_cache.view(-1, heads_k, dim)[(block_table.long()[:, :, None] * page + torch.arange(page)).flatten()] = dense_v.reshape(-1, heads_k, dim)
    else:
        block_table, k_cache, v_cache = None, dense_k.clone(), dense_v.clone()

    out, lse = portattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens,
        block_table=block_table, causal=True, rotary_interleaved=(rotary == "interleaved"),
        return_softmax_lse=True,
    )
    assert lse.shape == (batch, heads, new)
    for b in range(batch):
        n = int(cache_seqlens[b])
        qb, kb_new = q[b : b + 1], k_new[b : b + 1]
        if rotary:
            positions = (n + torch.arange(new)).unsqueeze(0)
            kb_new = apply_rotary(kb_new, cos, sin, positions, rotary == "interleaved")
            qb = apply_rotary(qb, cos, sin, positions, rotary == "interleaved")
        keys = torch.cat([dense_k[b : b + 1, :n], kb_new], dim=1)
        values = torch.cat([dense_v[b : b + 1, :n], v_new[b : b + 1]], dim=1)
        want = naive_attention(qb, keys, values, causal=True)[0]
        assert (out[b : b + 1].double() - want).abs().max() < 1e-5
    # The new keys were written into the cache in place.
    if not paged:
        n = int(cache_seqlens[0])
        assert torch.equal(v_cache[0, n : n + new], v_new[0])


def test_rotary_is_a_rotation():
    x = rand(1, 5, 2, 8)
    angles = torch.rand(5, 4)
    for interleaved in (True, False):
        y = apply_rotary(x, angles.cos(), angles.sin(), torch.arange(5).unsqueeze(0), interleaved)
        assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_kvcache_needs_cache_seqlens_to_append():
    q, kc, vc = rand(1, 1, 2, 8), rand(1, 4, 2, 8), rand(1, 4, 2, 8)
    with pytest.raises(ValueError, match="cache_seqlens"):
        portattn.flash_attn_with_kvcache(q, kc, vc, k=rand(1, 1, 2, 8), v=rand(1, 1, 2, 8))


def test_varlen_with_block_table():
    page, heads_k, dim = 4, 2, 8
    lengths = [5, 7]
    k_cache, v_cache = rand(6, page, heads_k, dim), rand(6, page, heads_k, dim)
    block_table = torch.tensor([[3, 0], [5, 1]], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_q = torch.tensor([0, 2, 4], dtype=torch.int32)
    q = rand(4, 4, dim)
    out = portattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 2, 7, causal=True, block_table=block_table)
    for b, n in enumerate(lengths):
        rows = torch.cat([block_table[b, p // page] * page + p % page for p in torch.arange(n)[:, None]]).long()
        keys = k_cache.reshape(-1, heads_k, dim)[rows][None]
        values = v_cache.reshape(-1, heads_k, dim)[rows][None]
        want = naive_attention(q[None, 2 * b : 2 * b + 2], keys, values, causal=True)[0][0]
        assert (out[2 * b : 2 * b + 2].double() - want).abs().max() < 1e-5
