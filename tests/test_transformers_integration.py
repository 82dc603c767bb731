"""attn_implementation="portattn" in Hugging Face transformers models, against eager attention.

Tiny random Llama (GQA) and Gemma2 (sliding window 4 at 12 tokens, softcap) models, the
same weights under both implementations: logits of left- and right-padded batches,
gradients of a training loss, greedy generate() with a KV cache, packed sequences and an
encoder (BERT, non-causal). Where bits cannot match, the error rule: our max error against
eager in float64 is at most `factor` x eager's own error in the same dtype, plus a tiny
slack. CPU runs float32 and bfloat16 (portattn's reference backend); the `gpu` variants
run bfloat16 on CUDA.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs Hugging Face transformers (pip install -e '.[test]' installs it)"
)
from transformers import AutoModelForCausalLM, AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402
from hf_oracle import use_finite_float64_eager_mask  # noqa: E402  (tests/hf_oracle.py)

from portattn.integrations import transformers as pt_hf  # noqa: E402
from portattn.integrations import _padding  # noqa: E402

import error_rule  # noqa: E402  (tests/error_rule.py)

F64 = torch.float64
VOCAB = 96
CPU_CASES = [("cpu", torch.float32), ("cpu", torch.bfloat16)]
DEVICE_CASES = CPU_CASES + [pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu, id="cuda-bfloat16")]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    pt_hf.register()


@pytest.fixture(autouse=True)
def _finite_float64_eager_mask(monkeypatch):
    """The float64 oracle masks with float32's min (tests/hf_oracle.py says why)."""
    use_finite_float64_eager_mask(monkeypatch)


def llama_config(**overrides):
    options = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   # std 0.02 makes attention almost uniform, so masks would barely show;
                   # larger weights make every masked-out key matter.
                   initializer_range=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    options.update(overrides)
    return transformers.LlamaConfig(**options)


def gemma2_config(**overrides):
    options = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                   sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                   max_position_embeddings=64, initializer_range=0.15, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2)
    options.update(overrides)
    return transformers.Gemma2Config(**options)


def gpt_oss_config(**overrides):
    # Attention sinks on every layer, a sliding layer then a full one, a tiny mixture of experts.
    options = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                   num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                   initializer_range=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                   layer_types=["sliding_attention", "full_attention"])
    options.update(overrides)
    config = transformers.GptOssConfig(**options)
    config._experts_implementation = "eager"  # the grouped-GEMM experts have no float64 (the oracle)
    return config


CONFIGS = {"llama": llama_config, "gemma2": gemma2_config}


def build(config, implementation, dtype, device, seed=0, source=None):
    """A model with `implementation`, the weights of `source` (or fresh ones from `seed`)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)
    if source is not None:
        model.load_state_dict(source.state_dict())
    assert model.config._attn_implementation == implementation
    return model.to(device=device, dtype=dtype).eval()


def trio(config, dtype, device):
    """(float64 eager oracle, eager in dtype, portattn in dtype), one set of weights."""
    ref = build(config, "eager", F64, device)
    return ref, build(config, "eager", dtype, device, source=ref), build(config, "portattn", dtype, device, source=ref)


def max_error(got, ref):
    return (got.detach().to(F64) - ref.detach()).abs().max().item()


def assert_error_rule(name, ours, low, ref, factor):
    """max|ours - ref| <= factor * max|low - ref| + slack; ref in float64, low = eager in our dtype.

    The slack (1e-5 of the reference's scale) only covers float32, where both errors are
    at rounding level and their ratio is noise.
    """
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    slack = 1e-5 * max(1.0, ref.abs().max().item())
    error_rule.assert_within(name, ours, ref, low, factor, floor=slack)


def padded_batch(padding_side, device, seqlen=12, lengths=(12, 7, 9), seed=1):
    """Random tokens (no pad id among them) and the 0/1 mask of a padded batch."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), seqlen), generator=generator)
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long)
    for row, length in enumerate(lengths):
        if padding_side == "left":
            mask[row, seqlen - length:] = 1
        else:
            mask[row, :length] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids.to(device), mask.to(device)


def logits(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs).logits


