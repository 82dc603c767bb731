"""The ROCm kernels' logic, run on the CPU through tests/rocm_emulation/hip_emu.h.

No AMD GPU is reachable. This builds the real kernel headers, the generated
variant sources and module.cpp for pseudo-archs with clang++-19 as host C++
(one thread per lane, matrix and cross-lane ops emulated with the assumed
layouts): "emu" for the CDNA kernels (wave64 MFMA, Note [portattn MFMA
layout]), "emu_gfx950" for them as gfx950 builds them (CDNA4's double-depth
MFMAs, Note [portattn MFMA double depth], and its tiles) and "emu_gfx11" / "emu_gfx12" for the RDNA
forward and decode (wave32 WMMA, Note [portattn WMMA layout]). It drives them through
RocmBackend, checking every declared feature with the project's error rule
(tests/error_rule.py).
It cannot validate the MFMA layout against hardware or the device compiler's
code generation (tests/test_rocm_isa.py checks the latter statically; the
first-use self-check covers the rest on a real device).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import shutil
import sysconfig

import pytest

torch = pytest.importorskip("torch")

from error_rule import assert_grads, assert_lse, assert_output  # noqa: E402
from naive import naive_attention  # noqa: E402
from test_rocm_isa import rocm_build, variants  # noqa: E402  (the build helpers, loaded torch-free)
from portattn.backends import abi  # noqa: E402  (kv_args: the FP8 arguments, here the query's dtype)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROCM_DIR = os.path.join(ROOT, "portattn", "backends", "rocm")
EMU_HEADER = os.path.join(ROOT, "tests", "rocm_emulation", "hip_emu.h")
HOST_CLANG = "clang++-19"  # _Float16 and ext_vector_type on the host need clang


# pseudo-arch -> wave size of its kernel family (variants.ARCH_ISA): CDNA (MFMA,
# wave64) and the two RDNA WMMA layouts (wave32), each its own module.
EMU_ARCHS = {"emu": 64, "emu_gfx950": 64, "emu_gfx11": 32, "emu_gfx12": 32}
# The CDNA4 (gfx950: double-depth MFMAs, Note [portattn MFMA double depth]) instantiations the
# CDNA4 tests below call, each with its forward, backward and decode: both dtypes and every
# head-dim tile. The other three are not compiled for the emulation (about 50 s of build);
# they differ only in template constants, and tests/test_rocm_isa.py compiles all of them.
EMU_CDNA4 = {("bfloat16", 64), ("float16", 128), ("bfloat16", 256)}
# The RDNA decode instantiations (dtype, head dim) the RDNA decode tests below call; the
# other three per arch are not compiled for the emulation (about 25 s of build per arch).
# Their code differs only in template constants; tests/test_rocm_isa.py compiles all of them.
EMU_RDNA_DECODE = {("float16", 64), ("bfloat16", 128), ("bfloat16", 256)}
# Likewise the RDNA backward instantiations the RDNA backward tests below call.
EMU_RDNA_BWD = {("float16", 64), ("bfloat16", 64), ("bfloat16", 128), ("bfloat16", 256)}


def build_emulation(build_dir: str, arch: str = "emu") -> str:
    """Compiles every variant of `arch` (forward, backward, decode where built) for the CPU; returns the module path."""
    ninja_build = rocm_build.ninja_build
    csrc = os.path.join(ROCM_DIR, "csrc")
    chosen = variants.select([arch])
    if arch in variants.CDNA4_ARCHS:
        chosen = [v for v in chosen if (v.dtype, v.config.head_dim) in EMU_CDNA4]
    if variants.isa_of(arch) != "mfma":
        def emulated_only(v):
            key, config = (v.dtype, v.config.head_dim), v.config
            if key not in EMU_RDNA_DECODE:
                config = dataclasses.replace(config, decode=None)
            if key not in EMU_RDNA_BWD:
                config = dataclasses.replace(config, bwd_dq=None, bwd_dkdv=None)
            return dataclasses.replace(v, config=config)
        chosen = [emulated_only(v) for v in chosen]
    gen = os.path.join(build_dir, "gen")
    os.makedirs(gen, exist_ok=True)
    flags = [HOST_CLANG, "-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden", "-Wno-unknown-attributes",
             "-Wno-ignored-attributes", f'-DPORTATTN_ROCM_EMULATE="{EMU_HEADER}"', f'-DPORTATTN_EMU_ARCH="{arch}"',
             f"-DPORTATTN_EMU_WAVE={EMU_ARCHS[arch]}", f"-I{csrc}",
             f"-I{sysconfig.get_paths()['include']}", f"-I{rocm_build._pybind11_include()}"]
    sources = [rocm_build._write_if_changed(os.path.join(gen, v.stem(direction) + ".cpp"),
                                            variants.instantiation_source(v, direction))
               for v in chosen for direction in v.directions]
    sources.append(rocm_build._write_if_changed(
        os.path.join(gen, "registry.cpp"), variants.registry_source(chosen, {arch: "CPU emulation"})))
    sources.append(os.path.join(csrc, "module.cpp"))
    job = ninja_build.NinjaBuild(build_dir)
    objects = []
    for source in sources:
        obj = os.path.join(build_dir, os.path.basename(source) + ".o")
        job.compiles.append(ninja_build.CompileStep(
            source=source, output=obj, depfile=obj + ".d",
            command=[*flags, "-MD", "-MF", "$depfile", "-c", "$in", "-o", "$out"]))
        objects.append(obj)
    ext_path = os.path.join(build_dir, "_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    job.links.append(ninja_build.LinkStep(
        inputs=objects, output=ext_path, command=[HOST_CLANG, "-shared", "-pthread", "$in", "-o", "$out"]))
    job.run(os.environ)
    return ext_path


_LOADED = {}  # pseudo-arch -> its module: one build per arch however many fixtures use it


def load_emulation(tmp_path_factory, arch: str):
    if arch in _LOADED:
        return _LOADED[arch]
    if shutil.which(HOST_CLANG) is None:
        pytest.skip(f"{HOST_CLANG} not found (run .ci/install_rocm_toolchain.sh)")
    root = os.environ.get("PORTATTN_ROCM_EMU_BUILD_DIR")
    build_dir = os.path.join(root, arch) if root and arch != "emu" else root
    build_dir = build_dir or str(tmp_path_factory.mktemp(f"rocm_{arch}"))
    ext_path = build_emulation(build_dir, arch)
    spec = importlib.util.spec_from_file_location(f"portattn_rocm_{arch}._C", ext_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _LOADED[arch] = module
    return module


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The emulated CDNA `_C` module itself (the decode entry points are called on it directly)."""
    return load_emulation(tmp_path_factory, "emu")


def _backend_of(module):
    import portattn.backends as backends
    import portattn.backends.rocm as rocm

    # The module and the stream getter (CPU torch has none) wherever the wrapper looks them up.
    no_stream = lambda index: 0  # noqa: E731
    patches = [(rocm, "_C", module)]
    for owner, name in ((rocm, "_raw_stream"), (getattr(backends, "abi", None), "raw_stream")):
        if owner is not None and hasattr(owner, name):
            patches.append((owner, name, no_stream))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield rocm.RocmBackend()
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@pytest.fixture(scope="module")
def backend(emulated):
    """The CDNA kernels behind RocmBackend (forward, backward)."""
    yield from _backend_of(emulated)


