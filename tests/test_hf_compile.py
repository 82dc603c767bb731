"""attn_implementation="portattn" under torch.compile with static caches, and the key-bounds mask.

A static cache's decode step must trace whole (fullgraph=True), compile once, and read no
tensor value on the host: the mask function turns the 2-D mask and the cache's device-side
offset into per-sequence key bounds with device arithmetic, and flash_attn_with_kvcache is
one custom op in the graph. Results are checked against eager attention on the same weights
(float64 oracle, the error rule), with fresh random prompts and left padding.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs Hugging Face transformers (pip install -e '.[test]' installs it)"
)
from transformers import AutoModelForCausalLM, CompileConfig, StaticCache  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from portattn.integrations import transformers as pt_hf  # noqa: E402
from portattn.integrations import _padding  # noqa: E402

import error_rule  # noqa: E402  (tests/error_rule.py)
from hf_oracle import use_finite_float64_eager_mask  # noqa: E402  (tests/hf_oracle.py)

F64 = torch.float64
VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def _registered():
    pt_hf.register()


@pytest.fixture(autouse=True)
def _finite_float64_eager_mask(monkeypatch):
    """The float64 oracle masks with float32's min (tests/hf_oracle.py says why)."""
    use_finite_float64_eager_mask(monkeypatch)


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.15, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)


def gemma2_config():
    return transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
        attn_logit_softcapping=2.0, final_logit_softcapping=None, max_position_embeddings=64,
        initializer_range=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build(config, implementation, dtype, source=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)
    if source is not None:
        model.load_state_dict(source.state_dict())
    return model.to(dtype).eval()


def left_padded(seed, lengths=(12, 7, 9), seqlen=12):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), seqlen), generator=generator)
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, seqlen - length:] = 1
    return ids.masked_fill(mask == 0, 0), mask


class CountingBackend:
    """A torch.compile backend that keeps every graph dynamo hands it (one per compile).
    `compile` is a plain function: generate() deep-copies its compile config, which copies
    objects but not functions, so the graphs land here."""

    def __init__(self):
        self.graphs = []

        def compile(gm, example_inputs):
            self.graphs.append(gm)
            return gm.forward

        self.compile = compile

    def ops(self):
        return [str(node.target) for gm in self.graphs for node in gm.graph.nodes if "portattn" in str(node.target)]


def greedy(model, ids, mask, steps, **kwargs):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             cache_implementation="static", **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def compile_config(backend):
    # generate() compiles the decode step itself (as it does on a GPU); fullgraph=True makes any
    # graph break an error. The backend is a plain callable: generate deep-copies the config.
    config = CompileConfig(fullgraph=True, backend=backend, mode=None, dynamic=None)
    config._compile_all_devices = True  # generate compiles on CUDA only unless told
    return config


@pytest.mark.parametrize("family,most_graphs", [("llama", 1), ("gemma2", 2)])
@pytest.mark.parametrize("padding", [True, False], ids=["left_padded", "unpadded"])
def test_static_cache_generate_compiles_fullgraph_once_and_matches_eager(family, most_graphs, padding):
    """One graph for all decode steps (Gemma 2: one more when transformers' own sliding layer
    turns full: its guard on cumulative_length_int); the tokens and logits are eager's."""
    torch._dynamo.reset()
    config = {"llama": llama_config, "gemma2": gemma2_config}[family]()
    ref = build(config, "eager", F64)
    eager = build(config, "eager", torch.float32, source=ref)
    ours = build(config, "portattn", torch.float32, source=ref)
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ids, mask = left_padded(seed, lengths=(12, 7, 9) if padding else (12, 12, 12))
    steps = 9
    backend = CountingBackend()
    tokens_ours, logits_ours = greedy(ours, ids, mask, steps, compile_config=compile_config(backend.compile))
    tokens_ref, logits_ref = greedy(ref, ids, mask, steps)
    _, logits_low = greedy(eager, ids, mask, steps)
    assert 1 <= len(backend.graphs) <= most_graphs, f"{len(backend.graphs)} compiles for {steps - 1} decode steps"
    assert "portattn.kvcache" in backend.ops(), backend.ops()
    assert torch.equal(tokens_ours, tokens_ref), f"seed {seed}"
    error_rule.assert_within("generate logits", logits_ours, logits_ref, logits_low, 2, floor=1e-5)