# --- the features the tests rely on really change the result --------------------------------

def test_window_softcap_and_padding_matter_in_eager():
    """Otherwise matching eager would prove nothing about them (and the window's off-by-one)."""
    ids, mask = padded_batch("left", "cpu")
    real = mask.bool()  # eager's rows of padding tokens may be NaN: never compared
    base = build(gemma2_config(), "eager", F64, "cpu")
    out = logits(base, ids, mask)[real]
    for changed in (dict(sliding_window=5), dict(attn_logit_softcapping=None)):
        other = build(gemma2_config(**changed), "eager", F64, "cpu", source=base)
        assert max_error(logits(other, ids, mask)[real], out) > 1e-2, changed
    unmasked = logits(base, ids, torch.ones_like(mask))
    assert max_error(unmasked[real], out) > 1e-2


# --- forward on padded batches ---------------------------------------------------------------

@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("device,dtype", DEVICE_CASES)
def test_padded_logits_match_eager(family, padding_side, device, dtype):
    ref, eager, ours = trio(CONFIGS[family](), dtype, device)
    ids, mask = padded_batch(padding_side, device)
    real = mask.bool()
    got = logits(ours, ids, mask)
    assert got.dtype == dtype
    assert_error_rule("logits", got[real], logits(eager, ids, mask)[real], logits(ref, ids, mask)[real], 2)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_unpadded_batch_matches_eager_float32(family):
    ref, eager, ours = trio(CONFIGS[family](), torch.float32, "cpu")
    ids, _ = padded_batch("left", "cpu", lengths=(12, 12))
    assert_error_rule("logits", logits(ours, ids, None), logits(eager, ids, None), logits(ref, ids, None), 2)


# --- training ------------------------------------------------------------------------------

def loss_gradients(model, ids, mask):
    model.train()
    model.zero_grad(set_to_none=True)
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    model.eval()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("device,dtype", DEVICE_CASES)
def test_training_gradients_match_eager(family, device, dtype):
    ref, eager, ours = trio(CONFIGS[family](), dtype, device)
    ids, mask = padded_batch("right", device)
    loss_ref, grads_ref = loss_gradients(ref, ids, mask)
    loss_low, grads_low = loss_gradients(eager, ids, mask)
    loss_ours, grads_ours = loss_gradients(ours, ids, mask)
    assert_error_rule("loss", loss_ours, loss_low, loss_ref, 2)
    assert grads_ours.keys() == grads_ref.keys() and any("q_proj" in name for name in grads_ours)
    for name, grad in grads_ours.items():
        assert grads_ref[name].abs().max() > 0, f"{name}: the oracle's gradient is zero"
        assert_error_rule(f"grad {name}", grad, grads_low[name], grads_ref[name], 3)


def test_dropout_applies_in_training_only():
    config = llama_config(attention_dropout=0.5)
    ref, eager, ours = trio(config, torch.float32, "cpu")
    ids, mask = padded_batch("right", "cpu")
    real = mask.bool()
    # eval(): the model passes dropout=0.0, so the result is eager's.
    assert_error_rule("eval logits", logits(ours, ids, mask)[real], logits(eager, ids, mask)[real],
                      logits(ref, ids, mask)[real], 2)
    torch.manual_seed(5)
    loss_a, grads_a = loss_gradients(ours, ids, mask)
    torch.manual_seed(5)
    loss_b, grads_b = loss_gradients(ours, ids, mask)
    torch.manual_seed(6)
    loss_c, _ = loss_gradients(ours, ids, mask)
    assert torch.equal(loss_a, loss_b), "dropout is not reproducible from torch.manual_seed"
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert loss_a != loss_c, "a different seed gave the same dropout mask"
    with torch.no_grad():  # eval mode: no dropout
        no_dropout = ours(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                          use_cache=False).loss
    assert (loss_a - no_dropout).abs() > 1e-3
    assert all(torch.isfinite(g).all() for g in grads_a.values())


# --- generation with a KV cache -----------------------------------------------------------------