@pytest.fixture(scope="module", params=[arch for arch in EMU_ARCHS if arch not in variants.CDNA4_ARCHS])
def fwd_backend(request, tmp_path_factory):
    """Each family's forward behind RocmBackend: CDNA, RDNA3 (gfx11 WMMA), RDNA4 (gfx12 WMMA)
    (CDNA4, which builds a subset of the head dims, has its own tests below)."""
    yield from _backend_of(load_emulation(tmp_path_factory, request.param))


def _run(backend, q, k, v, *, window=(-1, -1), softcap=0.0, alibi=None, dropout_p=0.0, seed=0,
         offset=0, cu_q=None, cu_k=None, max_q=0, max_k=0):
    out = torch.full_like(q, float("nan"))
    if cu_q is None:
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"))
    else:
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"))
    backend.forward(
        q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=1.0 / math.sqrt(q.shape[-1]), window_left=window[0], window_right=window[1],
        softcap=softcap, alibi_slopes=alibi, dropout_p=dropout_p, rng_seed=seed, rng_offset=offset,
    )
    return out, lse


def _check(out, lse, q, k, v, **options):
    ref, ref_lse = naive_attention(q, k, v, compute_dtype=torch.float64, **options)
    low, _ = naive_attention(q, k, v, compute_dtype=q.dtype, **options)
    _, low_lse = naive_attention(q.float(), k.float(), v.float(), compute_dtype=torch.float32, **options)
    assert_output(out, ref, low)
    assert_lse(lse, ref_lse, low_lse)


def _rand(*shape, dtype):
    return torch.randn(*shape, dtype=dtype)


def _qkv(seqlen_q, seqlen_k, head_dim, dtype, batch=1, heads=2):
    return (_rand(batch, seqlen_q, heads, head_dim, dtype=dtype), _rand(batch, seqlen_k, heads, head_dim, dtype=dtype),
            _rand(batch, seqlen_k, heads, head_dim, dtype=dtype))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (130, 70)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_forward_matches_oracle(fwd_backend, dtype, head_dim, seqlens, causal):
    q, k, v = _qkv(*seqlens, head_dim, dtype)
    out, lse = _run(fwd_backend, q, k, v, window=(-1, 0 if causal else -1))
    _check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_window_alibi_softcap_gqa(fwd_backend, head_dim):
    dtype = torch.bfloat16
    q = _rand(2, 150, 4, head_dim, dtype=dtype)
    k = _rand(2, 97, 2, head_dim, dtype=dtype)
    v = _rand(2, 97, 2, head_dim, dtype=dtype)
    slopes = torch.rand(2, 4)
    out, lse = _run(fwd_backend, q, k, v, window=(20, 3), softcap=2.0, alibi=slopes)
    _check(out, lse, q, k, v, window=(20, 3), softcap=2.0, alibi_slopes=slopes)


def test_rows_without_visible_keys_are_zero_with_minus_inf_lse(fwd_backend):
    q = _rand(1, 90, 2, 64, dtype=torch.float16)
    k = _rand(1, 40, 2, 64, dtype=torch.float16)
    v = _rand(1, 40, 2, 64, dtype=torch.float16)
    out, lse = _run(fwd_backend, q, k, v, window=(-1, 0))
    assert torch.isinf(lse[:, :, :50]).all() and (out[:, :50] == 0).all()
    _check(out, lse, q, k, v, causal=True)


def test_strided_views_from_packed_qkv(fwd_backend):
    qkv = _rand(2, 77, 3, 3, 64, dtype=torch.float16)
    q, k, v = qkv.unbind(dim=2)
    out, lse = _run(fwd_backend, q, k, v)
    _check(out, lse, q, k, v)


def _varlen(lens_q, lens_k, heads, head_dim, dtype):
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = _rand(sum(lens_q), heads, head_dim, dtype=dtype)
    k = _rand(sum(lens_k), heads, head_dim, dtype=dtype)
    v = _rand(sum(lens_k), heads, head_dim, dtype=dtype)
    return q, k, v, cu_q, cu_k


def test_varlen_causal(fwd_backend):
    lens_q, lens_k = [17, 140, 1, 5], [200, 64, 33, 0]
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k, 2, 64, torch.float16)
    out, lse = _run(fwd_backend, q, k, v, window=(-1, 0), cu_q=cu_q, cu_k=cu_k,
                    max_q=max(lens_q), max_k=max(lens_k))
    _check(out, lse, q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def _dropout_problem(varlen: bool, p: float, seed: int, offset: int):
    """(q, k, v, run options, oracle options) of a causal call with dropout, mask from philox.h."""
    from portattn.backends.reference import philox_keep_mask

    dtype, heads = torch.bfloat16, 2
    if varlen:
        lens_q, lens_k = [17, 130], [200, 64]
        q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k, heads, 64, dtype)
        batch, max_q, max_k = len(lens_q), max(lens_q), max(lens_k)
        run = dict(cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k)
        oracle = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    else:
        batch, max_q, max_k = 2, 131, 170
        q, k, v = (_rand(batch, n, heads, 64, dtype=dtype) for n in (max_q, max_k, max_k))
        run, oracle = {}, {}
    mask = philox_keep_mask(seed, offset, torch.arange(batch * heads).reshape(batch, heads), range(max_q),
                            range(max_k), p)
    run.update(window=(-1, 0), dropout_p=p, seed=seed, offset=offset)
    oracle.update(causal=True, dropout_mask=mask, dropout_p=p)
    return q, k, v, run, oracle


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_dropout_matches_reference_mask(fwd_backend, varlen):
    q, k, v, run, oracle = _dropout_problem(varlen, 0.17, 1234567, (5 << 32) + 77)
    out, lse = _run(fwd_backend, q, k, v, **run)
    _check(out, lse, q, k, v, **oracle)


# ---------------------------------------------------------------------------------------------
# Backward: dQ, dK, dV against autograd through the float64 oracle, 3x the torch low-precision error.


def _naive_grads(q, k, v, dout, compute_dtype, naive_options):
    leaves = [x.detach().to(compute_dtype).requires_grad_() for x in (q, k, v)]
    out, _ = naive_attention(*leaves, compute_dtype=compute_dtype, **naive_options)
    out.backward(dout.to(compute_dtype))
    return [x.grad for x in leaves]


