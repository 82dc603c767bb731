"""Pure-PyTorch backend: every feature, any device; the test oracle and the fallback.

The algorithm is FlashAttention's (Dao et al., 2022; FlashAttention-2, 2023) written with
torch tensor ops instead of tiles in shared memory:

  forward, per query chunk Q_i, over the visible key chunks K_j, V_j:
      S    = scale * Q_i K_j^T            (then softcap, ALiBi, mask: params.h order)
      m'   = max(m, rowmax(S));  P = exp(S - m');  alpha = exp(m - m')
      l    = alpha * l + rowsum(P)
      acc  = alpha * acc + (P * Z) V_j     (Z: dropout keep-mask / (1 - p), or 1)
  then O_i = acc / l and LSE_i = m + log(l); a row with no visible key has l = 0 and
  gets O = 0, LSE = -inf.

  backward, per query chunk, recomputing P = exp(S - LSE) from the saved LSE:
      dV_j += (P * Z)^T dO_i
      dP    = (dO_i V_j^T) * Z
      dS    = P * (dP - D_i),  D_i = rowsum(dO_i * O_i)
      dS   *= 1 - tanh^2        (softcap chain rule; ALiBi and the mask are constants)
      dQ_i += scale * dS K_j;   dK_j += scale * dS^T Q_i

Memory is O(chunk^2 + seqlen): the only seqlen^2-shaped objects are one chunk's scores.
Nothing is saved for autograd; the backward is explicit. GQA never expands K/V: the
query heads of one KV group are folded into the row dimension of each matmul, so the
group sum of dK/dV falls out of the matmul's reduction.

Dropout uses `philox_keep_mask`, an integer-exact copy of backends/common/philox.h,
so the reference drops exactly the entries the compiled kernels drop.
"""
from __future__ import annotations

import struct
from typing import Optional, Sequence, Union

import torch

from ..capability.callspec import CallSpec
from .base import Backend

# Chunk sizes. 512 x 1024 keeps one fp32 score chunk at 2 MiB per (batch, head) while
# each matmul is still large enough to run near peak on a GPU and amortise the Python
# loop overhead (~30 ops per chunk). The key chunk is the larger one because the
# online-softmax carry (m, l, acc) lives per query row and is rescaled once per key
# chunk. SCORE_ELEMENTS caps batch * heads * rows * cols of one chunk (32 MiB of fp32
# scores; the backward holds about five such tensors, the dropout mask generator about
# as much again), so many heads or a large batch shrink the query chunk instead of
# growing memory. Tests lower these to run the multi-chunk paths on small inputs.
QUERY_CHUNK = 512
KEY_CHUNK = 1024
SCORE_ELEMENTS = 1 << 23

_MASK32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------
# Dropout: Philox4x32-10 in int64 torch arithmetic (Note [portattn dropout mask])
# ---------------------------------------------------------------------------------------

