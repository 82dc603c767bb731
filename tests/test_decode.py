"""Host side of the decode path on the CPU: the split planner, the size rule that routes
calls to the decode kernels, flash-attn 2's rotary positions with cache_leftpad, the
opt-in value checks, and the decode benchmark's plumbing (the kernels themselves are
tested on the GPU: tests/gpu/test_cuda_decode.py)."""
import inspect
import os
import subprocess
import sys

import pytest
import torch

import portattn
from naive import naive_attention
from portattn import decode, kvcache
from portattn.backends import abi
from portattn.kvcache import apply_rotary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the split planner -----------------------------------------------------------------
H100_SLOTS = 132 * 2  # 96 KiB decode tiles: two CTAs per SM


def test_explicit_split_count_is_honoured_up_to_the_stage_count():
    assert decode.choose_num_splits(8, 128, H100_SLOTS, 4, requested=5) == 5
    assert decode.choose_num_splits(8, 3, H100_SLOTS, 4, requested=5) == 3  # no split without keys
    assert decode.choose_num_splits(8, 10_000, H100_SLOTS, 4, requested=999) == decode.MAX_SPLITS


def test_a_full_grid_is_not_split():
    assert decode.choose_num_splits(64 * 8, 512, H100_SLOTS, 4) == 1  # batch 64, 8 KV heads


def test_one_sequence_is_spread_over_the_device():
    splits = decode.choose_num_splits(8, 128, H100_SLOTS, 4)  # batch 1, 8 KV heads, 8k keys
    assert 8 * splits >= decode.WAVE_EFFICIENCY_SLACK * H100_SLOTS * 0.9
    assert splits <= 128 // 4  # at least MIN_KEYS_PER_SPLIT keys each


def test_short_caches_keep_their_splits_long_enough():
    assert decode.choose_num_splits(8, 8, H100_SLOTS, 4) == 2  # 512 keys: two splits of 256
    assert decode.choose_num_splits(8, 2, H100_SLOTS, 4) == 1


