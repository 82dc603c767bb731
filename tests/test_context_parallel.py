"""ring-flash-attn, unmodified, on portattn (provide_flash_attn) over torch.distributed gloo on CPU.

Each rank holds a shard of one bf16 sequence; forward outputs and q/k/v gradients are
compared with a float64 oracle of the whole sequence under the error rule (tests/error_rule.py):
our max error at most 2x (outputs) / 3x (gradients) that of PyTorch's own bf16 attention, plus
an absolute slack (SLACK, 1e-4, in place of the rule's 1e-5 floor).
"""
import importlib.util
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from error_rule import GRAD_FACTOR, OUT_FACTOR, assert_errors, max_error

# Not importorskip: ring-flash-attn 0.1.8's own import fails without transformers 4.x, which
# portattn.compat.import_ring_flash_attn gets past.
if importlib.util.find_spec("ring_flash_attn") is None:
    pytest.skip("ring-flash-attn is not installed (pip install -e '.[test]')", allow_module_level=True)
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch has no gloo backend for torch.distributed", allow_module_level=True)

SEQLEN, NHEADS, NHEADS_K, HEAD_DIM = 64, 4, 2, 32
SLACK = 1e-4
# layout -> ring-flash-attn function. ring: contiguous shards; zigzag: two mirrored blocks
# per rank (balanced causal work); stripe: every world-th token.
LAYOUTS = {"zigzag": "zigzag_ring_flash_attn_func", "ring": "ring_flash_attn_func",
           "stripe": "stripe_flash_attn_func"}


def _inputs():
    generator = torch.Generator().manual_seed(0)
    draw = lambda heads: torch.randn(1, SEQLEN, heads, HEAD_DIM, generator=generator).to(torch.bfloat16)
    return draw(NHEADS), draw(NHEADS_K), draw(NHEADS_K), draw(NHEADS)


def _shard(x, rank, world, layout):
    """This rank's rows of x (batch, seqlen, ...) in `layout` (see LAYOUTS)."""
    if layout == "ring":
        return x.chunk(world, dim=1)[rank]
    if layout == "stripe":
        return x[:, rank::world]
    blocks = x.chunk(2 * world, dim=1)
    return torch.cat([blocks[rank], blocks[2 * world - 1 - rank]], dim=1)


def _attention(q, k, v, dout, dtype):
    """Causal GQA attention by hand in `dtype` (float64: the oracle; bf16: PyTorch's own)."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.transpose(1, 2) for t in leaves)
    group = NHEADS // NHEADS_K
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    scores = (qh @ kh.transpose(-1, -2)) * HEAD_DIM ** -0.5
    causal = torch.ones(SEQLEN, SEQLEN, dtype=torch.bool).tril()
    out = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vh).transpose(1, 2)
    out.backward(dout.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _worker(rank, world, rendezvous, result_dir):
    from portattn.compat import import_ring_flash_attn

    ring = import_ring_flash_attn()  # provide_flash_attn(), then ring-flash-attn as published
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        q, k, v, dout = _inputs()
        oracle = _attention(q, k, v, dout, torch.float64)
        errors = {}
        for layout in LAYOUTS:
            function = getattr(ring, LAYOUTS[layout])
            local = [_shard(t, rank, world, layout).clone().requires_grad_() for t in (q, k, v)]
            out = function(*local, causal=True)
            out.backward(_shard(dout, rank, world, layout))
            got = [out.detach()] + [t.grad for t in local]
            errors[layout] = {name: (g.double() - _shard(o, rank, world, layout)).abs().max().item()
                              for name, g, o in zip(("out", "dq", "dk", "dv"), got, oracle)}
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(errors, handle)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_flash_attn_runs_on_portattn_within_the_error_rule(world, tmp_path):
    # One spawn per world size runs every layout: starting processes is most of the cost.
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=world)
    per_rank = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]
    q, k, v, dout = _inputs()
    oracle = _attention(q, k, v, dout, torch.float64)
    pytorch_bf16 = _attention(q, k, v, dout, torch.bfloat16)
    for layout in LAYOUTS:
        ours = {name: max(r[layout][name] for r in per_rank) for name in per_rank[0][layout]}
        factors = (("out", OUT_FACTOR), ("dq", GRAD_FACTOR), ("dk", GRAD_FACTOR), ("dv", GRAD_FACTOR))
        for (name, factor), want, low in zip(factors, oracle, pytorch_bf16):
            baseline = max_error(low, want)
            assert baseline > 0  # the rule needs a real bf16 error to compare with
            assert_errors(f"{layout} {name}", ours[name], baseline, factor, SLACK, "bfloat16")


def test_context_parallel_example_matches_one_process_on_cpu():
    """examples/context_parallel.py under torchrun with gloo: 2 processes, a tiny layer."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:  # a free port for torchrun's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
         os.path.join(root, "examples", "context_parallel.py"), "--seqlen", "128", "--dim", "64",
         "--heads", "4", "--steps", "3"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "world 2 on cpu" in result.stdout and ": OK" in result.stdout