class Recorder:
    """Registers a spy implementation that records the shapes portattn is called with."""

    name = "portattn_spy"

    def __init__(self):
        self.calls = []
        AttentionInterface.register(self.name, self.forward)
        AttentionMaskInterface.register(self.name, pt_hf.padding_mask)

    def forward(self, module, query, key, value, attention_mask, **kwargs):
        self.calls.append((query.shape[2], key.shape[2], None if attention_mask is None else tuple(attention_mask.shape)))
        return pt_hf.attention_forward(module, query, key, value, attention_mask, **kwargs)


def greedy(model, ids, mask, steps=6, **kwargs):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def assert_same_greedy_path(tokens_ours, tokens_ref, logits_ref, logits_low):
    """Greedy decoding follows the reference's tokens, except where the reference itself
    hesitates: at the first step a row's token differs, the reference's top-2 logit margin
    must be within 4x the low-precision noise (eager's own error at the prompt step, where
    every implementation sees the same prefix). A low-precision argmax near a tie may go
    either way; a real error flips tokens with clear margins."""
    noise = float((logits_low[:, 0].double() - logits_ref[:, 0].double()).abs().max())
    for row in range(tokens_ours.shape[0]):
        differs = (tokens_ours[row] != tokens_ref[row]).nonzero()
        if len(differs) == 0:
            continue
        step = int(differs[0])
        top2 = logits_ref[row, step].double().topk(2).values
        margin = float(top2[0] - top2[1])
        assert margin <= 4 * noise + 1e-6, (
            f"row {row}, step {step}: token {int(tokens_ours[row, step])} instead of {int(tokens_ref[row, step])} "
            f"with a reference margin of {margin:.3g} (low-precision noise {noise:.3g})")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("device,dtype", DEVICE_CASES)
def test_generate_with_cache_matches_eager(family, device, dtype):
    config = CONFIGS[family]()
    ref, eager, _ = trio(config, dtype, device)
    spy = Recorder()
    ours = build(config, spy.name, dtype, device, source=ref)
    ids, mask = padded_batch("left", device)
    tokens_ref, logits_ref = greedy(ref, ids, mask)
    tokens_low, logits_low = greedy(eager, ids, mask)
    tokens_ours, logits_ours = greedy(ours, ids, mask)
    assert_same_greedy_path(tokens_ours, tokens_ref, logits_ref, logits_low)
    if torch.equal(tokens_ours, tokens_ref) and torch.equal(tokens_low, tokens_ref):
        assert_error_rule("generate logits", logits_ours, logits_low, logits_ref, 2)
    # The cache was used: after the prompt every call had one query and more keys, and
    # Gemma2's sliding layers (the even ones) got the cache's last keys only (window 4:
    # 3 cached + 1 new), so the left padding is out of their sight (mask None).
    decode = [call for call in spy.calls if call[0] == 1]
    assert len(decode) == 5 * config.num_hidden_layers and all(sk > 1 for _, sk, _ in decode)
    full_layers = spy.calls[1::2] if family == "gemma2" else spy.calls
    assert all(shape is not None for *_, shape in full_layers), "the left padding must reach every call"
    if family == "gemma2":
        assert {(sk, shape) for _, sk, shape in decode[::2]} == {(4, None)}


def test_generate_static_cache_without_padding_matches_eager():
    """generate() drops an all-ones mask; the static cache's unwritten slots must stay unseen."""
    ref, eager, ours = trio(llama_config(), torch.float32, "cpu")
    ids, _ = padded_batch("left", "cpu", lengths=(12, 12))
    tokens_eager, _ = greedy(eager, ids, None)
    tokens_ours, logits_ours = greedy(ours, ids, None, cache_implementation="static")
    _, logits_eager_static = greedy(eager, ids, None, cache_implementation="static")
    assert torch.equal(tokens_ours, tokens_eager)
    torch.testing.assert_close(logits_ours, logits_eager_static, rtol=1e-4, atol=1e-4)


# --- packed sequences, encoders ---------------------------------------------------------------

