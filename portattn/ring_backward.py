"""The zigzag ring backward portattn installs into ring-flash-attn (compat.install_ring_backward).

Note [zigzag backward partials]
ring-flash-attn's zigzag backward circulates every K/V block's gradient accumulator around the
ring in fp32: at each step a rank adds its partial dK/dV (the kernel's bf16 output) into the
fp32 accumulator it received from its neighbour and sends the sum on, 2 x 4 bytes per K/V
element a step; the last step's transfer has no kernel left to hide behind. Here a rank sends
its bf16 partial straight to the block's owner, which keeps the fp32 accumulator of its own
block: at step i rank r holds the K/V block of rank (r - i) mod N, so it sends to (r - i) and
receives from (r + i), one send and one receive per rank (a permutation, like the K/V ring).
Half the bytes a step; the same bf16 partials summed in fp32 in another order, so the
gradients agree with ring-flash-attn's within fp32 rounding before the final cast to the
inputs' dtype (tests/test_context_parallel.py runs both against the float64 oracle).
Every exchange is waited for after the next step's kernel, so it overlaps a kernel the way the
K/V ring does; send buffers alternate between two slots, so a kernel never overwrites a
partial still in flight. On one host every pair of ranks has a direct link (NVLink/NVSwitch,
xGMI); across hosts the step-i peer is i ranks away rather than a neighbour.

Only the dense zigzag backward is replaced: the forward, the varlen functions and the other
rings keep ring-flash-attn's code (with portattn's merge, Note [ring merge] in compat.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .flash_attn_interface import _flash_attn_backward


def _contiguous_view(store: torch.Tensor, shape) -> torch.Tensor:
    """The first numel(shape) elements of `store` as a contiguous tensor of `shape` (NCCL sends
    contiguous memory; a slice along the sequence of a batch > 1 tensor is not)."""
    numel = 1
    for size in shape:
        numel *= size
    return store.view(-1)[:numel].view(shape)


class _Exchange:
    """One step's partial-gradient exchange: this rank's partial for (rank - step) out, the
    partial for its own block from (rank + step) in."""

    def __init__(self, group, rank, world, step, sent, received):
        send_to = dist.get_global_rank(group, (rank - step) % world) if group is not None else (rank - step) % world
        recv_from = dist.get_global_rank(group, (rank + step) % world) if group is not None else (rank + step) % world
        ops = [dist.P2POp(dist.isend, tensor, send_to, group=group) for tensor in sent]
        ops += [dist.P2POp(dist.irecv, tensor, recv_from, group=group) for tensor in received]
        self.received = received
        self._requests = dist.batch_isend_irecv(ops)

    def wait(self):
        for request in self._requests:
            request.wait()
        return self.received


def zigzag_ring_flash_attn_backward(process_group, dout, q, k, v, out, softmax_lse, softmax_scale,
                                    dropout_p=0, causal=True, window_size=(-1, -1), alibi_slopes=None,
                                    deterministic=False):
    """ring-flash-attn's zigzag_ring_flash_attn_backward, same arguments and results, with the
    dK/dV traffic of Note [zigzag backward partials]. q, k, v, dout, out: (batch, 2 x half,
    heads, head_dim), this rank's two zigzag blocks; softmax_lse (batch, heads, 2 x half)."""
    from ring_flash_attn.utils import RingComm

    if not causal:
        raise ValueError("zigzag ring attention needs causal=True (its layout balances causal work)")
    kv_comm = RingComm(process_group)
    rank, world = kv_comm.rank, kv_comm.world_size
    half = q.shape[1] // 2
    dout1, q1, out1 = dout[:, half:], q[:, half:], out[:, half:]
    lse1 = softmax_lse[:, :, half:].contiguous()
    half_shape = (k.shape[0], half, *k.shape[2:])

    def backward(dout_, q_, k_, v_, out_, lse_, dq_, dk_, dv_, causal_):
        _flash_attn_backward(dout_, q_, k_, v_, out_, lse_, dq_, dk_, dv_, dropout_p, softmax_scale,
                             causal_, window_size[0], window_size[1], 0.0, alibi_slopes, deterministic)

    dq_buffer = torch.empty_like(q)
    # Two slots of partials to send and to receive (the docstring's alternation).
    sends = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(world - 1, 2))]
    receives = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(world - 1, 2))]
    dq = dk = dv = None
    pending = None  # (exchange, the sender's partial covers only the first half)

    def accumulate(exchange, first_half):
        received_k, received_v = exchange.wait()
        if first_half:
            dk[:, :half] += received_k
            dv[:, :half] += received_v
        else:
            dk.add_(received_k)
            dv.add_(received_v)

    for step in range(world):
        if step + 1 != world:
            next_k, next_v = kv_comm.send_recv_kv(k, v)
        if step == 0:
            dk_step, dv_step = torch.empty_like(k), torch.empty_like(v)
            backward(dout, q, k, v, out, softmax_lse, dq_buffer, dk_step, dv_step, True)
            dq, dk, dv = (t.to(torch.float32) for t in (dq_buffer, dk_step, dv_step))
            del dk_step, dv_step
        else:
            slot = (step - 1) % 2
            first_half = step <= rank  # this rank's queries see the first half of the block
            shape = half_shape if first_half else k.shape
            sent = tuple(_contiguous_view(store, shape) for store in sends[slot])
            if first_half:
                backward(dout, q, k[:, :half], v[:, :half], out, softmax_lse, dq_buffer, *sent, False)
                dq += dq_buffer
            else:
                backward(dout1, q1, k, v, out1, lse1, dq_buffer[:, :half], *sent, False)
                dq[:, half:] += dq_buffer[:, :half]
            if pending is not None:
                accumulate(*pending)
            sender = (rank + step) % world
            sender_first_half = step <= sender
            received = tuple(_contiguous_view(store, half_shape if sender_first_half else k.shape)
                             for store in receives[slot])
            pending = (_Exchange(process_group, rank, world, step, sent, received), sender_first_half)
        if step + 1 != world:
            kv_comm.wait()
            k, v = next_k, next_v
    if pending is not None:
        accumulate(*pending)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
