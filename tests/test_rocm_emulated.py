"""The ROCm forward kernels' logic, run on the CPU through tests/rocm_emulation/hip_emu.h.

No AMD GPU is reachable. This builds the real fwd_kernel.h, the generated
variant sources and module.cpp for a pseudo-arch "emu" with clang++-19 as
host C++ (one thread per lane, MFMA and cross-lane ops emulated with the
layout of Note [portattn MFMA layout]) and drives it through RocmBackend,
checking every declared forward feature with the project's error rule (tests/error_rule.py).
It cannot validate the MFMA layout against hardware or the device compiler's
code generation (tests/test_rocm_isa.py checks the latter statically; the
first-use self-check covers the rest on a real device).
"""
from __future__ import annotations

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROCM_DIR = os.path.join(ROOT, "portattn", "backends", "rocm")
EMU_HEADER = os.path.join(ROOT, "tests", "rocm_emulation", "hip_emu.h")
HOST_CLANG = "clang++-19"  # _Float16 and ext_vector_type on the host need clang


def build_emulation(build_dir: str) -> str:
    """Compiles every forward variant for the "emu" pseudo-arch; returns the module path."""
    ninja_build = rocm_build.ninja_build
    csrc = os.path.join(ROCM_DIR, "csrc")
    chosen = variants.select(["emu"])
    gen = os.path.join(build_dir, "gen")
    os.makedirs(gen, exist_ok=True)
    flags = [HOST_CLANG, "-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden", "-Wno-unknown-attributes",
             "-Wno-ignored-attributes", f'-DPORTATTN_ROCM_EMULATE="{EMU_HEADER}"', f"-I{csrc}",
             f"-I{sysconfig.get_paths()['include']}", f"-I{rocm_build._pybind11_include()}"]
    sources = [rocm_build._write_if_changed(os.path.join(gen, v.stem(direction) + ".cpp"),
                                            variants.instantiation_source(v, direction))
               for v in chosen for direction in variants.DIRECTIONS]
    sources.append(rocm_build._write_if_changed(
        os.path.join(gen, "registry.cpp"), variants.registry_source(chosen, {"emu": "CPU emulation"})))
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


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    if shutil.which(HOST_CLANG) is None:
        pytest.skip(f"{HOST_CLANG} not found (run .ci/install_rocm_toolchain.sh)")
    build_dir = os.environ.get("PORTATTN_ROCM_EMU_BUILD_DIR") or str(tmp_path_factory.mktemp("rocm_emu"))
    ext_path = build_emulation(build_dir)
    spec = importlib.util.spec_from_file_location("portattn_rocm_emu._C", ext_path)
    emulated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulated)

    import portattn.backends as backends
    import portattn.backends.rocm as rocm

    # The module and the stream getter (CPU torch has none) wherever the wrapper looks them up.
    no_stream = lambda index: 0  # noqa: E731
    patches = [(rocm, "_C", emulated)]
    for owner, name in ((rocm, "_raw_stream"), (getattr(backends, "abi", None), "raw_stream")):
        if owner is not None and hasattr(owner, name):
            patches.append((owner, name, no_stream))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    yield rocm.RocmBackend()
    for owner, name, value in saved:
        setattr(owner, name, value)


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
def test_forward_matches_oracle(backend, dtype, head_dim, seqlens, causal):
    q, k, v = _qkv(*seqlens, head_dim, dtype)
    out, lse = _run(backend, q, k, v, window=(-1, 0 if causal else -1))
    _check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_window_alibi_softcap_gqa(backend, head_dim):
    dtype = torch.bfloat16
    q = _rand(2, 150, 4, head_dim, dtype=dtype)
    k = _rand(2, 97, 2, head_dim, dtype=dtype)
    v = _rand(2, 97, 2, head_dim, dtype=dtype)
    slopes = torch.rand(2, 4)
    out, lse = _run(backend, q, k, v, window=(20, 3), softcap=2.0, alibi=slopes)
    _check(out, lse, q, k, v, window=(20, 3), softcap=2.0, alibi_slopes=slopes)


def test_rows_without_visible_keys_are_zero_with_minus_inf_lse(backend):
    q = _rand(1, 90, 2, 64, dtype=torch.float16)
    k = _rand(1, 40, 2, 64, dtype=torch.float16)
    v = _rand(1, 40, 2, 64, dtype=torch.float16)
    out, lse = _run(backend, q, k, v, window=(-1, 0))
    assert torch.isinf(lse[:, :, :50]).all() and (out[:, :50] == 0).all()
    _check(out, lse, q, k, v, causal=True)


def test_strided_views_from_packed_qkv(backend):
    qkv = _rand(2, 77, 3, 3, 64, dtype=torch.float16)
    q, k, v = qkv.unbind(dim=2)
    out, lse = _run(backend, q, k, v)
    _check(out, lse, q, k, v)


def _varlen(lens_q, lens_k, heads, head_dim, dtype):
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = _rand(sum(lens_q), heads, head_dim, dtype=dtype)
    k = _rand(sum(lens_k), heads, head_dim, dtype=dtype)
    v = _rand(sum(lens_k), heads, head_dim, dtype=dtype)
    return q, k, v, cu_q, cu_k


def test_varlen_causal(backend):
    lens_q, lens_k = [17, 140, 1, 5], [200, 64, 33, 0]
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k, 2, 64, torch.float16)
    out, lse = _run(backend, q, k, v, window=(-1, 0), cu_q=cu_q, cu_k=cu_k,
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
def test_dropout_matches_reference_mask(backend, varlen):
    q, k, v, run, oracle = _dropout_problem(varlen, 0.17, 1234567, (5 << 32) + 77)
    out, lse = _run(backend, q, k, v, **run)
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