@pytest.mark.parametrize("with_cu_seqlens", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_sequences_match_eager(family, with_cu_seqlens, monkeypatch):
    """Sequences laid end to end in one row, no mask: eager builds a block-diagonal mask."""
    ref, eager, ours = trio(CONFIGS[family](), torch.float32, "cpu")
    lengths = (5, 7, 3)
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    kwargs = dict(position_ids=position_ids)
    with_kwargs = dict(kwargs)
    if with_cu_seqlens:
        cu = torch.tensor([0, 5, 12, 15], dtype=torch.int32)
        with_kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)

        def unused(*args):
            raise AssertionError("given cu_seq_lens must be used, not re-derived from position_ids")

        monkeypatch.setattr(pt_hf, "packing_from_position_ids", unused)
    got = logits(ours, ids, None, **with_kwargs)
    assert_error_rule("packed logits", got, logits(eager, ids, None, **kwargs), logits(ref, ids, None, **kwargs), 2)
    # and it is not what one long sequence gives
    assert max_error(got, logits(ref, ids, None)) > 1e-2


def test_position_packing_is_read_once_per_forward(monkeypatch):
    """Every layer of a forward passes the same position_ids: one host read decides, not one per layer."""
    calls = []
    real = _padding.packing_from_position_ids
    monkeypatch.setattr(pt_hf, "packing_from_position_ids", lambda p: calls.append(1) or real(p))
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    first = pt_hf._packing_of_positions(positions, 1)
    assert first.cu_seqlens.tolist() == [0, 3, 5]
    assert pt_hf._packing_of_positions(positions, 1) is first and len(calls) == 1
    assert pt_hf._packing_of_positions(positions, 2).cu_seqlens.tolist() == [0, 3, 5, 8, 10] and len(calls) == 2
    positions[0, 3:] = torch.tensor([3, 4])  # changed in place: read again
    assert pt_hf._packing_of_positions(positions, 1) is None and len(calls) == 3
    assert pt_hf._packing_of_positions(positions.clone(), 1) is None and len(calls) == 4


def test_static_prefill_cuts_the_keys_to_the_written_extent(monkeypatch):
    """An eager prefill into a static cache: a dense call on the written keys, nothing packed."""
    _, eager, ours = trio(llama_config(), torch.float32, "cpu")
    seen = []
    real = pt_hf.flash_attn_func
    monkeypatch.setattr(pt_hf, "flash_attn_func",
                        lambda q, k, v, *a, **o: seen.append(k.shape[1]) or real(q, k, v, *a, **o))
    monkeypatch.setattr(pt_hf, "packing_from_mask", lambda *a: pytest.fail("an all-real prefill must not pack"))
    # a prompt longer than BOUNDS_MAX_QUERIES (shorter ones read the cache in place, key bounds)
    ids, _ = padded_batch("left", "cpu", seqlen=20, lengths=(20, 20))
    tokens_ours, logits_ours = greedy(ours, ids, None, cache_implementation="static")
    _, logits_eager = greedy(eager, ids, None, cache_implementation="static")
    assert seen and seen[0] == 20, seen  # the prefill's keys: the 20 written of the cache's slots
    torch.testing.assert_close(logits_ours, logits_eager, rtol=1e-4, atol=1e-4)


def test_encoder_is_not_causal():
    from transformers.models.bert import modeling_bert

    if not hasattr(modeling_bert, "ALL_ATTENTION_FUNCTIONS"):
        pytest.skip(f"BERT in transformers {transformers.__version__} does not use the attention interface")
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, initializer_range=0.15,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    models = {}
    for implementation, dtype in (("eager", F64), ("eager", torch.float32), ("portattn", torch.float32)):
        torch.manual_seed(0)
        model = transformers.AutoModel.from_config(copy.deepcopy(config), attn_implementation=implementation)
        if models:
            model.load_state_dict(models[("eager", F64)].state_dict())
        models[(implementation, dtype)] = model.to(dtype).eval()
    ids, mask = padded_batch("right", "cpu")
    real = mask.bool()
    with torch.no_grad():
        out = {key: m(input_ids=ids, attention_mask=mask).last_hidden_state[real] for key, m in models.items()}
    assert_error_rule("encoder output", out[("portattn", torch.float32)], out[("eager", torch.float32)],
                      out[("eager", F64)], 2)


# --- the attention function itself -------------------------------------------------------------