def _run_backward(backend, q, k, v, *, naive_options, window=(-1, -1), softcap=0.0, alibi=None,
                  dropout_p=0.0, seed=0, offset=0, cu_q=None, cu_k=None, max_q=0, max_k=0):
    out, lse = _run(backend, q, k, v, window=window, softcap=softcap, alibi=alibi, dropout_p=dropout_p, seed=seed,
                    offset=offset, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k)
    dout = torch.randn_like(out)
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    backend.backward(
        dout, q, k, v, out, lse, *grads, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
        max_seqlen_k=max_k, softmax_scale=1.0 / math.sqrt(q.shape[-1]), window_left=window[0],
        window_right=window[1], softcap=softcap, alibi_slopes=alibi, dropout_p=dropout_p, rng_seed=seed,
        rng_offset=offset, deterministic=True,
    )
    ref = _naive_grads(q, k, v, dout, torch.float64, naive_options)
    low = _naive_grads(q, k, v, dout, q.dtype, naive_options)
    assert_grads(grads, ref, low)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(17, 113), (150, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_backward_matches_oracle(backend, dtype, head_dim, seqlens, causal):
    q, k, v = _qkv(*seqlens, head_dim, dtype)
    _run_backward(backend, q, k, v, window=(-1, 0 if causal else -1), naive_options=dict(causal=causal))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_window_alibi_softcap_gqa(backend, head_dim):
    q = _rand(2, 150, 4, head_dim, dtype=torch.bfloat16)
    k = _rand(2, 97, 2, head_dim, dtype=torch.bfloat16)
    v = _rand(2, 97, 2, head_dim, dtype=torch.bfloat16)
    slopes = torch.rand(2, 4)
    _run_backward(backend, q, k, v, window=(20, 3), softcap=2.0, alibi=slopes,
                  naive_options=dict(window=(20, 3), softcap=2.0, alibi_slopes=slopes))


def test_backward_varlen_causal_with_empty_sequences(backend):
    lens_q, lens_k = [17, 140, 1, 5, 0], [200, 64, 33, 0, 9]
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k, 2, 64, torch.float16)
    _run_backward(backend, q, k, v, window=(-1, 0), cu_q=cu_q, cu_k=cu_k, max_q=max(lens_q), max_k=max(lens_k),
                  naive_options=dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_backward_dropout_matches_reference_mask(backend, varlen):
    q, k, v, run, oracle = _dropout_problem(varlen, 0.17, 99991, (3 << 32) + 5)
    _run_backward(backend, q, k, v, naive_options=oracle, **run)


# ---------------------------------------------------------------------------------------------
# Decode (Note [portattn decode] in common/params.h): the module's decode / kvcache_append
# entry points, called with the shared argument lists of common/binding_args.h, against the
# float64 oracle applied to each sequence's keys gathered by hand from the cache layout.

DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def _ptr(tensor):
    return 0 if tensor is None else tensor.data_ptr()


def _decode_call(module, q, k_cache, v_cache, *, cache_seqlens=None, seqlen_new=0, leftpad=None, batch_idx=None,
                 block_table=None, cu_q=None, cu_k=None, max_q=0, seqlen_k=0, window=(-1, -1), softcap=0.0,
                 alibi=None, num_splits=1, errors=None, k_descale=None, v_descale=None):
    """decode(<PORTATTN_DECODE_ARGS>) on NaN-poisoned out / lse; returns (out, lse). An e4m3
    cache (torch.float8_e4m3fn) is passed as such, with its descales."""
    varlen = cu_q is not None
    if varlen:
        batch, seqlen_q = cu_q.numel() - 1, max_q
        nheads, head_dim = q.shape[1], q.shape[2]
        lse = torch.full((nheads, q.shape[0]), float("nan"))
        lse_strides = (0, lse.stride(0))
    else:
        batch, seqlen_q, nheads, head_dim = q.shape
        lse = torch.full((batch, nheads, seqlen_q), float("nan"))
        lse_strides = (lse.stride(0), lse.stride(1))
    nheads_k = k_cache.shape[-2]
    if cu_k is not None and not seqlen_k:
        # The call's max_seqlen_k, as portattn/backends/abi.py passes it: packed key counts
        # are capped at it (common/seq_bounds.h).
        seqlen_k = int((cu_k[1:] - cu_k[:-1]).max())
    out = torch.full_like(q, float("nan"))
    if block_table is not None:
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
    else:
        num_pages, page_size = 0, 0
        capacity = k_cache.shape[1] if cu_k is None else k_cache.shape[0]
    o_partial = lse_partial = None
    if num_splits > 1:
        o_partial = torch.full((num_splits, batch, nheads, seqlen_q, head_dim), float("nan"))
        lse_partial = torch.full((num_splits, batch, nheads, seqlen_q), float("nan"))
    args = [
        _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(out), _ptr(lse), q.stride(), k_cache.stride(), v_cache.stride(),
        out.stride(), *lse_strides, DTYPE_CODE[q.dtype], batch, nheads, nheads_k, head_dim, seqlen_q, seqlen_k,
        _ptr(cu_q), _ptr(cu_k), _ptr(cache_seqlens), seqlen_new, _ptr(leftpad), _ptr(batch_idx), _ptr(block_table),
        block_table.stride(0) if block_table is not None else 0, page_size, num_pages,
        k_cache.shape[0] if block_table is None and cu_k is None else 0, capacity,
        q.shape[0] if varlen else 0, k_cache.shape[0] if cu_k is not None else 0,
        1.0 / math.sqrt(head_dim), softcap, window[0], window[1], _ptr(alibi),
        alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0, num_splits, _ptr(o_partial),
        _ptr(lse_partial), 0, _ptr(errors),  # stream, errors (portattn/errors.py's buffer or none)
        *abi.kv_args(k_cache, k_descale, v_descale),
    ]
    module.decode(*args)
    return out, lse


def _sequence_keys(b, k_cache, v_cache, *, cache_seqlens=None, seqlen_new=0, leftpad=None, batch_idx=None,
                   block_table=None, cu_k=None, seqlen_k=0):
    """Sequence b's visible keys and values (n, Hk, D), gathered in Python from the layout."""
    if cu_k is not None:
        start, end = int(cu_k[b]), int(cu_k[b + 1])
        return k_cache[start:end], v_cache[start:end]
    if block_table is not None:
        page = k_cache.shape[1]
        capacity = block_table.shape[1] * page
    else:
        capacity = k_cache.shape[1]
    end = min(int(cache_seqlens[b]) + seqlen_new, capacity) if cache_seqlens is not None else min(seqlen_k, capacity)
    start = int(leftpad[b]) if leftpad is not None else 0
    positions = torch.arange(start, end)
    if block_table is not None:
        pages = block_table[b, positions // page].long()
        return k_cache[pages, positions % page], v_cache[pages, positions % page]
    row = int(batch_idx[b]) if batch_idx is not None else b
    return k_cache[row, positions], v_cache[row, positions]


def _check_decode(out, lse, q, k_cache, v_cache, *, cu_q=None, window=(-1, -1), softcap=0.0, alibi=None,
                  contained=(), k_descale=None, v_descale=None, **layout):
    """The error rule over all sequences: max|out - ref64| <= 2 max|torch lowp - ref64| + 1e-5.

    Sequences in `contained` (out-of-range metadata, Note [portattn decode errors]) must
    instead read as no keys: out = 0 and lse = -inf on all their rows. An e4m3 cache is
    compared as its dequantised values, cache * descale[b, hk] (float64 for the oracle, rounded
    to q's dtype for the baseline)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    batch = cu_q.numel() - 1 if cu_q is not None else q.shape[0]
    err = base = lse_err = lse_base = 0.0
    for b in range(batch):
        if cu_q is not None:
            start, end = int(cu_q[b]), int(cu_q[b + 1])
            qb, ob, lb = q[start:end][None], out[start:end][None], lse[:, start:end][None]
        else:
            qb, ob, lb = q[b:b + 1], out[b:b + 1], lse[b:b + 1]
        if b in contained:
            assert (ob == 0).all() and torch.isneginf(lb).all(), f"sequence {b} is not contained"
            continue
        kb, vb = (x[None] for x in _sequence_keys(b, k_cache, v_cache, **layout))
        if fp8:
            kb, vb = (x.double() * (1.0 if d is None else d[b].double()[:, None])
                      for x, d in ((kb, k_descale), (vb, v_descale)))
        slopes = alibi[b:b + 1] if alibi is not None and alibi.dim() == 2 else alibi
        options = dict(window=window, softcap=softcap, alibi_slopes=slopes)
        ref, ref_lse = naive_attention(qb, kb, vb, compute_dtype=torch.float64, **options)
        low, _ = naive_attention(qb, kb.to(q.dtype), vb.to(q.dtype), compute_dtype=q.dtype, **options)
        _, low_lse = naive_attention(qb.float(), kb.float(), vb.float(), compute_dtype=torch.float32, **options)
        assert not ob.isnan().any(), f"sequence {b}: out has NaN (unwritten or bad math)"
        assert not lb.isnan().any(), f"sequence {b}: lse has NaN (unwritten or bad math)"
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lb), empty), f"sequence {b}: lse = -inf on a different set of rows"
        assert (ob.transpose(1, 2)[empty] == 0).all(), f"sequence {b}: a row without keys is not 0"
        if ob.numel():
            err = max(err, (ob.double() - ref).abs().max().item())
            base = max(base, (low.double() - ref).abs().max().item())
        if (~empty).any():
            lse_err = max(lse_err, (lb.double() - ref_lse)[~empty].abs().max().item())
            lse_base = max(lse_base, (low_lse.double() - ref_lse)[~empty].abs().max().item())
    assert err <= 2 * base + 1e-5, f"out error {err:.3e} > 2 x torch {q.dtype} error {base:.3e}"
    assert lse_err <= 2 * lse_base + 1e-4, f"lse error {lse_err:.3e} vs fp32 naive {lse_base:.3e}"


def _decode_and_check(emulated, q, k_cache, v_cache, *, num_splits=1, contained=(), **options):
    check_options = {key: value for key, value in options.items() if key not in ("max_q", "errors")}
    out, lse = _decode_call(emulated, q, k_cache, v_cache, num_splits=num_splits, **options)
    _check_decode(out, lse, q, k_cache, v_cache, contained=contained, **check_options)
    return out, lse


@pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 64), (torch.bfloat16, 128)], ids=["fp16-64", "bf16-128"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_contiguous_cache_with_batch_idx_and_leftpad(emulated, dtype, head_dim, num_splits):
    # GQA 4, uneven lengths including an empty sequence, leftpad, and a batch index into a larger cache.
    k_cache = _rand(4, 200, 2, head_dim, dtype=dtype)
    v_cache = _rand(4, 200, 2, head_dim, dtype=dtype)
    q = _rand(3, 1, 8, head_dim, dtype=dtype)
    cache_seqlens = torch.tensor([0, 77, 200], dtype=torch.int32)
    leftpad = torch.tensor([0, 5, 30], dtype=torch.int32)
    batch_idx = torch.tensor([2, 0, 3], dtype=torch.int32)
    _decode_and_check(emulated, q, k_cache, v_cache, cache_seqlens=cache_seqlens, leftpad=leftpad,
                      batch_idx=batch_idx, num_splits=num_splits)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group", [1, 4], ids=lambda g: f"gqa{g}")
def test_decode_paged_cache_random_block_table(emulated, page_size, group):
    generator = torch.Generator().manual_seed(page_size + group)
    dtype, head_dim, nheads_k, batch = torch.bfloat16, 64, 2, 3
    lengths = [131, 0, 40]
    width = -(-max(lengths) // page_size)
    num_pages = batch * width + 3
    k_cache = _rand(num_pages, page_size, nheads_k, head_dim, dtype=dtype)
    v_cache = _rand(num_pages, page_size, nheads_k, head_dim, dtype=dtype)
    block_table = torch.randperm(num_pages, generator=generator)[:batch * width].reshape(batch, width).to(torch.int32)
    q = _rand(batch, 1, nheads_k * group, head_dim, dtype=dtype)
    _decode_and_check(emulated, q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                      block_table=block_table, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 12], ids=lambda s: f"splits{s}")
def test_decode_forced_splits(emulated, num_splits):
    # 150 keys are 3 stages of 64: 5 splits leave some empty, 12 are more than the stages.
    k_cache = _rand(2, 150, 1, 64, dtype=torch.float16)
    v_cache = _rand(2, 150, 1, 64, dtype=torch.float16)
    q = _rand(2, 1, 4, 64, dtype=torch.float16)
    cache_seqlens = torch.tensor([150, 61], dtype=torch.int32)
    _decode_and_check(emulated, q, k_cache, v_cache, cache_seqlens=cache_seqlens, num_splits=num_splits)


@pytest.mark.parametrize(
    "seqlen_q, window, softcap, alibi",
    [(3, (-1, 0), 0.0, False), (5, (40, 0), 2.0, True), (2, (20, 3), 0.0, True)],
    ids=["causal", "window-softcap-alibi", "window-alibi-two-sided"],
)
def test_decode_window_softcap_alibi(emulated, seqlen_q, window, softcap, alibi):
    # GQA 4: seqlen_q 5 packs 20 rows, two query tiles; causal is bottom-right aligned.
    dtype, head_dim = torch.bfloat16, 128
    k_cache = _rand(2, 180, 2, head_dim, dtype=dtype)
    v_cache = _rand(2, 180, 2, head_dim, dtype=dtype)
    q = _rand(2, seqlen_q, 8, head_dim, dtype=dtype)
    slopes = torch.rand(2, 8) if alibi else None
    _decode_and_check(emulated, q, k_cache, v_cache, cache_seqlens=torch.tensor([180, 97], dtype=torch.int32),
                      window=window, softcap=softcap, alibi=slopes, num_splits=2)


def test_decode_varlen_with_an_empty_key_sequence(emulated):
    lens_q, lens_k = [1, 2, 1], [100, 0, 130]
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = _rand(sum(lens_q), 4, 64, dtype=torch.float16)
    k = _rand(sum(lens_k), 2, 64, dtype=torch.float16)
    v = _rand(sum(lens_k), 2, 64, dtype=torch.float16)
    _decode_and_check(emulated, q, k, v, cu_q=cu_q, cu_k=cu_k, max_q=max(lens_q), window=(-1, 0), num_splits=2)


def test_decode_tile_reports_the_planner_facts(emulated):
    config = variants.CONFIGS[0]
    tile = emulated.decode_tile(40)  # served by the smallest configuration
    assert tile == {"stage_keys": config.decode.block, "threads": variants.DECODE_WAVES * 64,
                    "smem_bytes": config.decode.lds_bytes}
    assert emulated.decode_tile(variants.MAX_HEAD_DIM + 8) == {"stage_keys": -1, "threads": -1, "smem_bytes": -1}
    assert emulated.decode_tile(40, 1) == tile  # the e4m3-cache kernel has the same tile (decode_kernel.h)


def _rotate_reference(x, cos, sin, positions, rotary_dim, interleaved):
    """x (..., D) rotated at `positions` (same leading shape but D), fp32 math, then x's dtype."""
    x32 = x.float()
    c = cos[positions].float()
    s = sin[positions].float()
    rot, rest = x32[..., :rotary_dim], x32[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out, rest), dim=-1).to(x.dtype)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_append_with_rotary(emulated, interleaved, paged):
    """Keys at cache_seqlens[b] + i rotated there, values copied, queries rotated at cache_seqlens[b] (+ i)."""
    dtype, head_dim, rotary_dim, nheads, nheads_k, batch, seqlen_new = torch.float16, 64, 32, 4, 2, 2, 3
    capacity, page_size = 48, 16
    # The second runs past the capacity: contained (Note [portattn decode errors]), no row written.
    cache_seqlens = torch.tensor([5, 46], dtype=torch.int32)
    seqlen_ro = 64
    angles = torch.rand(seqlen_ro, rotary_dim // 2) * 6.0
    cos, sin = angles.cos(), angles.sin()  # float32 tables (rotary_dtype 2)
    k_new = _rand(batch, seqlen_new, nheads_k, head_dim, dtype=dtype)
    v_new = _rand(batch, seqlen_new, nheads_k, head_dim, dtype=dtype)
    q = _rand(batch, seqlen_new, nheads, head_dim, dtype=dtype)
    q_out = torch.full_like(q, float("nan"))
    width = capacity // page_size
    if paged:
        block_table = torch.randperm(batch * width + 1)[:batch * width].reshape(batch, width).to(torch.int32)
        k_cache = _rand(batch * width + 1, page_size, nheads_k, head_dim, dtype=dtype)
        batch_idx = None
    else:
        block_table = None
        k_cache = _rand(3, capacity, nheads_k, head_dim, dtype=dtype)
        batch_idx = torch.tensor([2, 0], dtype=torch.int32)
    v_cache = torch.randn_like(k_cache)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    for per_token in (False, True):
        errors = torch.zeros(8, dtype=torch.int32)  # portattn/errors.py's layout
        args = [
            _ptr(k_new), _ptr(v_new), k_new.stride(), v_new.stride(), _ptr(k_cache), _ptr(v_cache), k_cache.stride(),
            v_cache.stride(), _ptr(q), _ptr(q_out), q.stride(), q_out.stride(), DTYPE_CODE[dtype], batch, seqlen_new,
            seqlen_new, nheads, nheads_k, head_dim, _ptr(cache_seqlens), _ptr(batch_idx), _ptr(block_table),
            block_table.stride(0) if paged else 0, page_size if paged else 0, k_cache.shape[0] if paged else 0,
            k_cache.shape[0] if not paged else 0, capacity, _ptr(cos), _ptr(sin), cos.stride(0), 2, rotary_dim,
            seqlen_ro, interleaved, per_token, 0, _ptr(errors),  # stream, errors
            *abi.kv_args(k_cache, None, None),
        ]
        emulated.kvcache_append(*args)
        assert errors.tolist() == [2, 46, 0, 0, 0, 0, 0, 0]  # cache_seqlens[1] = 46 recorded
        for b in range(batch):
            positions = int(cache_seqlens[b]) + torch.arange(seqlen_new)
            q_positions = positions if per_token else torch.full((seqlen_new,), int(cache_seqlens[b]))
            q_ref = _rotate_reference(q[b], cos, sin, q_positions[:, None].expand(-1, nheads), rotary_dim, interleaved)
            torch.testing.assert_close(q_out[b], q_ref, atol=1e-3, rtol=1e-3)
            for i, pos in enumerate(positions.tolist()):
                if int(cache_seqlens[b]) + seqlen_new > capacity:
                    continue  # a sequence that does not fit writes no row
                k_ref = _rotate_reference(k_new[b, i], cos, sin, torch.full((nheads_k,), pos), rotary_dim, interleaved)
                if paged:
                    where = (int(block_table[b, pos // page_size]), pos % page_size)
                else:
                    where = (int(batch_idx[b]), pos)
                k_expected[where] = k_ref
                v_expected[where] = v_new[b, i]
        torch.testing.assert_close(k_cache, k_expected, atol=1e-3, rtol=1e-3)
        assert torch.equal(v_cache, v_expected)


def test_decode_after_append_reads_the_new_keys(emulated):
    """seqlen_new counts the appended keys: an append then a decode over the same cache."""
    dtype, head_dim, batch, nheads, nheads_k, seqlen_new = torch.bfloat16, 64, 2, 4, 1, 2
    k_cache = _rand(batch, 96, nheads_k, head_dim, dtype=dtype)
    v_cache = _rand(batch, 96, nheads_k, head_dim, dtype=dtype)
    cache_seqlens = torch.tensor([70, 0], dtype=torch.int32)
    k_new = _rand(batch, seqlen_new, nheads_k, head_dim, dtype=dtype)
    v_new = _rand(batch, seqlen_new, nheads_k, head_dim, dtype=dtype)
    q = _rand(batch, seqlen_new, nheads, head_dim, dtype=dtype)
    args = [
        _ptr(k_new), _ptr(v_new), k_new.stride(), v_new.stride(), _ptr(k_cache), _ptr(v_cache), k_cache.stride(),
        v_cache.stride(), 0, 0, q.stride(), q.stride(), DTYPE_CODE[dtype], batch, seqlen_new, seqlen_new, nheads,
        nheads_k, head_dim, _ptr(cache_seqlens), 0, 0, 0, 0, 0, batch, 96, 0, 0, 0, 2, 0, 0, False, False, 0, 0,
        *abi.kv_args(k_cache, None, None),
    ]
    emulated.kvcache_append(*args)
    _decode_and_check(emulated, q, k_cache, v_cache, cache_seqlens=cache_seqlens, seqlen_new=seqlen_new,
                      window=(-1, 0), num_splits=2)


# ---------------------------------------------------------------------------------------------
# FP8 (e4m3) caches (Note [portattn fp8 kv cache]; csrc/fp8.h): the decode reads raw e4m3 bytes,
# checked against the float64 oracle on the dequantised cache, cache * descale[b, hk].

FP8 = torch.float8_e4m3fn


def _fp8(*shape, generator):
    """Random e4m3 values over the format's range: magnitudes 2^-9 (subnormals) to 448, both signs."""
    x = torch.randn(*shape, generator=generator) * 10.0 ** (torch.rand(*shape, generator=generator) * 5.0 - 3.0)
    return x.clamp(-448.0, 448.0).to(FP8)


def _descales(batch, nheads_k, generator):
    return torch.rand(batch, nheads_k, generator=generator) * 1.5 + 0.25


def _fp8_contiguous(module, dtype, head_dim, num_splits, seed):
    # GQA 4, an empty sequence, leftpad and a batch index into a larger cache (4 stages of 64 keys);
    # K's magnitudes are kept below 8 so the scores do not all saturate the softmax.
    generator = torch.Generator().manual_seed(seed)
    k_cache = (_fp8(4, 200, 2, head_dim, generator=generator).float() / 56.0).to(FP8)
    v_cache = _fp8(4, 200, 2, head_dim, generator=generator)
    q = _rand(3, 1, 8, head_dim, dtype=dtype)
    _decode_and_check(module, q, k_cache, v_cache, cache_seqlens=torch.tensor([0, 77, 200], dtype=torch.int32),
                      leftpad=torch.tensor([0, 5, 30], dtype=torch.int32),
                      batch_idx=torch.tensor([2, 0, 3], dtype=torch.int32), num_splits=num_splits,
                      k_descale=_descales(3, 2, generator), v_descale=_descales(3, 2, generator))


def _fp8_paged(module, dtype, head_dim, num_splits, seed):
    # Page size 16 (a stage spans four pages), a shuffled block table, GQA 4 with seqlen_q 3
    # (12 packed rows), a causal window, no descale for V (1.0).
    generator = torch.Generator().manual_seed(seed)
    nheads_k, batch, page_size, lengths = 2, 2, 16, [131, 40]
    width = -(-max(lengths) // page_size)
    num_pages = batch * width + 3
    k_cache = (_fp8(num_pages, page_size, nheads_k, head_dim, generator=generator).float() / 56.0).to(FP8)
    v_cache = _fp8(num_pages, page_size, nheads_k, head_dim, generator=generator)
    block_table = torch.randperm(num_pages, generator=generator)[:batch * width].reshape(batch, width).to(torch.int32)
    q = _rand(batch, 3, nheads_k * 4, head_dim, dtype=dtype)
    _decode_and_check(module, q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                      block_table=block_table, window=(-1, 0), num_splits=num_splits,
                      k_descale=_descales(batch, nheads_k, generator))


@pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 64), (torch.bfloat16, 128), (torch.float16, 256)],
                         ids=["fp16-64", "bf16-128", "fp16-256"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_fp8_contiguous_cache_gqa(emulated, dtype, head_dim, num_splits):
    _fp8_contiguous(emulated, dtype, head_dim, num_splits, seed=head_dim + num_splits)


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 64), (torch.float16, 128), (torch.bfloat16, 256)],
                         ids=["bf16-64", "fp16-128", "bf16-256"])
def test_decode_fp8_paged_cache_page16_gqa_splits(emulated, dtype, head_dim):
    _fp8_paged(emulated, dtype, head_dim, 2, seed=head_dim)


def _append_fp8(module, dtype, head_dim, paged):
    """kvcache_append into an e4m3 cache: the bytes portattn/kvcache.py's quantize_fp8 writes (the
    rotated key rounded to q's dtype, divided by its descale, RNE, saturated to +-448; one value past
    448 and one NaN included); returns (q, k_cache, v_cache, cache_seqlens, descales) for a decode."""
    from portattn.kvcache import quantize_fp8

    generator = torch.Generator().manual_seed(head_dim)
    batch, seqlen_new, nheads, nheads_k, rotary_dim, page_size, capacity = 2, 3, 4, 2, 32, 16, 96
    cache_seqlens = torch.tensor([70, 0], dtype=torch.int32)
    k_new = (torch.randn(batch, seqlen_new, nheads_k, head_dim, generator=generator)).to(dtype)
    v_new = (torch.randn(batch, seqlen_new, nheads_k, head_dim, generator=generator) * 30.0).to(dtype)
    v_new[0, 0, 0, :2] = torch.tensor([1e4, float("nan")], dtype=dtype)
    q = _rand(batch, seqlen_new, nheads, head_dim, dtype=dtype)
    k_descale, v_descale = _descales(batch, nheads_k, generator), _descales(batch, nheads_k, generator)
    angles = torch.rand(128, rotary_dim // 2, generator=generator) * 6.0
    cos, sin = angles.cos(), angles.sin()
    width = capacity // page_size
    if paged:
        block_table = torch.randperm(batch * width, generator=generator).reshape(batch, width).to(torch.int32)
        k_cache = _fp8(batch * width, page_size, nheads_k, head_dim, generator=generator)
    else:
        block_table = None
        k_cache = _fp8(batch, capacity, nheads_k, head_dim, generator=generator)
    k_cache = (k_cache.float() / 56.0).to(FP8)
    v_cache = _fp8(*k_cache.shape, generator=generator)
    k_expected, v_expected = k_cache.view(torch.uint8).clone(), v_cache.view(torch.uint8).clone()
    args = [
        _ptr(k_new), _ptr(v_new), k_new.stride(), v_new.stride(), _ptr(k_cache), _ptr(v_cache), k_cache.stride(),
        v_cache.stride(), 0, 0, q.stride(), q.stride(), DTYPE_CODE[dtype], batch, seqlen_new, seqlen_new, nheads,
        nheads_k, head_dim, _ptr(cache_seqlens), 0, _ptr(block_table), block_table.stride(0) if paged else 0,
        page_size if paged else 0, k_cache.shape[0] if paged else 0, 0 if paged else batch, capacity,
        _ptr(cos), _ptr(sin), cos.stride(0), 2, rotary_dim, 128, False, False, 0, 0,  # NeoX rotary, stream, errors
        *abi.kv_args(k_cache, k_descale, v_descale),
    ]
    module.kvcache_append(*args)
    for b in range(batch):
        positions = int(cache_seqlens[b]) + torch.arange(seqlen_new)
        k_rot = _rotate_reference(k_new[b], cos, sin, positions[:, None].expand(-1, nheads_k), rotary_dim, False)
        k_bytes = quantize_fp8(k_rot.to(dtype)[None], k_descale[b:b + 1]).view(torch.uint8)[0]
        v_bytes = quantize_fp8(v_new[b:b + 1], v_descale[b:b + 1]).view(torch.uint8)[0]
        for i, pos in enumerate(positions.tolist()):
            where = (int(block_table[b, pos // page_size]), pos % page_size) if paged else (b, pos)
            k_expected[where], v_expected[where] = k_bytes[i], v_bytes[i]
    # The rotation's float32 math may differ from the reference's in the last bit of q's dtype:
    # a key byte may then be one e4m3 step off; values are copied, so theirs are exact.
    assert torch.equal(v_cache.view(torch.uint8), v_expected)
    assert v_expected[0 if not paged else int(block_table[0, 70 // page_size]),
                      70 % page_size if paged else 70, 0, :2].tolist() == [0x7e, 0x7f]
    k_steps = (k_cache.view(torch.uint8).int() - k_expected.int()).abs()
    assert int(k_steps.max()) <= 1 and int((k_steps > 0).sum()) <= k_steps.numel() // 1000
    return q, k_cache, v_cache, cache_seqlens, (k_descale, v_descale), block_table


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_append_fp8_then_decode(emulated, paged):
    """The append's bytes, then a decode over the cache it wrote (seqlen_new keys included, 2 splits)."""
    q, k_cache, v_cache, cache_seqlens, (k_descale, v_descale), block_table = _append_fp8(
        emulated, torch.bfloat16, 128, paged)
    q = q[:, :1].contiguous()
    v_cache.view(torch.uint8)[v_cache.view(torch.uint8) == 0x7f] = 0x7e  # the oracle reads NaN, the kernel 480
    _decode_and_check(emulated, q, k_cache, v_cache, cache_seqlens=cache_seqlens, seqlen_new=3, num_splits=2,
                      block_table=block_table, k_descale=k_descale, v_descale=v_descale)


# ---------------------------------------------------------------------------------------------
# RDNA decode (csrc/wmma_decode_kernel.h) in both WMMA layouts: the same entry points and
# oracle as the CDNA decode above, on a few shapes (each workgroup is 128 CPU threads).


@pytest.fixture(scope="module", params=["emu_gfx11", "emu_gfx12"])
def rdna(request, tmp_path_factory):
    """The emulated RDNA3 (gfx11 WMMA) or RDNA4 (gfx12 WMMA) `_C` module."""
    return load_emulation(tmp_path_factory, request.param)


def _decode_contiguous_cache_gqa(module, dtype, head_dim, num_splits):
    # GQA 4 (8 packed rows), an empty sequence, leftpad and a batch index into a larger cache;
    # 200 keys are 4 stages of 64.
    k_cache = _rand(4, 200, 2, head_dim, dtype=dtype)
    v_cache = _rand(4, 200, 2, head_dim, dtype=dtype)
    q = _rand(3, 1, 8, head_dim, dtype=dtype)
    _decode_and_check(module, q, k_cache, v_cache, cache_seqlens=torch.tensor([0, 77, 200], dtype=torch.int32),
                      leftpad=torch.tensor([0, 5, 30], dtype=torch.int32),
                      batch_idx=torch.tensor([2, 0, 3], dtype=torch.int32), num_splits=num_splits)


def _decode_paged_cache_page16_gqa_window(module, seed, head_dim):
    # Page size 16 (a stage spans four pages), a shuffled block table, GQA 4 with seqlen_q 5
    # (20 packed rows: two query tiles), a causal window with softcap and ALiBi, 2 splits.
    generator = torch.Generator().manual_seed(seed)
    dtype, nheads_k, batch, page_size = torch.bfloat16, 2, 2, 16
    lengths = [131, 40]
    width = -(-max(lengths) // page_size)
    num_pages = batch * width + 3
    k_cache = _rand(num_pages, page_size, nheads_k, head_dim, dtype=dtype)
    v_cache = _rand(num_pages, page_size, nheads_k, head_dim, dtype=dtype)
    block_table = torch.randperm(num_pages, generator=generator)[:batch * width].reshape(batch, width).to(torch.int32)
    q = _rand(batch, 5, nheads_k * 4, head_dim, dtype=dtype)
    _decode_and_check(module, q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                      block_table=block_table, window=(40, 0), softcap=2.0, alibi=torch.rand(batch, 8),
                      num_splits=2)


@pytest.mark.parametrize("dtype, head_dim, num_splits", [(torch.float16, 64, 3), (torch.bfloat16, 256, 2)],
                         ids=["fp16-64-splits3", "bf16-256-splits2"])
def test_rdna_decode_contiguous_cache_gqa(rdna, dtype, head_dim, num_splits):
    # D = 256 splits O's columns over two workgroups.
    _decode_contiguous_cache_gqa(rdna, dtype, head_dim, num_splits)


def test_rdna_decode_paged_cache_page16_gqa_window(rdna):
    _decode_paged_cache_page16_gqa_window(rdna, 16, 128)


def test_rdna_decode_tile_reports_the_wave32_tile(rdna):
    """The split planner's facts for the RDNA tile: 64-key stages, 4 waves of 32, its own LDS."""
    arch = rdna.build_config()["archs"][0]
    config = variants.configs_for(arch)[0]
    assert rdna.decode_tile(40) == {"stage_keys": 64, "threads": variants.DECODE_WAVES * 32,
                                    "smem_bytes": config.decode.lds_bytes}


def test_rdna_decode_varlen(rdna):
    lens_q, lens_k = [1, 2, 1], [100, 0, 130]
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = _rand(sum(lens_q), 4, 64, dtype=torch.float16)
    k = _rand(sum(lens_k), 2, 64, dtype=torch.float16)
    v = _rand(sum(lens_k), 2, 64, dtype=torch.float16)
    _decode_and_check(rdna, q, k, v, cu_q=cu_q, cu_k=cu_k, max_q=max(lens_q), window=(-1, 0), num_splits=1)


@pytest.mark.parametrize("dtype, head_dim, num_splits", [(torch.float16, 64, 1), (torch.bfloat16, 256, 3)],
                         ids=["fp16-64", "bf16-256-splits3"])
def test_rdna_decode_fp8_contiguous_cache_gqa(rdna, dtype, head_dim, num_splits):
    _fp8_contiguous(rdna, dtype, head_dim, num_splits, seed=head_dim)


def test_rdna_decode_fp8_paged_cache_page16_gqa_splits(rdna):
    _fp8_paged(rdna, torch.bfloat16, 128, 2, seed=7)


def test_rdna_kvcache_append_fp8_then_decode(rdna):
    q, k_cache, v_cache, cache_seqlens, (k_descale, v_descale), block_table = _append_fp8(
        rdna, torch.bfloat16, 128, True)
    v_cache.view(torch.uint8)[v_cache.view(torch.uint8) == 0x7f] = 0x7e
    _decode_and_check(rdna, q[:, :1].contiguous(), k_cache, v_cache, cache_seqlens=cache_seqlens, seqlen_new=3,
                      num_splits=2, block_table=block_table, k_descale=k_descale, v_descale=v_descale)


# ---------------------------------------------------------------------------------------------
# RDNA backward (csrc/wmma_bwd_kernel.h) in both WMMA layouts, through RocmBackend as the CDNA
# backward above: the instantiations of EMU_RDNA_BWD, D = 256 included (2-wave workgroups,
# dQ split over 2 workgroups and dK/dV over 4).


@pytest.fixture(scope="module", params=["emu_gfx11", "emu_gfx12"])
def rdna_backend(request, tmp_path_factory):
    """The emulated RDNA3 (gfx11 WMMA) or RDNA4 (gfx12 WMMA) kernels behind RocmBackend."""
    yield from _backend_of(load_emulation(tmp_path_factory, request.param))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, head_dim, seqlens", [(torch.float16, 40, (150, 70)), (torch.bfloat16, 128, (70, 113)),
                                                      (torch.bfloat16, 256, (40, 45))],
                         ids=["fp16-40-150x70", "bf16-128-70x113", "bf16-256-40x45"])
def test_rdna_backward_matches_oracle(rdna_backend, dtype, head_dim, seqlens, causal):
    q, k, v = _qkv(*seqlens, head_dim, dtype)
    _run_backward(rdna_backend, q, k, v, window=(-1, 0 if causal else -1), naive_options=dict(causal=causal))


@pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 64), (torch.bfloat16, 256)], ids=["fp16-64", "bf16-256"])
def test_rdna_backward_window_alibi_softcap_gqa(rdna_backend, dtype, head_dim):
    # GQA 2 (the dK/dV kernel sums both query heads of a KV head), a two-sided window; fewer
    # rows at D = 256, whose 2-wave workgroups and 4 dK/dV slices cost the emulation most.
    seqlen_q, seqlen_k = (90, 77) if head_dim <= 128 else (50, 45)
    q = _rand(1, seqlen_q, 4, head_dim, dtype=dtype)
    k = _rand(1, seqlen_k, 2, head_dim, dtype=dtype)
    v = _rand(1, seqlen_k, 2, head_dim, dtype=dtype)
    slopes = torch.rand(1, 4)
    _run_backward(rdna_backend, q, k, v, window=(20, 3), softcap=2.0, alibi=slopes,
                  naive_options=dict(window=(20, 3), softcap=2.0, alibi_slopes=slopes))


def test_rdna_backward_varlen_causal_gqa_with_empty_sequences(rdna_backend):
    lens_q, lens_k = [17, 70, 1, 0], [100, 33, 0, 9]
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = _rand(sum(lens_q), 4, 64, dtype=torch.float16)
    k = _rand(sum(lens_k), 1, 64, dtype=torch.float16)
    v = _rand(sum(lens_k), 1, 64, dtype=torch.float16)
    _run_backward(rdna_backend, q, k, v, window=(-1, 0), cu_q=cu_q, cu_k=cu_k, max_q=max(lens_q),
                  max_k=max(lens_k), naive_options=dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))


def test_rdna_backward_dropout_matches_reference_mask(rdna_backend):
    q, k, v, run, oracle = _dropout_problem(True, 0.17, 424242, (7 << 32) + 9)
    _run_backward(rdna_backend, q, k, v, naive_options=oracle, **run)


@pytest.fixture(scope="module", params=[arch for arch in EMU_ARCHS if arch not in variants.CDNA4_ARCHS])
def decode_family(request, tmp_path_factory):
    """Each family's decode module: CDNA (MFMA), RDNA3 (gfx11 WMMA), RDNA4 (gfx12 WMMA)."""
    return load_emulation(tmp_path_factory, request.param)


@pytest.mark.parametrize("num_splits", [1, 2], ids=["one_split", "two_splits"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_contains_out_of_range_metadata(decode_family, paged, num_splits):
    """A cache_seqlens past the capacity (and, paged, a page number past the pool) empties its
    sequence: out = 0, lse = -inf, the other sequences exact, the first offender recorded. With
    two splits the bad page lies in one split's keys only: the combine must empty the row."""
    dtype, head_dim, nheads_k, page_size, capacity = torch.float16, 64, 1, 16, 96
    # sequence 2 spans two 64-key stages, one per split, its bad page (below) in the first
    cache_seqlens = torch.tensor([70, capacity + 1, 90], dtype=torch.int32)
    errors = torch.zeros(8, dtype=torch.int32)  # portattn/errors.py's layout
    q = _rand(3, 1, 4, head_dim, dtype=dtype)
    if paged:
        width = capacity // page_size
        num_pages = 3 * width
        k_cache = _rand(num_pages, page_size, nheads_k, head_dim, dtype=dtype)
        v_cache = _rand(num_pages, page_size, nheads_k, head_dim, dtype=dtype)
        block_table = torch.randperm(num_pages).reshape(3, width).to(torch.int32)
        block_table[2, 1] = num_pages + 7  # keys 16-31 of sequence 2
        layout = dict(block_table=block_table)
        contained, expected = (1, 2), [2, capacity + 1, 0, 0, 0, 0, 3, num_pages + 7]
    else:
        k_cache = _rand(3, capacity, nheads_k, head_dim, dtype=dtype)
        v_cache = _rand(3, capacity, nheads_k, head_dim, dtype=dtype)
        layout = {}
        contained, expected = (1,), [2, capacity + 1, 0, 0, 0, 0, 0, 0]
    _decode_and_check(decode_family, q, k_cache, v_cache, cache_seqlens=cache_seqlens, errors=errors,
                      num_splits=num_splits, contained=contained, **layout)
    assert errors.tolist() == expected


# ---------------------------------------------------------------------------------------------
# CDNA4 (gfx950): the CDNA kernels with the double-depth MFMAs (32x32x16, 16x16x32) in the
# emulated ISA layout, on the instantiations of EMU_CDNA4 (fp16 runs on the D = 128 tile only).


@pytest.fixture(scope="module")
def cdna4(tmp_path_factory):
    """The emulated gfx950 `_C` module."""
    return load_emulation(tmp_path_factory, "emu_gfx950")


@pytest.fixture(scope="module")
def cdna4_backend(cdna4):
    yield from _backend_of(cdna4)


CDNA4_SHAPES = [(torch.bfloat16, 40), (torch.float16, 128), (torch.bfloat16, 256)]
CDNA4_IDS = ["bf16-40", "fp16-128", "bf16-256"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, head_dim", CDNA4_SHAPES, ids=CDNA4_IDS)
def test_cdna4_forward_matches_oracle(cdna4_backend, dtype, head_dim, causal):
    q, k, v = _qkv(130, 70, head_dim, dtype)
    out, lse = _run(cdna4_backend, q, k, v, window=(-1, 0 if causal else -1))
    _check(out, lse, q, k, v, causal=causal)


def test_cdna4_forward_window_alibi_softcap_gqa(cdna4_backend):
    q = _rand(2, 150, 4, 64, dtype=torch.bfloat16)
    k = _rand(2, 97, 2, 64, dtype=torch.bfloat16)
    v = _rand(2, 97, 2, 64, dtype=torch.bfloat16)
    slopes = torch.rand(2, 4)
    out, lse = _run(cdna4_backend, q, k, v, window=(20, 3), softcap=2.0, alibi=slopes)
    _check(out, lse, q, k, v, window=(20, 3), softcap=2.0, alibi_slopes=slopes)


def test_cdna4_forward_dropout_matches_reference_mask(cdna4_backend):
    q, k, v, run, oracle = _dropout_problem(True, 0.17, 31337, (2 << 32) + 3)
    out, lse = _run(cdna4_backend, q, k, v, **run)
    _check(out, lse, q, k, v, **oracle)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, head_dim, seqlens", [(torch.bfloat16, 40, (17, 113)), (torch.float16, 128, (150, 40)),
                                                      (torch.bfloat16, 256, (40, 45))],
                         ids=["bf16-40-17x113", "fp16-128-150x40", "bf16-256-40x45"])
def test_cdna4_backward_matches_oracle(cdna4_backend, dtype, head_dim, seqlens, causal):
    q, k, v = _qkv(*seqlens, head_dim, dtype)
    _run_backward(cdna4_backend, q, k, v, window=(-1, 0 if causal else -1), naive_options=dict(causal=causal))


def test_cdna4_backward_window_alibi_softcap_gqa_dropout(cdna4_backend):
    q = _rand(1, 90, 4, 64, dtype=torch.bfloat16)
    k = _rand(1, 77, 2, 64, dtype=torch.bfloat16)
    v = _rand(1, 77, 2, 64, dtype=torch.bfloat16)
    slopes = torch.rand(1, 4)
    _run_backward(cdna4_backend, q, k, v, window=(20, 3), softcap=2.0, alibi=slopes,
                  naive_options=dict(window=(20, 3), softcap=2.0, alibi_slopes=slopes))
    q, k, v, run, oracle = _dropout_problem(True, 0.17, 271828, (4 << 32) + 1)
    _run_backward(cdna4_backend, q, k, v, naive_options=oracle, **run)


@pytest.mark.parametrize("dtype, head_dim, num_splits", [(torch.float16, 128, 3), (torch.bfloat16, 256, 2)],
                         ids=["fp16-128-splits3", "bf16-256-splits2"])
def test_cdna4_decode_contiguous_cache_gqa(cdna4, dtype, head_dim, num_splits):
    _decode_contiguous_cache_gqa(cdna4, dtype, head_dim, num_splits)


def test_cdna4_decode_paged_cache_page16_gqa_window(cdna4):
    _decode_paged_cache_page16_gqa_window(cdna4, 950, 64)


@pytest.mark.parametrize("dtype, head_dim, num_splits", [(torch.float16, 128, 3), (torch.bfloat16, 256, 2)],
                         ids=["fp16-128-splits3", "bf16-256-splits2"])
def test_cdna4_decode_fp8_contiguous_cache_gqa(cdna4, dtype, head_dim, num_splits):
    """e4m3 caches on gfx950: a widened 16-byte K chunk is one double-depth operand."""
    _fp8_contiguous(cdna4, dtype, head_dim, num_splits, seed=950 + head_dim)


def test_cdna4_decode_fp8_paged_cache_page16_gqa_splits(cdna4):
    _fp8_paged(cdna4, torch.bfloat16, 256, 2, seed=950)
