"""The Python side of the C argument list: abi.FwdArgs names the `fwd` arguments in the order
common/binding_args.h declares them (PORTATTN_FWD_ARG_NAMES), so no caller indexes by position."""
import os
import re

import torch

from portattn.backends import abi

HEADER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "portattn", "backends",
                      "common", "binding_args.h")


def _macro_names(macro):
    """The names a *_ARG_NAMES macro expands to, the groups it names (PORTATTN_TENSOR_ARG_NAMES, ...) expanded."""
    text = open(HEADER).read().replace("\\\n", " ")
    body = re.search(rf"#define {macro}\s+(.*)", text).group(1)
    names = []
    for name in (name.strip() for name in body.split(",")):
        names.extend(_macro_names(name) if name.startswith("PORTATTN_") else [name])
    return tuple(names)


def test_fwd_args_fields_are_the_headers_argument_names_in_order():
    assert abi.FwdArgs._fields == _macro_names("PORTATTN_FWD_ARG_NAMES")


def test_fwd_args_fills_the_fields_by_name(monkeypatch):
    monkeypatch.setattr(abi, "raw_stream", lambda index: 99)  # a CPU torch has no CUDA stream query
    q = torch.zeros(2, 5, 4, 16, dtype=torch.bfloat16)
    k = v = torch.zeros(2, 7, 2, 16, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, 5)
    args = abi.fwd_args(q, k, v, q, lse, None, None, 0, 0, 0.25, 3, 1, 7.5, None, 0.0, 11, 12)
    assert isinstance(args, tuple) and len(args) == len(abi.FwdArgs._fields)
    assert (args.q, args.k, args.lse) == (q.data_ptr(), k.data_ptr(), lse.data_ptr())
    assert abi.workspace_shape(args) == (2, 4, 2, 16, 5, 7)
    assert (args.window_left, args.window_right, args.softcap, args.softmax_scale) == (3, 1, 7.5, 0.25)
    assert (args.philox_seed, args.philox_offset, args.seqused_k, args.sm_margin) == (11, 12, 0, 0)
    assert (args.total_q, args.total_k, args.dtype, args.stream) == (5, 7, abi.DTYPE_CODES[torch.bfloat16], 99)


def _fwd_args_by_name(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, left, right, softcap, alibi, dropout_p,
                      seed, offset, rng_state=None, seqused_k=None, sm_margin=0):
    """What abi.fwd_args must return, each field filled by its name (abi.fwd_args builds the tuple by
    position, for speed: this is the check that no two fields are swapped)."""
    varlen = cu_q is not None
    if varlen:
        (total_q, nheads, headdim), (total_k, nheads_k, _) = q.shape, k.shape
        batch, seqlen_q, seqlen_k = cu_q.shape[0] - 1, max_q, max_k
        lse_strides = (0, 0 if lse is None else lse.stride(0))
    else:
        batch, seqlen_q, nheads, headdim = q.shape
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        total_q, total_k = seqlen_q, seqlen_k
        lse_strides = (0, 0) if lse is None else (lse.stride(0), lse.stride(1))
    return abi.FwdArgs(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(), lse=0 if lse is None else lse.data_ptr(),
        q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride(), out_strides=out.stride(),
        lse_batch_stride=lse_strides[0], lse_head_stride=lse_strides[1], dtype=abi.DTYPE_CODES[q.dtype],
        batch=batch, nheads=nheads, nheads_k=nheads_k, headdim=headdim, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        cu_seqlens_q=cu_q.data_ptr() if varlen else 0, cu_seqlens_k=cu_k.data_ptr() if varlen else 0,
        seqused_k=0 if seqused_k is None else seqused_k.data_ptr(),
        softmax_scale=scale, softcap=softcap, window_left=left, window_right=right,
        alibi_slopes=0 if alibi is None else alibi.data_ptr(),
        alibi_batch_stride=alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0,
        dropout_p=dropout_p, philox_seed=seed, philox_offset=offset, stream=1234, total_q=total_q,
        total_k=total_k, philox_state=0 if rng_state is None else rng_state.data_ptr(), sm_margin=sm_margin,
    )


def test_fwd_args_positions_match_the_fields_in_every_layout(monkeypatch):
    monkeypatch.setattr(abi, "raw_stream", lambda index: 1234)
    bf16 = dict(dtype=torch.bfloat16)
    dense_q = torch.zeros(3, 9, 16, 4, **bf16).transpose(1, 2)  # (3, 16, 9, 4) strided view
    dense_k = torch.zeros(3, 7, 2, 4, **bf16)
    dense_lse = torch.zeros(3, 9, 16).transpose(1, 2)  # strides (144, 1, 16): batch and head differ
    packed_q, packed_k = torch.zeros(20, 6, 8, **bf16), torch.zeros(30, 3, 8, **bf16)
    packed_lse = torch.zeros(6, 20)
    cu_q, cu_k = torch.tensor([0, 5, 20], dtype=torch.int32), torch.tensor([0, 11, 30], dtype=torch.int32)
    slopes_1d, slopes_2d = torch.zeros(16), torch.zeros(3, 17)[:, :16]
    rng_state = torch.zeros(2, dtype=torch.int64)
    seqused = torch.tensor([5, 19], dtype=torch.int32)
    calls = [
        (dense_q, dense_k, dense_k, dense_q.clone(), dense_lse, None, None, 0, 0, 0.5, -1, 0, 0.0, None, 0.0, 7, 8),
        (dense_q, dense_k, dense_k, dense_q, None, None, None, 0, 0, 0.5, 3, 2, 30.0, slopes_1d, 0.1, 7, 8, rng_state),
        (dense_q, dense_k, dense_k, dense_q, dense_lse, None, None, 0, 0, 0.5, -1, -1, 0.0, slopes_2d, 0.0, 0, 0),
        (packed_q, packed_k, packed_k, packed_q, packed_lse, cu_q, cu_k, 15, 19, 0.25, -1, 0, 0.0, slopes_1d, 0.0, 1, 2),
        (packed_q, packed_k, packed_k, packed_q, None, cu_q, cu_k, 15, 19, 0.25, 4, 5, 2.0, None, 0.2, 1, 2, rng_state),
        (dense_q, dense_k, dense_k, dense_q, dense_lse, None, None, 0, 0, 0.5, -1, -1, 0.0, None, 0.0, 0, 0, None,
         None, 8),
        (packed_q, packed_k, packed_k, packed_q, packed_lse, cu_q, cu_k, 15, 19, 0.25, -1, 0, 0.0, None, 0.0, 1, 2,
         None, seqused, 131),
    ]
    for call in calls:
        got = abi.fwd_args(*call)
        assert type(got) is abi.FwdArgs
        assert got._asdict() == _fwd_args_by_name(*call)._asdict()


def test_aligned_needs_a_16_byte_pointer_and_8_element_strides():
    assert abi._aligned(256, (4096, 64, 1))
    assert not abi._aligned(258, (4096, 64, 1))  # pointer
    assert not abi._aligned(256, (4096, 60, 1))  # a non-unit stride
    assert abi._aligned(256, (4096, 64, 3))  # the last stride is not checked (the caller's contract)
    assert abi.workspace_shape(abi.FwdArgs._make(range(len(abi.FwdArgs._fields)))) == (12, 13, 14, 15, 16, 17)