class _Layer(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, dtype=dtype)
        self.is_causal = True


def _qkv(batch=2, heads=4, kv_heads=2, seq_q=5, seq_k=5, dim=8, v_dim=None, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, dim, generator=generator, dtype=dtype)
    k = torch.randn(batch, kv_heads, seq_k, dim, generator=generator, dtype=dtype)
    v = torch.randn(batch, kv_heads, seq_k, v_dim or dim, generator=generator, dtype=dtype)
    return q, k, v


def _eager_reference(q, k, v, causal=True, scale=None):
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).to(F64) for x in (k, v))
    s = q.to(F64) @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:  # bottom-right aligned
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq).logical_not(), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("v_dim", [4, 8, 12])
def test_gqa_decode_and_value_head_dims(v_dim):
    q, k, v = _qkv(seq_q=2, seq_k=7, v_dim=v_dim)
    out, weights = pt_hf.attention_forward(_Layer(torch.float32), q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 2, 4, v_dim)
    torch.testing.assert_close(out.to(F64), _eager_reference(q, k, v, scale=0.3), rtol=1e-5, atol=1e-5)


def test_is_causal_false_sees_every_key():
    q, k, v = _qkv(seq_q=3, seq_k=6)
    encoder_layer, causal_layer = _Layer(torch.float32), _Layer(torch.float32)
    encoder_layer.is_causal = False
    # the layer's attribute, or the is_causal argument, which overrides it
    for layer, kwargs in ((encoder_layer, {}), (causal_layer, dict(is_causal=False))):
        out, _ = pt_hf.attention_forward(layer, q, k, v, None, **kwargs)
        torch.testing.assert_close(out.to(F64), _eager_reference(q, k, v, causal=False), rtol=1e-5, atol=1e-5)


def test_float32_inputs_of_a_half_layer_are_cast_once(recwarn):
    q, k, v = _qkv()
    out, _ = pt_hf.attention_forward(_Layer(torch.bfloat16), q, k, v, None)
    assert out.dtype == torch.bfloat16
    pt_hf.attention_forward(_Layer(torch.bfloat16), q, k, v, None)
    assert sum("casting float32" in str(w.message) for w in recwarn) <= 1
    out32, _ = pt_hf.attention_forward(_Layer(torch.float32), q, k, v, None)
    assert out32.dtype == torch.float32


def test_unsupported_inputs_are_clear_errors():
    q, k, v = _qkv()
    layer = _Layer(torch.float32)
    with pytest.raises(ValueError, match="2-D"):
        pt_hf.attention_forward(layer, q, k, v, torch.zeros(2, 1, 5, 5))
    for bad in ("flash_portattn", "sdpa", "org/repo", ""):
        with pytest.raises(ValueError, match="name"):
            pt_hf.register(bad)