@pytest.mark.parametrize("base", [1, 7, 100, 128, 200, 263])
def test_chosen_count_fills_its_last_wave(base):
    splits = decode.choose_num_splits(base, 4096, H100_SLOTS, 4)
    waves = base * splits / H100_SLOTS
    best = max((base * s / H100_SLOTS) / -(-base * s // H100_SLOTS) for s in range(1, 129))
    assert waves / -(-waves // 1) >= decode.WAVE_EFFICIENCY_SLACK * best


def test_a_cta_on_most_sms_is_not_split():
    """128 CTAs (batch 32, 4 KV heads) on 132 SMs with two slots each: unsplit (the H100 measurement
    in docs/decode.md: 2 splits were 3-10% slower)."""
    assert decode.choose_num_splits(128, 128, H100_SLOTS, 4, sms=132) == 1
    assert decode.choose_num_splits(32, 128, H100_SLOTS, 4, sms=132) > 1  # batch 8: still spread


@pytest.mark.parametrize("threads, splits", [(128, "one"), (64, "several")])
def test_the_full_grid_rule_needs_a_cta_that_streams_alone(monkeypatch, threads, splits):
    """128 CTAs (batch 16, 8 KV heads) with 4 warps a CTA: unsplit; with 2 warps (head dims over
    128): planned by resident slots, so split (H200, hd 256: one split ran at 0.50-0.55x SDPA)."""
    monkeypatch.setattr(decode, "_PLANS", {})
    monkeypatch.setattr(decode, "_capturing", lambda: True)
    monkeypatch.setattr(decode, "resident_slots", lambda device, tile: (132, H100_SLOTS))
    backend = _RecordingBackend()
    backend.decode_tile = lambda *args: {"stage_keys": 32, "threads": threads, "smem_bytes": 96 * 1024}
    q = torch.randn(16, 1, 32, 64)
    k = v = torch.randn(16, 4096, 8, 64)
    decode.run_decode(backend, q, k, v, False, 0.125, -1, 0, 0.0, None)
    assert (backend.splits == [1]) if splits == "one" else (backend.splits[0] > 1), backend.splits


class _RecordingBackend:
    """A compiled backend's decode surface on the CPU: records the split count of each launch."""

    SPLITS_AT = list(inspect.signature(abi.decode_args).parameters).index("num_splits") - 5

    def __init__(self):
        self.splits = []

    def decode_tile(self, head_dim, device=None, fp8_kv=False, dtype=None, extras=False, path=0):
        return {"stage_keys": 64, "threads": 128, "smem_bytes": 96 * 1024}

    def decode_path_id(self):
        return 0

    def decode(self, q, k, v, out, lse, *options):
        self.splits.append(options[self.SPLITS_AT])


@pytest.mark.parametrize("keys, capturing, requested, expect", [
    (1024, False, 0, "one"),      # eager and short: host-bound, unsplit
    (2048, False, 0, "one"),
    (1024, True, 0, "planned"),   # captured: the planner's split count
    (8192, False, 0, "planned"),  # long: the split pays for its launch
    (1024, False, 3, 3),          # an explicit num_splits is honoured
])
def test_short_eager_decode_calls_run_unsplit(monkeypatch, keys, capturing, requested, expect):
    monkeypatch.setattr(decode, "_PLANS", {})
    monkeypatch.setattr(decode, "_capturing", lambda: capturing)
    monkeypatch.setattr(decode, "resident_slots", lambda device, tile: (132, H100_SLOTS))
    backend = _RecordingBackend()
    q = torch.randn(1, 1, 16, 64)
    k = v = torch.randn(1, keys, 4, 64)
    decode.run_decode(backend, q, k, v, False, 0.125, -1, 0, 0.0, None, num_splits=requested)
    planned = decode.choose_num_splits(4, keys // 64, H100_SLOTS, decode.MIN_KEYS_PER_SPLIT // 64, sms=132)
    assert planned > 1
    assert backend.splits == [{"one": 1, "planned": planned}.get(expect, expect)]


def test_forget_plans_makes_the_next_call_plan_again(monkeypatch):
    """A changed occupancy (an in-process shared-memory cap) reaches the split count once the plans
    are forgotten, and not before."""
    monkeypatch.setattr(decode, "_PLANS", {})
    monkeypatch.setattr(decode, "_capturing", lambda: True)
    slots = [H100_SLOTS]
    monkeypatch.setattr(decode, "resident_slots", lambda device, tile: (132, slots[0]))
    backend = _RecordingBackend()
    q = torch.randn(4, 1, 16, 64)
    k = v = torch.randn(4, 8192, 4, 64)
    decode.run_decode(backend, q, k, v, False, 0.125, -1, 0, 0.0, None)
    slots[0] = 132  # one CTA an SM instead of two
    decode.run_decode(backend, q, k, v, False, 0.125, -1, 0, 0.0, None)
    decode.forget_plans()
    decode.run_decode(backend, q, k, v, False, 0.125, -1, 0, 0.0, None)
    first, kept, replanned = backend.splits
    assert first == kept and replanned != first
    assert replanned == decode.choose_num_splits(16, 8192 // 64, 132, decode.MIN_KEYS_PER_SPLIT // 64, sms=132)


def test_decode_shaped_calls():
    assert decode.prefers_decode(1, 4, 8192)
    assert decode.prefers_decode(16, 4, 4096)  # 64 packed rows
    assert not decode.prefers_decode(32, 4, 4096)  # 128 rows: the forward kernels' tile
    assert not decode.prefers_decode(1, 4, 100)  # few keys: one forward CTA is enough
    assert not decode.prefers_decode(0, 4, 8192)


# ---- flash-attn 2 semantics on the host (reference backend) ------------------------------


def test_rotary_positions_count_the_left_padding():
    """flash-attn 2 rotates new key i at cache row cache_seqlens[b] + i and the query at
    cache_seqlens[b], both absolute indices, padding included."""
    torch.manual_seed(0)
    batch, heads, heads_k, dim, capacity, new = 2, 4, 2, 16, 32, 1
    q = torch.randn(batch, new, heads, dim)
    k_new, v_new = torch.randn(batch, new, heads_k, dim), torch.randn(batch, new, heads_k, dim)
    k_cache, v_cache = torch.randn(batch, capacity, heads_k, dim), torch.randn(batch, capacity, heads_k, dim)
    dense_k, dense_v = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor([10, 20], dtype=torch.int32)
    leftpad = torch.tensor([3, 7], dtype=torch.int32)
    angles = torch.rand(capacity, 4) * 5
    cos, sin = angles.cos(), angles.sin()
    out = portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=seqlens, cache_leftpad=leftpad, rotary_interleaved=False)
    for b in range(batch):
        n, start = int(seqlens[b]), int(leftpad[b])
        position = torch.tensor([[n]])
        kb = apply_rotary(k_new[b : b + 1], cos, sin, position, False)
        qb = apply_rotary(q[b : b + 1], cos, sin, position, False)
        keys = torch.cat([dense_k[b : b + 1, start:n], kb], dim=1)
        values = torch.cat([dense_v[b : b + 1, start:n], v_new[b : b + 1]], dim=1)
        want, _ = naive_attention(qb, keys, values)
        assert (out[b : b + 1].double() - want).abs().max() < 1e-5
        assert torch.allclose(k_cache[b, n], kb[0, 0])  # the rotated key was written at row n


def test_value_checks_on_the_cpu_need_no_opt_in(monkeypatch):
    q = torch.randn(1, 1, 2, 16)
    cache = torch.randn(1, 8, 2, 16)
    too_long = torch.tensor([8], dtype=torch.int32)
    monkeypatch.setattr(kvcache, "_DEBUG_CHECKS", False)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 8 is out of range: it must be in \[0, 7\]"):
        portattn.flash_attn_with_kvcache(q, cache, cache.clone(), k=torch.randn(1, 1, 2, 16),
                                         v=torch.randn(1, 1, 2, 16), cache_seqlens=too_long)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[0\] = 4 is out of range: it must be in \[0, 0\]"):
        portattn.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=3,
                                         cache_batch_idx=torch.tensor([4], dtype=torch.int32))


@pytest.mark.parametrize("bad, match", [
    (dict(num_splits=-1), "num_splits must be an int >= 0"),
    (dict(rotary_cos=torch.rand(8, 16), rotary_sin=torch.rand(8, 16)), "rotary_dim <= headdim"),
    (dict(rotary_cos=torch.rand(8, 4)), "given together"),
    (dict(block_table=torch.zeros(1, 2, dtype=torch.int64)), "block_table must be int32"),
])
def test_bad_kvcache_arguments_name_themselves(bad, match):
    q = torch.randn(1, 1, 2, 16)
    cache = torch.randn(2, 8, 2, 16)
    with pytest.raises((ValueError, TypeError), match=match):
        portattn.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=3, **bad)


def test_decode_benchmark_dry_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "bench")]))
    done = subprocess.run([sys.executable, "bench/bench_decode.py", "--dry-run", "--batches", "1", "--caches", "512",
                           "--head-dims", "64", "--short-query", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    markdown = (tmp_path / "decode_bench.md").read_text()
    assert "DRY RUN" in markdown and "| 1 | 512 | 4/2 | 64 |" in markdown
    assert "## Short query through flash_attn_func" in markdown


class _Props:
    """torch.cuda.get_device_properties of an H200 as the planner reads it."""
    multi_processor_count = 132
    shared_memory_per_multiprocessor = 228 * 1024
    max_threads_per_multi_processor = 2048


def test_resident_slots_use_the_measured_ctas_per_sm(monkeypatch):
    """The occupancy query's CTAs per SM (registers included) win over the shared-memory count:
    the FP8 regs kernel's 48 KiB would fit four CTAs per SM, its registers hold three."""
    monkeypatch.setattr(decode, "_SLOTS", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _Props())
    tile = {"stage_keys": 64, "threads": 128, "smem_bytes": 48 * 1024}
    device = torch.device("cuda", 0)
    assert decode.resident_slots(device, tile) == (132, 132 * 4)  # no measurement: 228 // (48 + 1)
    assert decode.resident_slots(device, dict(tile, ctas_per_sm=3)) == (132, 132 * 3)
    assert decode.resident_slots(device, dict(tile, ctas_per_sm=2)) == (132, 132 * 2)
    assert decode.resident_slots(device, dict(tile, ctas_per_sm=-1)) == (132, 132 * 4)  # a failed query


class _PathBackend(_RecordingBackend):
    """A CUDA module's decode surface with FP8 paths: regs (1) at three CTAs per SM, regs_deep (2)
    at two; softcap/ALiBi (extras) at two on either."""

    def __init__(self):
        super().__init__()
        self.path = 1
        self.asked = []

    def decode_path_id(self):
        return self.path

    def decode_tile(self, head_dim, device=None, fp8_kv=False, dtype=None, extras=False, path=0):
        self.asked.append((fp8_kv, dtype, extras, path))
        ctas = 2 if extras or path == 2 else 3
        return {"stage_keys": 64, "threads": 128, "smem_bytes": (80 if path == 2 else 48) * 1024, "ctas_per_sm": ctas}


def test_an_fp8_path_switch_gets_its_own_plan(monkeypatch):
    """The plan key holds the FP8 path (and softcap/ALiBi): switching the path in-process plans
    with the new kernel's occupancy, not a cached plan of the other one."""
    monkeypatch.setattr(decode, "_PLANS", {})
    monkeypatch.setattr(decode, "_SLOTS", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _Props())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    backend = _PathBackend()
    q = torch.randn(8, 1, 32, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(8, 32768, 8, 128).to(torch.float8_e4m3fn)  # 64 CTAs of 512 stages each

    def call(**extra):
        decode.run_decode(backend, q, k, v, False, 0.125, -1, 0, extra.get("softcap", 0.0), None)
        return backend.splits[-1]

    regs = call()
    backend.path = 2
    deep = call()
    softcap = call(softcap=8.0)
    min_stages = decode.MIN_KEYS_PER_SPLIT // 64
    assert regs == decode.choose_num_splits(64, 512, 132 * 3, min_stages, sms=132) == 6
    assert deep == decode.choose_num_splits(64, 512, 132 * 2, min_stages, sms=132) == 4
    assert softcap == deep
    assert [a[2:] for a in backend.asked] == [(False, 1), (False, 2), (True, 2)]
    assert all(a[:2] == (True, torch.bfloat16) for a in backend.asked)
    backend.path = 1
    assert call() == regs and len(backend.asked) == 3  # the regs plan, from the cache
    bf16 = torch.zeros(8, 32768, 8, 128, dtype=torch.bfloat16)
    backend.path = 2
    decode.run_decode(backend, q, bf16, bf16, False, 0.125, -1, 0, 0.0, None)
    assert backend.asked[-1][0] is False and backend.asked[-1][3] == 0  # a 16-bit cache has one path


def test_plan_cache_is_keyed_by_key_length_buckets():
    """A dynamic cache grows by one key per step: the planner's key is a bucket of the length,
    at most 25% (or 63 keys) above it and a few per doubling."""
    buckets = {decode.key_bucket(n) for n in range(1, 65537)}
    assert len(buckets) <= 4 * 17
    for n in (1, 63, 64, 65, 1000, 1024, 1025, 8191, 8193, 65536):
        assert n <= decode.key_bucket(n) <= max(n + 63, 1.25 * n)


def test_sm_margin_is_taken_off_the_sms_the_split_count_is_planned_for(monkeypatch):
    """FlashAttention-3's sm_margin: the planner sees SMs - sm_margin SMs (their slots with them), and
    plans once per margin (the margin is part of the plan's key)."""
    monkeypatch.setattr(decode, "_PLANS", {})
    monkeypatch.setattr(decode, "_capturing", lambda: True)
    monkeypatch.setattr(decode, "resident_slots", lambda device, tile: (132, H100_SLOTS))
    backend = _RecordingBackend()
    q = torch.randn(16, 1, 16, 64)
    k = v = torch.zeros(1, 1, 4, 64).expand(16, 8192, 4, 64)  # (the recorder reads only shapes)
    for margin in (0, 20, 0, 131, 500):
        decode.run_decode(backend, q, k, v, False, 0.125, -1, 0, 0.0, None, sm_margin=margin)
    stages, per_split = 8192 // 64, decode.MIN_KEYS_PER_SPLIT // 64
    expected = [decode.choose_num_splits(64, stages, 2 * sms, per_split, sms=sms) for sms in (132, 112, 132, 1, 1)]
    assert backend.splits == expected
    assert expected[:2] == [4, 3]  # 64 CTAs: 4 splits fill 264 slots; 3 fill 224 (4 would need 2 waves)
