"""A few small CUDA forward and backward launches for compute-sanitizer (not collected by pytest).

    compute-sanitizer --tool memcheck  python tests/gpu/sanitize_cuda.py
    compute-sanitizer --tool racecheck python tests/gpu/sanitize_cuda.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck python tests/gpu/sanitize_cuda.py

(initcheck on every kernel, never with --kernel-name: writes by kernels it does not
instrument are invisible to it, so reads of that memory would be reported.)

(initcheck without torch's caching allocator: each workspace is then a fresh cudaMalloc
that the tool tracks as unwritten; a recycled block would count as written.)

The cases cover the code paths that index memory differently: sequence tails
(17, 113 rows), a head dim served by a larger variant (40 -> 64, 200 -> 224, the
backward splitting it in two halves), GQA and MQA (the backward's fp32 dK/dV
atomics and its per-KV-head loop), varlen with empty and single-row sequences,
the extras kernel (softcap + ALiBi + dropout), adversarial cu_seqlens / seqused_k values
(test_adversarial_bounds.py's cases, sm80+ and sm_90a forward and backward),
the decode kernels (decode_cases) and their containment of out-of-range cache metadata
(test_decode_containment.py's cases), and the backward's deterministic
dQ slices (flash-attn's deterministic case whose splits start on key blocks no query
sees), and the sm_90a forward (each of its schedules, windows and softcap; head dims 96 and
192 on the larger kernels that serve them padded) and backward (GQA, both modes; head dim 96
on the hd128 kernel, padded, with varlen) on an sm_90 device. Outputs and gradients are NaN-poisoned;
exits non-zero if any stays unwritten, while the sanitizer reports access errors and races.
"""
from __future__ import annotations

import math
import sys

import torch

from portattn.backends.cuda import CudaBackend, CudaSm90Backend
from portattn.capability.callspec import CallSpec

BACKEND = CudaBackend()
BACKEND_SM90 = CudaSm90Backend()
HOPPER_CALL = CallSpec("bfloat16", 128, 128, "cuda", frozenset({"forward", "causal", "gqa"}))


def _forward(backend, q, k, v, **options):
    """NaN-poisoned out/lse, the forward launched on them, and the options it used."""
    varlen = options.get("cu_seqlens_q") is not None
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    out = torch.full_like(q, float("nan"))
    lse = torch.full(lse_shape, float("nan"), device=q.device)
    args = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                softmax_scale=1 / math.sqrt(q.shape[-1]), window_left=-1, window_right=-1, softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0)
    args.update(options)
    backend.forward(q, k, v, out, lse, **args)
    torch.cuda.synchronize()
    return out, lse, args


def unwritten_forward_padded(q, k, v, backend, **options) -> int:
    """A forward (the Hopper path serves head dim 96 padded; 192 and 256 run the same check), into an
    output whose rows are 64 columns wider and NaN there: 1 if it left a NaN in its columns or
    wrote one past them (a padded kernel's zero columns), else 0."""
    head_dim = q.shape[-1]
    out_wide = torch.full((*q.shape[:-1], head_dim + 64), float("nan"), device=q.device, dtype=q.dtype)
    out = out_wide[..., :head_dim]
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    args = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                softmax_scale=1 / math.sqrt(head_dim), window_left=-1, window_right=-1, softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0)
    args.update(options)
    backend.forward(q, k, v, out, lse, **args)
    torch.cuda.synchronize()
    return int(out.isnan().any().item() or lse.isnan().any().item() or not out_wide[..., head_dim:].isnan().all().item())


def unwritten_backward_padded(q, k, v, backend, **options) -> int:
    """Forward, then backward in both modes into gradients whose rows are 64 columns wider and
    NaN there (the hd96 backward on the hd128 kernel: its dK/dV stores must clip or skip the
    padding, its convert kernels write the call's columns only): how many of the three left a
    NaN in their columns or wrote one past them."""
    out, lse, args = _forward(backend, q, k, v, **options)
    failures = int(out.isnan().any().item() or lse.isnan().any().item())
    head_dim = q.shape[-1]
    for deterministic in (False, True):
        wide = [torch.full((*x.shape[:-1], head_dim + 64), float("nan"), device=x.device, dtype=x.dtype)
                for x in (q, k, v)]
        grads = [w[..., :head_dim] for w in wide]
        backend.backward(torch.randn_like(out), q, k, v, out, lse, *grads, deterministic=deterministic, **args)
        torch.cuda.synchronize()
        failures += int(any(g.isnan().any().item() or not w[..., head_dim:].isnan().all().item()
                            for g, w in zip(grads, wide)))
    return failures


