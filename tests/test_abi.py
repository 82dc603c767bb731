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
    assert (args.philox_seed, args.philox_offset, args.seqused_k) == (11, 12, 0)
    assert (args.total_q, args.total_k, args.dtype, args.stream) == (5, 7, abi.DTYPE_CODES[torch.bfloat16], 99)