def test_padding_mask_function():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1]], dtype=torch.bool)
    full = torch.ones_like(mask)
    causal = transformers.masking_utils.causal_mask_function
    def bidirectional(batch_idx, head_idx, q_idx, kv_idx):
        return torch.ones_like(kv_idx, dtype=torch.bool)

    assert pt_hf.padding_mask(2, 4, 4, attention_mask=full) is None
    # all real, in a cache of 8 slots: the written extent, the first 4 keys
    extent = pt_hf.padding_mask(2, 4, 8, attention_mask=full)
    assert extent.dtype == pt_hf.EXTENT_DTYPE and extent.shape == (2, 4)
    assert torch.equal(pt_hf.padding_mask(2, 4, 4, attention_mask=mask), mask)
    # a sliding cache keeps the last keys: the mask's last columns
    assert torch.equal(pt_hf.padding_mask(2, 1, 3, q_offset=3, kv_offset=1, attention_mask=mask), mask[:, 1:])
    # a cache buffer of 8 slots with 3 written + 1 new: key bounds, only those are keys
    # (unwritten slots hold no token, causal or not)
    for function in (causal, bidirectional):
        bounds = pt_hf.padding_mask(2, 1, 8, q_offset=3, mask_function=function)
        assert bounds.dtype == pt_hf.KEY_BOUNDS_DTYPE and bounds.view(2, 2).tolist() == [[0, 0], [4, 4]]
    # a static cache's device offset, a decode step with left padding: bounds from the mask
    bounds = pt_hf.padding_mask(2, 1, 8, q_offset=torch.tensor(3), attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    assert bounds.view(2, 2).tolist() == [[1, 0], [4, 4]]
    # a long eager prefill into it: the written extent, keys cut to the first 20, a dense call
    extent = pt_hf.padding_mask(2, 20, 32, q_offset=0, mask_function=causal)
    assert extent.dtype == pt_hf.EXTENT_DTYPE and extent.shape == (2, 20) and extent.all()
    extent = pt_hf.padding_mask(2, 20, 32, q_offset=torch.tensor(4), mask_function=causal)
    assert extent.dtype == pt_hf.EXTENT_DTYPE and extent.shape == (2, 24)
    assert pt_hf.padding_mask(2, 4, 4, mask_function=causal) is None


def test_padding_helpers_round_trip():
    x = torch.randn(3, 5, 2, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    packing = _padding.packing_from_mask(mask)
    assert packing.cu_seqlens.tolist() == [0, 2, 2, 7] and packing.max_seqlen == 5
    packed = _padding.pack(x, packing)
    assert torch.equal(packed, x[mask])
    back = _padding.unpack(packed, packing, 3, 5)
    assert torch.equal(back, x * mask[..., None]) and back.requires_grad
    back.sum().backward()
    assert torch.equal(x.grad, mask[..., None].expand_as(x).float())
    positions = torch.tensor([[0, 1, 2, 0, 1], [4, 5, 6, 7, 8]])
    packed_rows = _padding.packing_from_position_ids(positions)
    assert packed_rows.cu_seqlens.tolist() == [0, 3, 5, 10] and packed_rows.max_seqlen == 5
    assert _padding.packing_from_position_ids(positions[1:]) is None


# float32 on the CPU (bfloat16 there adds 40 s of CI for the same code path) and bfloat16 on the GPU.
@pytest.mark.parametrize("device,dtype", [CPU_CASES[0], DEVICE_CASES[-1]])
def test_gpt_oss_sinks_logits_training_and_generate_match_eager(device, dtype):
    """A gpt-oss-style model (attention sinks, a sliding layer): padded logits, a training
    step's gradients (the sinks' own included) and greedy generate() against eager."""
    config = gpt_oss_config()
    ref = build(config, "eager", F64, device)
    with torch.no_grad():  # sinks large enough to matter (their init is ~0.15)
        for layer in ref.model.layers:
            layer.self_attn.sinks.copy_(2.0 * torch.randn_like(layer.self_attn.sinks))
    eager = build(config, "eager", dtype, device, source=ref)
    ours = build(config, "portattn", dtype, device, source=ref)
    ids, mask = padded_batch("left", device)
    assert_error_rule("logits", logits(ours, ids, mask), logits(eager, ids, mask), logits(ref, ids, mask), 2)

    ids_r, mask_r = padded_batch("right", device)
    loss_ref, grads_ref = loss_gradients(ref, ids_r, mask_r)
    loss_low, grads_low = loss_gradients(eager, ids_r, mask_r)
    loss_ours, grads_ours = loss_gradients(ours, ids_r, mask_r)
    assert_error_rule("loss", loss_ours, loss_low, loss_ref, 2)
    assert any(name.endswith("sinks") for name in grads_ours)
    for name, grad in grads_ours.items():
        if "mlp" in name:  # the experts' router picks by argmax: not attention's business
            continue
        assert_error_rule(f"grad {name}", grad, grads_low[name], grads_ref[name], 3)

    tokens_ref, logits_ref = greedy(ref, ids, mask)
    tokens_low, logits_low = greedy(eager, ids, mask)
    tokens_ours, logits_ours = greedy(ours, ids, mask)
    assert_same_greedy_path(tokens_ours, tokens_ref, logits_ref, logits_low)
    if torch.equal(tokens_ours, tokens_ref) and torch.equal(tokens_low, tokens_ref):
        assert_error_rule("generate logits", logits_ours, logits_low, logits_ref, 2)