_PHILOX_MUL = (0xD2511F53, 0xCD9E8D57)
_PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product of uint32 `a` and uint32 values `b`.

    The product needs 64 unsigned bits; in int64 it wraps modulo 2^64 (two's
    complement, as torch's CPU and CUDA integer kernels do), which keeps every bit.
    Only the reading needs care: `>>` is arithmetic, so the high word is masked to drop
    the copied sign bit. tests/test_philox.py checks this against Python's unbounded
    ints and against philox.h compiled with g++.
    """
    product = a * b
    return (product >> 32) & _MASK32, product & _MASK32


def philox4x32_10(
    counter: Sequence[Union[torch.Tensor, int]], key0: int, key1: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 of a (broadcastable) counter; uint32 values held in int64 tensors."""
    x, y, z, w = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    for _ in range(10):
        hi0, lo0 = _mulhilo32(_PHILOX_MUL[0], x)
        hi1, lo1 = _mulhilo32(_PHILOX_MUL[1], z)
        x, y, z, w = hi1 ^ y ^ key0, lo1, hi0 ^ w ^ key1, lo0
        key0 = (key0 + _PHILOX_WEYL[0]) & _MASK32
        key1 = (key1 + _PHILOX_WEYL[1]) & _MASK32
    return x, y, z, w


def _positions(index: Union[range, torch.Tensor], device) -> torch.Tensor:
    if isinstance(index, range):
        return torch.arange(index.start, index.stop, index.step, device=device, dtype=torch.int64)
    return index.to(device=device, dtype=torch.int64)


def philox_random(
    seed: int,
    offset: int,
    bh_index: Union[int, torch.Tensor],
    rows: Union[range, torch.Tensor],
    cols: Union[range, torch.Tensor],
    device: Union[str, torch.device, None] = None,
) -> torch.Tensor:
    """The uint32 philox.h draws r(b, h, i, j), as int64, shaped (*bh_index.shape, rows, cols).

    bh_index = b * nheads + h (nheads: query heads); rows / cols are positions i / j
    inside the sequence. One Philox call serves the four columns 4*(j//4) .. 4*(j//4)+3,
    so the draws are made per group of four and the wanted columns picked out.
    """
    bh = torch.as_tensor(bh_index, dtype=torch.int64, device=device)
    device = bh.device
    i = _positions(rows, device)
    if isinstance(cols, range) and cols.step == 1:
        # The forward/backward path: bounds known on the host, no device sync.
        g0 = cols.start >> 2
        g1 = ((cols.stop - 1) >> 2) + 1 if len(cols) else g0
        pick = slice(cols.start - 4 * g0, cols.stop - 4 * g0)
    else:
        j = _positions(cols, device)
        g0 = int(j.min()) >> 2 if j.numel() else 0
        g1 = (int(j.max()) >> 2) + 1 if j.numel() else 0
        pick = j - 4 * g0
    counter = (
        torch.arange(g0, g1, device=device, dtype=torch.int64),  # (groups,)
        i[:, None],  # (rows, 1)
        bh[..., None, None],  # (*bh, 1, 1)
        offset & _MASK32,
    )
    key0 = seed & _MASK32
    key1 = ((seed >> 32) ^ (offset >> 32)) & _MASK32
    draws = torch.stack(philox4x32_10(counter, key0, key1), dim=-1)  # (*bh, rows, groups, 4)
    draws = draws.flatten(-2)  # column 4 * g0 + c lives at index c
    return draws[..., pick]


def dropout_threshold(p: float) -> int:
    """philox.h's threshold: p is a C float there, so round it to float32 first."""
    p32 = struct.unpack("f", struct.pack("f", p))[0]
    scaled = p32 * 4294967296.0
    return _MASK32 if scaled >= 4294967295.0 else int(scaled)


def philox_keep_mask(
    seed: int,
    offset: int,
    bh_index: Union[int, torch.Tensor],
    rows: Union[range, torch.Tensor],
    cols: Union[range, torch.Tensor],
    p: float,
    device: Union[str, torch.device, None] = None,
) -> torch.Tensor:
    """Bool keep-mask of philox.h, shaped (*bh_index.shape, len(rows), len(cols))."""
    return philox_random(seed, offset, bh_index, rows, cols, device) >= dropout_threshold(p)


# ---------------------------------------------------------------------------------------
# The attention problem of one call (or one varlen sequence), in (B, H, S, D) views
# ---------------------------------------------------------------------------------------


class _Problem:
    """Shapes, options and per-chunk score math shared by the forward and the backward.

    q, k, v arrive as (B, S, H, D) views of one call (varlen: of one sequence, B = 1).
    Heads are reordered to (B, Hk, G, S, D), G = H // Hk query heads per KV head, and
    a query chunk is flattened to rows (G * rows) so every matmul runs against the
    un-expanded K/V of its group.
    """

    def __init__(self, q, k, v, *, batch_start, softmax_scale, window_left, window_right,
                 softcap, alibi_slopes, dropout_p, rng_seed, rng_offset):
        self.batch, self.seqlen_q, self.nheads, self.headdim = q.shape
        self.seqlen_k, self.nheads_k = k.shape[1], k.shape[2]
        self.group = self.nheads // self.nheads_k
        # fp64 inputs stay fp64 so torch.autograd.gradcheck can check the backward.
        self.compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.device = q.device
        self.q = q
        self.k = self._heads_first(k)  # (B, Hk, Sk, D)
        self.v = self._heads_first(v)
        self.scale = softmax_scale
        self.window_left = window_left
        self.window_right = window_right
        self.softcap = softcap
        # Query i is aligned with key i + shift (bottom-right alignment of params.h).
        self.shift = self.seqlen_k - self.seqlen_q
        self.alibi = None
        if alibi_slopes is not None:
            slopes = alibi_slopes
            if slopes.dim() == 2:  # (B, H): this piece's rows of the call's batch
                slopes = slopes[batch_start : batch_start + self.batch]
            self.alibi = slopes.to(self.compute_dtype).reshape(-1, self.nheads_k, self.group, 1, 1)
        self.dropout_p = dropout_p
        self.rng_seed = rng_seed
        self.rng_offset = rng_offset
        self.bh_index = (
            (batch_start + torch.arange(self.batch, device=self.device))[:, None] * self.nheads
            + torch.arange(self.nheads, device=self.device)
        ).reshape(self.batch, self.nheads_k, self.group)
        scores_per_query = self.batch * self.nheads * max(1, min(KEY_CHUNK, self.seqlen_k))
        self.query_chunk = max(1, min(QUERY_CHUNK, SCORE_ELEMENTS // scores_per_query))

    def _heads_first(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 1, 3).to(self.compute_dtype).contiguous()

    def query_rows(self, x: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
        """Rows i0:i1 of a (B, Sq, H, D) tensor as (B, Hk, G * rows, D) in compute dtype."""
        chunk = x[:, i0:i1].permute(0, 2, 1, 3).to(self.compute_dtype)
        return chunk.reshape(self.batch, self.nheads_k, self.group * (i1 - i0), x.shape[-1])

    def unfold_rows(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        """Inverse of query_rows: (B, Hk, G * count, ...) -> (B, count, H, ...)."""
        shaped = rows.reshape(self.batch, self.nheads, count, *rows.shape[3:])
        return shaped.transpose(1, 2)

    def query_chunks(self):
        for i0 in range(0, self.seqlen_q, self.query_chunk):
            yield i0, min(i0 + self.query_chunk, self.seqlen_q)

    def key_chunks(self, i0: int, i1: int):
        """Key chunks that hold at least one key visible to some query in i0:i1."""
        lo, hi = 0, self.seqlen_k
        if self.window_left >= 0:
            lo = max(lo, i0 + self.shift - self.window_left)
        if self.window_right >= 0:
            hi = min(hi, i1 + self.shift + self.window_right)
        for j0 in range(lo, hi, KEY_CHUNK):
            yield j0, min(j0 + KEY_CHUNK, hi)

    def scores(self, q_rows: torch.Tensor, i0: int, i1: int, j0: int, j1: int):
        """Masked scores (B, Hk, G * rows, cols) and tanh(raw / softcap) (None when off)."""
        s = torch.matmul(q_rows, self.k[:, :, j0:j1].transpose(-1, -2)) * self.scale
        tanh = None
        if self.softcap > 0:
            tanh = torch.tanh(s / self.softcap)
            s = self.softcap * tanh
        rows = i1 - i0
        s = s.view(self.batch, self.nheads_k, self.group, rows, j1 - j0)
        i = torch.arange(i0, i1, device=self.device)[:, None] + self.shift
        j = torch.arange(j0, j1, device=self.device)[None, :]
        if self.alibi is not None:
            s = s - self.alibi * (i - j).abs().to(self.compute_dtype)
        visible = torch.ones_like(j, dtype=torch.bool)
        if self.window_left >= 0:
            visible = visible & (j >= i - self.window_left)
        if self.window_right >= 0:
            visible = visible & (j <= i + self.window_right)
        s = s.masked_fill(~visible, float("-inf"))
        return s.view(self.batch, self.nheads_k, self.group * rows, j1 - j0), tanh

    def dropout_scale(self, i0: int, i1: int, j0: int, j1: int) -> Optional[torch.Tensor]:
        """Z = keep / (1 - p) for the chunk, shaped like its scores; None without dropout."""
        if self.dropout_p <= 0:
            return None
        keep = philox_keep_mask(self.rng_seed, self.rng_offset, self.bh_index,
                                range(i0, i1), range(j0, j1), self.dropout_p)
        z = keep.to(self.compute_dtype) * (1.0 / (1.0 - self.dropout_p))
        return z.view(self.batch, self.nheads_k, self.group * (i1 - i0), j1 - j0)


def _forward(pb: _Problem, out: torch.Tensor, lse: torch.Tensor) -> None:
    """out: (B, Sq, H, D) view; lse: (B, H, Sq) view."""
    for i0, i1 in pb.query_chunks():
        q_rows = pb.query_rows(pb.q, i0, i1)
        row_shape = q_rows.shape[:-1]
        m = torch.full(row_shape, float("-inf"), dtype=pb.compute_dtype, device=pb.device)
        l = torch.zeros(row_shape, dtype=pb.compute_dtype, device=pb.device)
        acc = torch.zeros(*row_shape, pb.v.shape[-1], dtype=pb.compute_dtype, device=pb.device)
        for j0, j1 in pb.key_chunks(i0, i1):
            s, _ = pb.scores(q_rows, i0, i1, j0, j1)
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row masked so far has m_new = -inf; subtracting 0 instead keeps its
            # exp() at exactly 0 rather than exp(-inf - -inf) = NaN.
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = alpha * l + p.sum(dim=-1)
            z = pb.dropout_scale(i0, i1, j0, j1)
            pv = torch.matmul(p if z is None else p * z, pb.v[:, :, j0:j1])
            acc = alpha[..., None] * acc + pv
            m = m_new
        # A row sees no key exactly when l == 0: out 0, lse -inf. A NaN input gives NaN in
        # l, so its row's out and lse are both NaN (never the "sees no key" marker -inf).
        empty = l == 0
        o = acc / torch.where(empty, 1.0, l)[..., None]
        row_lse = torch.where(empty, float("-inf"), m + torch.log(torch.where(empty, 1.0, l)))
        count = i1 - i0
        out[:, i0:i1].copy_(pb.unfold_rows(o, count))
        lse[:, :, i0:i1].copy_(row_lse.reshape(pb.batch, pb.nheads, count))


def _backward(pb: _Problem, dout, out, lse, dq, dk, dv) -> None:
    """dout, out, dq: (B, Sq, H, D) views; lse: (B, H, Sq); dk, dv: (B, Sk, Hk, D)."""
    dk_acc = torch.zeros_like(pb.k)
    dv_acc = torch.zeros_like(pb.v)
    for i0, i1 in pb.query_chunks():
        count = i1 - i0
        q_rows = pb.query_rows(pb.q, i0, i1)
        do_rows = pb.query_rows(dout, i0, i1)
        delta = (do_rows * pb.query_rows(out, i0, i1)).sum(dim=-1, keepdim=True)
        row_lse = lse[:, :, i0:i1].to(pb.compute_dtype).reshape(q_rows.shape[:-1])
        # Rows with lse = -inf are fully masked: all their scores are -inf too, and
        # exp(-inf - 0) = 0 gives them P = 0 without a NaN from -inf - -inf.
        row_lse = torch.where(row_lse == float("-inf"), 0.0, row_lse)[..., None]
        dq_rows = torch.zeros_like(q_rows)
        for j0, j1 in pb.key_chunks(i0, i1):
            s, tanh = pb.scores(q_rows, i0, i1, j0, j1)
            p = torch.exp(s - row_lse)
            z = pb.dropout_scale(i0, i1, j0, j1)
            p_dropped = p if z is None else p * z
            dv_acc[:, :, j0:j1] += torch.matmul(p_dropped.transpose(-1, -2), do_rows)
            dp = torch.matmul(do_rows, pb.v[:, :, j0:j1].transpose(-1, -2))
            if z is not None:
                dp = dp * z
            ds = p * (dp - delta)
            if tanh is not None:
                ds = ds * (1 - tanh * tanh)
            ds = ds * pb.scale
            dq_rows += torch.matmul(ds, pb.k[:, :, j0:j1])
            dk_acc[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), q_rows)
        dq[:, i0:i1].copy_(pb.unfold_rows(dq_rows, count))
    dk.copy_(dk_acc.transpose(1, 2))
    dv.copy_(dv_acc.transpose(1, 2))


# ---------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------


def _pieces(q, k, v, cu_seqlens_q, cu_seqlens_k, options, seqused_k=None):
    """(problem, query rows, key rows) per independent piece of a call.

    Rows are None for a batched call (one piece, the whole batch) and slices of the
    packed axis for each varlen sequence (one host sync to read cu_seqlens). With
    seqused_k, sequence b's keys are the first min(seqused_k[b], its rows) of its rows
    (a negative count is 0: the kernels' clamping, common/seq_bounds.h).
    """
    if cu_seqlens_q is None:
        yield _Problem(q, k, v, batch_start=0, **options), None, None
        return
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    for b in range(len(starts_q) - 1):
        rows_q = slice(starts_q[b], starts_q[b + 1])
        end_k = starts_k[b + 1] if used is None else starts_k[b] + max(0, min(used[b], starts_k[b + 1] - starts_k[b]))
        rows_k = slice(starts_k[b], end_k)
        pb = _Problem(q[None, rows_q], k[None, rows_k], v[None, rows_k], batch_start=b, **options)
        yield pb, rows_q, rows_k


def _seq(x: torch.Tensor, rows: Optional[slice]) -> torch.Tensor:
    """A (B, S, H, D) view of a batched tensor, or of one packed sequence."""
    return x if rows is None else x[None, rows]


def _seq_lse(lse: torch.Tensor, rows: Optional[slice]) -> torch.Tensor:
    """A (B, H, S) view of (B, H, Sq) or of one sequence of the varlen (H, total_q)."""
    return lse if rows is None else lse[None, :, rows]


def _take_rng_state(options: dict, rng_state) -> None:
    """A device [seed, offset] pair (dropout drawn under CUDA-graph capture) becomes the two
    integers the mask functions take; a host read, so this backend is not capturable."""
    if rng_state is not None:
        options["rng_seed"], options["rng_offset"] = (int(x) for x in rng_state.tolist())


class ReferenceBackend(Backend):
    """Every feature on every device, in PyTorch ops; exact in fp64."""

    name = "reference"

    def unsupported_reasons(self, call: CallSpec) -> list[str]:
        return []

    # `options` are the keyword arguments of Backend.forward after max_seqlen_k
    # (softmax_scale ... rng_offset): _Problem takes them by the same names.
    # max_seqlen_q/k are not needed: every piece knows its own lengths. sm_margin is
    # taken by name and ignored: these torch ops launch no grid of their own to size.

    def forward(self, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, rng_state=None, seqused_k=None, sm_margin=0, **options) -> None:
        _take_rng_state(options, rng_state)
        if lse is None:  # the caller does not need it; the algorithm does
            rows = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
            lse = torch.empty(rows, dtype=torch.float32, device=q.device)
        if cu_seqlens_q is not None:
            # Packed rows outside every sequence belong to no query; define them anyway,
            # since `out` may arrive poisoned.
            out.zero_()
            lse.fill_(float("-inf"))
        for pb, rows_q, _ in _pieces(q, k, v, cu_seqlens_q, cu_seqlens_k, options, seqused_k):
            _forward(pb, _seq(out, rows_q), _seq_lse(lse, rows_q))

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, *, cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k, deterministic, rng_state=None, seqused_k=None,
                 sm_margin=0, **options) -> None:
        _take_rng_state(options, rng_state)
        # Always deterministic: every accumulation is a fixed-order torch reduction.
        if cu_seqlens_q is not None:
            for grad in (dq, dk, dv):
                grad.zero_()
        for pb, rows_q, rows_k in _pieces(q, k, v, cu_seqlens_q, cu_seqlens_k, options, seqused_k):
            _backward(pb, _seq(dout, rows_q), _seq(out, rows_q), _seq_lse(lse, rows_q),
                      _seq(dq, rows_q), _seq(dk, rows_k), _seq(dv, rows_k))