def test_decode_step_explain_has_no_graph_breaks():
    """torch._dynamo.explain of one static-cache decode step, mask built inside the traced forward."""
    torch._dynamo.reset()
    config = llama_config()
    model = build(config, "portattn", torch.float32)
    ids, mask = left_padded(int(torch.randint(0, 2**31 - 1, ()).item()))
    cache = StaticCache(config=config, max_cache_len=24)
    with torch.no_grad():
        # transformers renamed the forward's cache argument (5.17: past_key_values; later: cache).
        cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        first = model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_arg: cache}).logits
        token = first[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        position = mask.sum(-1, keepdim=True) - 1

        def step(token, mask, position):
            return model(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True,
                         **{cache_arg: cache}).logits

        explanation = torch._dynamo.explain(step)(token, mask, position)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_key_bounds_read_no_values():
    """The mask function under fake tensors: any host read of a value would raise."""
    batch, seen, cache_len = 3, 9, 16
    with FakeTensorMode():
        mask = torch.ones(batch, seen + 1, dtype=torch.bool)
        q_offset = torch.tensor(seen)
        bounds = pt_hf.padding_mask(batch, 1, cache_len, q_offset=q_offset, attention_mask=mask)
        no_mask = pt_hf.padding_mask(batch, 1, cache_len, q_offset=q_offset)
    for got in (bounds, no_mask):
        assert got.shape == (2, batch, 1, 1) and got.dtype == pt_hf.KEY_BOUNDS_DTYPE


@pytest.mark.parametrize("case", ["static", "static_prefill_chunk", "sliding_full", "sliding_filling", "dynamic"])
def test_key_bounds_values(case):
    """The live keys of each sequence: [left padding, written end), in the layer's key indices."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    batch = 4
    pads = torch.randint(0, 6, (batch,), generator=generator)
    seen, q_length = 10, 1
    if case == "static_prefill_chunk":
        seen, q_length = 4, 3
    total = seen + q_length
    mask = (torch.arange(total)[None] >= pads[:, None]).long()
    # (q_offset, kv_length, kv_offset, tensor offset): key j holds absolute position kv_offset + j
    q_offset, kv_length, kv_offset = {
        "static": (seen, 32, 0), "static_prefill_chunk": (seen, 32, 0), "sliding_full": (seen, 4, seen - 3),
        "sliding_filling": (seen, 16, 0), "dynamic": (seen, total, 0)}[case]
    offset = torch.tensor(q_offset) if case.startswith("static") else q_offset
    got = pt_hf.key_bounds(batch, q_length, kv_length, offset, kv_offset, mask, None).view(2, batch)
    want_start = (pads - kv_offset).clamp(0, kv_length)
    want_end = torch.full((batch,), min(total - kv_offset, kv_length))
    assert torch.equal(got[0].long(), want_start) and torch.equal(got[1].long(), want_end)
    if case.startswith("static") or case == "sliding_filling":
        assert bool((got[1] < kv_length).all())  # the unwritten slots are never keys


def test_eager_decode_steps_of_a_left_padded_batch_do_not_pack(monkeypatch):
    """Dynamic cache, left padding: the decode steps read the cache through key bounds (the
    prompt, longer than BOUNDS_MAX_QUERIES, is packed once per layer)."""
    config = llama_config()
    ref = build(config, "eager", F64)
    ours = build(config, "portattn", torch.float32, source=ref)
    ids, mask = left_padded(int(torch.randint(0, 2**31 - 1, ()).item()), lengths=(20, 13, 17), seqlen=20)
    packed = []
    real = _padding.packing_from_mask
    monkeypatch.setattr(pt_hf, "packing_from_mask", lambda m: packed.append(m.shape) or real(m))
    with torch.no_grad():
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        got = ours.generate(**kwargs)
        want = ref.generate(**kwargs)
    assert packed and all(shape[1] == ids.shape[1] for shape in packed), packed
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits).double(), torch.stack(want.logits).double(), rtol=1e-4, atol=1e-4)


def test_kvcache_custom_op_matches_eager_call():
    """flash_attn_with_kvcache under torch.compile(fullgraph=True): the custom op, with and
    without an append, gives the eager call's result and writes the cache the same way."""
    import portattn

    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    batch, cap, heads, kv_heads, dim = 3, 20, 4, 2, 16
    q = torch.randn(batch, 1, heads, dim, generator=generator)
    k_new = torch.randn(batch, 1, kv_heads, dim, generator=generator)
    v_new = torch.randn(batch, 1, kv_heads, dim, generator=generator)
    k_cache = torch.randn(batch, cap, kv_heads, dim, generator=generator)
    v_cache = torch.randn(batch, cap, kv_heads, dim, generator=generator)
    seqlens = torch.tensor([5, 11, 7], dtype=torch.int32)
    leftpad = torch.tensor([0, 3, 2], dtype=torch.int32)

    def call(q, k_cache, v_cache, k, v):
        return portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                cache_leftpad=leftpad, causal=True, softcap=3.0)

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    for append in (False, True):
        caches_eager = (k_cache.clone(), v_cache.clone())
        caches_compiled = (k_cache.clone(), v_cache.clone())
        new = (k_new, v_new) if append else (None, None)
        want = call(q, *caches_eager, *new)
        got = compiled(q, *caches_compiled, *new)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(caches_compiled[0], caches_eager[0]) and torch.equal(caches_compiled[1], caches_eager[1])
        if append:
            assert not torch.equal(caches_eager[0], k_cache)  # the append really wrote
