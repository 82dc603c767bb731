"""torch.compile of a small model using the API: no graph breaks, same numbers, gradients."""
import pytest
import torch

import portattn


class Block(torch.nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, d // self.heads)
        out = portattn.flash_attn_qkvpacked_func(qkv, causal=True)
        return self.proj(out.reshape(b, s, d))


def test_compiled_training_step_has_no_graph_breaks_and_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 10, 32)
    eager_out = model(x)
    eager_out.sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    assert torch.allclose(out, eager_out, atol=1e-5)
    for got, want in zip((p.grad for p in model.parameters()), eager_grads):
        assert torch.allclose(got, want, atol=1e-5)


def test_compiled_varlen_with_dropout_runs():
    torch._dynamo.reset()
    q, k, v = (torch.randn(10, 2, 8, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)

    def f(q, k, v):
        return portattn.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, dropout_p=0.2, causal=True)

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_compiled_calls_carry_sm_margin_into_the_ops(sm_margin_seen):
    """The custom ops' schemas take sm_margin, so a traced call reaches the backend with it."""
    for op in (torch.ops.portattn.fwd, torch.ops.portattn.bwd, torch.ops.portattn.kvcache,
               torch.ops.portattn.kvcache_append, torch.ops.portattn.paged_varlen):
        assert "sm_margin" in [a.name for a in op.default._schema.arguments], op
    torch._dynamo.reset()
    seen = sm_margin_seen
    q, k, v = (torch.randn(1, 6, 2, 8, requires_grad=True) for _ in range(3))
    f = torch.compile(lambda q, k, v: portattn.flash_attn_func(q, k, v, causal=True, sm_margin=12),
                      fullgraph=True, backend="aot_eager")
    f(q, k, v).sum().backward()
    assert seen == [("forward", 12), ("backward", 12)]