def hopper_serves_forward(head_dim) -> bool:
    """Whether this build and device run a bf16 forward at head_dim on the sm_90a path."""
    call = CallSpec("bfloat16", head_dim, head_dim, "cuda", frozenset({"forward", "causal", "gqa"}))
    return BACKEND_SM90.unsupported_reasons(call) == []


def hopper_serves_training(head_dim) -> bool:
    """Whether this build and device run a bf16 forward and backward at head_dim on the sm_90a path."""
    call = CallSpec("bfloat16", head_dim, head_dim, "cuda", frozenset({"forward", "backward", "causal", "gqa", "varlen"}))
    return BACKEND_SM90.unsupported_reasons(call) == []


def unwritten(q, k, v, backend=BACKEND, **options) -> int:
    """Forward, then backward in both modes; how many of the three left a NaN."""
    out, lse, args = _forward(backend, q, k, v, **options)
    failures = int(out.isnan().any().item() or lse.isnan().any().item())
    for deterministic in (False, True):
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        backend.backward(torch.randn_like(out), q, k, v, out, lse, *grads, deterministic=deterministic, **args)
        torch.cuda.synchronize()
        failures += int(any(g.isnan().any().item() for g in grads))
    return failures


def decode_cases() -> int:
    """The decode kernels (csrc/decode_*): contiguous with batch_idx and leftpad, paged with
    page sizes 16 and 48 (not a power of two) and pages spanning stages, the append + rotary
    kernel, several splits (the combine), a short varlen query, and adversarial lengths,
    pages and indices that the kernels clamp."""
    import portattn

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    failures = 0
    for page, splits in ((0, 3), (16, 1), (48, 5)):
        q = torch.randn(3, 2, 8, 128, **bf16)
        k_new, v_new = torch.randn(3, 2, 2, 128, **bf16), torch.randn(3, 2, 2, 128, **bf16)
        cos, sin = torch.rand(400, 32, **bf16), torch.rand(400, 32, **bf16)
        seqlens = torch.tensor([0, 100, 380], dtype=torch.int32, device="cuda")
        leftpad = torch.tensor([0, 7, 300], dtype=torch.int32, device="cuda") if page != 16 else None
        if page:
            k_cache = torch.randn(3 * 384 // page + 2, page, 2, 128, **bf16)
            table = torch.randperm(k_cache.shape[0], device="cuda")[: 3 * 384 // page].reshape(3, -1).to(torch.int32)
            batch_idx = None
        else:
            k_cache, table = torch.randn(5, 384, 2, 128, **bf16), None
            batch_idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
        out, lse = portattn.flash_attn_with_kvcache(
            q, k_cache, torch.randn_like(k_cache), k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=seqlens, cache_leftpad=leftpad, cache_batch_idx=batch_idx, block_table=table,
            causal=True, num_splits=splits, return_softmax_lse=True)
        torch.cuda.synchronize()
        failures += int(out.isnan().any().item() or lse.isnan().any().item())
    q = torch.randn(4, 8, 128, **bf16)
    kv = torch.randn(2000, 2, 2, 128, **bf16)
    cu_q = torch.tensor([0, 1, 3, 3, 4], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 700, 701, 701, 2000], dtype=torch.int32, device="cuda")
    out = portattn.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_q, cu_k, 2, 1299)
    torch.cuda.synchronize()
    failures += int(out.isnan().any().item())
    # Values past every bound: lengths, leftpad, batch index and page numbers (clamped).
    k_cache = torch.randn(4, 64, 2, 128, **bf16)
    q = torch.randn(2, 1, 8, 128, **bf16)
    for options in (dict(cache_seqlens=torch.tensor([10**6, -5], dtype=torch.int32, device="cuda")),
                    dict(cache_seqlens=torch.tensor([30, 60], dtype=torch.int32, device="cuda"),
                         cache_leftpad=torch.tensor([500, -9], dtype=torch.int32, device="cuda"),
                         cache_batch_idx=torch.tensor([-1, 99], dtype=torch.int32, device="cuda")),
                    dict(cache_seqlens=torch.tensor([64, 33], dtype=torch.int32, device="cuda"),
                         block_table=torch.tensor([[2, 10**6], [-4, 1]], dtype=torch.int32, device="cuda"))):
        cache = k_cache.view(8, 32, 2, 128) if "block_table" in options else k_cache
        portattn.flash_attn_with_kvcache(q, cache, cache.clone(), k=torch.randn(2, 1, 2, 128, **bf16),
                                         v=torch.randn(2, 1, 2, 128, **bf16), num_splits=2, **options)
        torch.cuda.synchronize()
    # FP8 (e4m3) caches (csrc/decode_fp8_*): contiguous and paged (page 16), the quantising append
    # with rotary, descales per (batch, KV head), several splits, and a 1-row varlen-free GQA query.
    if torch.cuda.get_device_capability() >= (8, 9):
        for page, splits, head_dim in ((0, 3, 128), (16, 1, 64), (16, 4, 256)):
            q = torch.randn(3, 1, 8, head_dim, **bf16)
            rows = 3 * 384 // page + 2 if page else 3
            k_cache = torch.randn(rows, page or 384, 2, head_dim, **bf16).to(torch.float8_e4m3fn)
            v_cache = torch.randn_like(k_cache, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            table = (torch.randperm(rows, device="cuda")[: 3 * 384 // page].reshape(3, -1).to(torch.int32)
                     if page else None)
            descale = torch.rand(3, 2, device="cuda") * 0.4 + 0.05
            cos, sin = torch.rand(400, head_dim // 4, **bf16), torch.rand(400, head_dim // 4, **bf16)
            out, lse = portattn.flash_attn_with_kvcache(
                q, k_cache, v_cache, k=torch.randn(3, 1, 2, head_dim, **bf16), v=torch.randn(3, 1, 2, head_dim, **bf16),
                rotary_cos=cos, rotary_sin=sin, cache_seqlens=torch.tensor([0, 100, 380], dtype=torch.int32, device="cuda"),
                block_table=table, causal=True, num_splits=splits, return_softmax_lse=True,
                k_descale=descale, v_descale=descale.flip(0))
            torch.cuda.synchronize()
            failures += int(out.isnan().any().item() or lse.isnan().any().item())
    else:
        print("sanitize_cuda: FP8 decode skipped (needs sm_89 or newer)")
    return failures


def main() -> int:
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    failures = 0
    # A restricted build (PORTATTN_HEADDIMS) runs the cases its kernels serve: a head dim
    # runs on the smallest built one at least as large.
    built = BACKEND.build_config()["head_dims"]

    def served(head_dim):
        if any(b >= head_dim for b in built):
            return True
        print(f"sanitize_cuda: head dim {head_dim} skipped (this build has {built})")
        return False

    for head_dim, sq, sk, hk, options in [
        (40, 17, 113, 2, dict(window_right=0)),  # narrow tiles (Note [portattn sm80 narrow tiles])
        (32, 300, 257, 1, dict(window_right=0)),  # the wide ones at a small head dim
        (128, 113, 17, 1, dict()),  # narrow tiles at hd128
        (128, 400, 333, 2, dict(window_right=0)),  # the wide ones
        (200, 130, 70, 2, dict(window_left=20, window_right=3)),
        # hd256: under PORTATTN_MAX_SMEM_KIB=99 the narrow 64 x 64 four-warp tile (csrc/fwd_launch.cuh).
        (256, 130, 70, 2, dict(window_right=0)),
        (64, 65, 129, 2, dict(softcap=5.0, alibi_slopes=torch.rand(2, device="cuda"), dropout_p=0.3,
                              rng_seed=7, rng_offset=3)),
        (64, 65, 129, 1, dict(softcap=5.0, alibi_slopes=torch.rand(2, device="cuda"), dropout_p=0.3,
                              rng_seed=7, rng_offset=3)),
        # The wide backward's extras kernel (Note [portattn sm80 wide backward]): 128 and 160 have 4 key
        # groups, 256 two (or three at 99 KiB: 48 x 32, 6 warps); at 99 KiB 128 runs bwd_kernel.
        (128, 65, 129, 2, dict(softcap=5.0, alibi_slopes=torch.rand(2, device="cuda"), dropout_p=0.3,
                               rng_seed=7, rng_offset=3)),
        (160, 65, 129, 2, dict(softcap=5.0, alibi_slopes=torch.rand(2, device="cuda"), dropout_p=0.3,
                               rng_seed=7, rng_offset=3)),
        (256, 65, 129, 1, dict(softcap=5.0, alibi_slopes=torch.rand(2, device="cuda"), dropout_p=0.3,
                               rng_seed=7, rng_offset=3, window_right=0)),
    ]:
        if not served(head_dim):
            continue
        q = torch.randn(2, sq, 2, head_dim, **bf16)
        k = torch.randn(2, sk, hk, head_dim, **bf16)
        v = torch.randn(2, sk, hk, head_dim, **bf16)
        failures += unwritten(q, k, v, **options)
    if served(192):
        # flash-attn's test_flash_attn_deterministic[3-799-False-192-True-True-dtype0] (issue 12
        # item 7): every deterministic split starts on key blocks outside the window.
        q = torch.randn(4, 3, 9, 192, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(4, 799, 9, 192, device="cuda", dtype=torch.float16) for _ in range(2))
        failures += unwritten(q, k, v, window_left=551, window_right=0)
    if served(96):
        lens = [0, 1, 17, 130]
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        q = torch.randn(sum(lens), 4, 96, **bf16)
        kv = torch.randn(sum(lens), 2, 2, 96, **bf16)
        failures += unwritten(q, kv[:, :, 0], kv[:, :, 1], cu_seqlens_q=cu, cu_seqlens_k=cu,
                              max_seqlen_q=130, max_seqlen_k=130, window_right=0)
    if BACKEND_SM90.unsupported_reasons(HOPPER_CALL) == []:  # the sm_90a path, on an sm_90 device
        for head_dim, seqlen_q, seqlen_k in ((128, 17, 113), (128, 130, 70), (64, 300, 257)):
            q = torch.randn(2, seqlen_q, 4, head_dim, **bf16)
            k, v = (torch.randn(2, seqlen_k, 2, head_dim, **bf16) for _ in range(2))
            failures += unwritten(q, k, v, backend=BACKEND_SM90, window_right=0)
        # Each forward schedule (hopper_fwd_launch.cuh): persistent non-causal with several tiles
        # per CTA (7 query blocks x 20 heads x 3 > 132 SMs), causal past 1024 keys (persistent,
        # ping-pong; fewer tiles than CTAs, so unpaired), and the window + softcap kernels of both
        # directions.
        q = torch.randn(3, 777, 20, 128, **bf16)
        k, v = (torch.randn(3, 513, 20, 128, **bf16) for _ in range(2))
        failures += unwritten(q, k, v, backend=BACKEND_SM90)
        q, k, v = (torch.randn(1, 1100, 2, 64, **bf16) for _ in range(3))
        failures += unwritten(q, k, v, backend=BACKEND_SM90, window_right=0)
        failures += unwritten(q, k, v, backend=BACKEND_SM90, window_left=100, window_right=37, softcap=30.0)
        # hd64 short causal: the cross-tile phase (Note [portattn hopper cross-tile phase]) over
        # several tiles per CTA, with empty first tiles (seqlen_q > seqlen_k) ending its streams.
        q = torch.randn(3, 777, 20, 64, **bf16)
        k, v = (torch.randn(3, 513, 20, 64, **bf16) for _ in range(2))
        failures += unwritten(q, k, v, backend=BACKEND_SM90, window_right=0)
        # Causal past 1024 keys with more tiles than CTAs: the paired walk (Note [portattn hopper
        # paired tiles]), odd query-block counts (11 at hd64's 192 rows, 17 at hd128); at hd64 up to
        # 4096 keys with the cross-tile phase (PORTATTN_HOPPER_FWD_HD64_CAUSAL_XTILE).
        for head_dim in (64, 128):
            q, k, v = (torch.randn(2, 2100, 20, head_dim, **bf16) for _ in range(3))
            failures += unwritten(q, k, v, backend=BACKEND_SM90, window_right=0)
        # hd128 from 4097 keys (2048 without a mask): 176-key blocks (Note [portattn hopper 176-key
        # blocks]), ragged last block.
        q = torch.randn(1, 1500, 2, 128, **bf16)
        k, v = (torch.randn(1, 4500, 2, 128, **bf16) for _ in range(2))
        failures += unwritten(q, k, v, backend=BACKEND_SM90)
        failures += unwritten(q, k, v, backend=BACKEND_SM90, window_right=0)
        # Causal past 8192 keys: one CTA per tile again (kPairedCausalMaxSeqlenK), 176-key blocks.
        q = torch.randn(1, 300, 2, 128, **bf16)
        k, v = (torch.randn(1, 8200, 2, 128, **bf16) for _ in range(2))
        failures += unwritten(q, k, v, backend=BACKEND_SM90, window_right=0)
    # Head dim 96 on the hd128 kernels (Note [portattn hopper padded head dims]), 192 on its own
    # (Notes [portattn hopper hd192], 112-key blocks, and [portattn hopper hd192 backward], two
    # launches), and 256 itself (the backward's head dim split over two CTAs, Note [portattn hopper split head
    # dim]): sequence tails, GQA, causal and a window with softcap; the backward too where the
    # Hopper path has it (both modes, GQA's fp32 dK/dV accumulators in the default mode, MHA's TMA
    # stores, varlen blocks past their sequence's end with the direct stores).
    for head_dim in (96, 192, 256):
        if not hopper_serves_forward(head_dim):
            print(f"sanitize_cuda: sm_90a head dim {head_dim} skipped (not served by this build or device)")
            continue
        training = hopper_serves_training(head_dim)
        for seqlen_q, seqlen_k, hk, options in ((17, 113, 2, dict(window_right=0)), (130, 70, 2, dict()),
                                                (130, 257, 4, dict(window_right=0)),
                                                (113, 300, 2, dict(window_left=40, window_right=7, softcap=30.0))):
            q = torch.randn(2, seqlen_q, 4, head_dim, **bf16)
            k, v = (torch.randn(2, seqlen_k, hk, head_dim, **bf16) for _ in range(2))
            failures += unwritten_forward_padded(q, k, v, BACKEND_SM90, **options)
            if training:
                failures += unwritten_backward_padded(q, k, v, BACKEND_SM90, **options)
        if training:
            lens = [0, 1, 17, 130]
            cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
            q = torch.randn(sum(lens), 4, head_dim, **bf16)
            k, v = (torch.randn(sum(lens), 2, head_dim, **bf16) for _ in range(2))
            failures += unwritten_backward_padded(q, k, v, BACKEND_SM90, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                  max_seqlen_q=130, max_seqlen_k=130, window_right=0)
    if served(64):
        # Adversarial cu_seqlens / seqused_k values (decreasing, past the tensor, negative,
        # INT_MIN/INT_MAX, longer than max_seqlen): the kernels clamp them on the device
        # (common/seq_bounds.h); memcheck sees any access outside the tensors, the guard
        # rows of run_case any write outside them (issue 12 item 4).
        from test_adversarial_bounds import CASES, adversarial_cases, run_case

        from portattn.backends import cuda as cuda_package

        hopper = BACKEND_SM90.unsupported_reasons(HOPPER_CALL) == []
        for case in adversarial_cases():
            for window in ((-1, -1), (10, 3)):
                for deterministic in (False, True):
                    wrong = run_case(cuda_package._C, case, window=window, deterministic=deterministic)
                    if hopper and CASES[case][2] is None:
                        wrong += run_case(cuda_package._C, case, window=window, entry="hopper_fwd",
                                          deterministic=deterministic)
                    if wrong:
                        print(f"sanitize_cuda: adversarial {case} {window}: {wrong}")
                    failures += int(bool(wrong))
    if served(128) and hasattr(BACKEND.module, "decode"):
        failures += decode_cases()
    if served(64) and hasattr(BACKEND.module, "decode"):
        # Out-of-range cache metadata (negative / past-the-end cache_seqlens, leftpad,
        # batch_idx, page numbers): contained, not clamped (Note [portattn decode errors]);
        # memcheck sees any read of another page, run_case any write outside the good rows.
        import os

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # error_rule, naive
        from test_decode_containment import containment_cases, run_case as run_containment_case

        for case in containment_cases():
            for splits in (1, 3):
                wrong = run_containment_case(case, torch.bfloat16, splits, oracle=False)
                if wrong:
                    print(f"sanitize_cuda: containment {case} splits={splits}: {wrong}")
                failures += int(bool(wrong))
    print(f"sanitize_cuda: {failures} launch(es) left NaN in their outputs or wrote outside them")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
