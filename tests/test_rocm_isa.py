"""ROCm backend, statically: the device assembly of every kernel for every built arch
(gfx90a, gfx942, gfx950: MFMA; gfx1100, gfx1201: WMMA).

No AMD GPU is reachable, so nothing here runs a kernel. What the compiler
produced is checked against each tile's designed budget (variants.FWD_TILES,
the numbers fwd_kernel.h's docblock states): MFMA instructions of the right
dtype and shape (32x32x8; 16x16x16 in the decode kernel; on gfx950 the double-depth
32x32x16 and 16x16x32; wave32 WMMA 16x16x16 on RDNA) present, no VGPR/SGPR spills,
no scratch, LDS as designed and within the CU's (64 KiB; 160 KiB on gfx950),
and VGPR(+AGPR) few enough for the designed waves per SIMD.

The build needs the toolchain from .ci/install_rocm_toolchain.sh (skips
without it). PORTATTN_ROCM_BUILD_DIR names a build folder to create or reuse
(ninja rebuilds only what changed); otherwise a temporary one is used.
Also on CPU: the backend reports itself unavailable with a reason, and the
module's implemented features equal the support declaration.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROCM_DIR = os.path.join(ROOT, "portattn", "backends", "rocm")
ISA_ARCHS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201")


def _load(name: str, path: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


rocm_build = _load("portattn_rocm_build", os.path.join(ROCM_DIR, "build.py"))
variants = rocm_build.variants

MFMA_MNEMONICS = {  # (arch family, dtype, KernelTile.mfma_shape) -> the instruction
    ("gfx90a", "float16", "32x32x8"): "v_mfma_f32_32x32x8f16",
    ("gfx90a", "bfloat16", "32x32x8"): "v_mfma_f32_32x32x8bf16_1k",
    ("gfx94", "float16", "32x32x8"): "v_mfma_f32_32x32x8_f16",
    ("gfx94", "bfloat16", "32x32x8"): "v_mfma_f32_32x32x8_bf16",
    ("gfx90a", "float16", "16x16x16"): "v_mfma_f32_16x16x16f16",
    ("gfx90a", "bfloat16", "16x16x16"): "v_mfma_f32_16x16x16bf16_1k",
    ("gfx94", "float16", "16x16x16"): "v_mfma_f32_16x16x16_f16",
    ("gfx94", "bfloat16", "16x16x16"): "v_mfma_f32_16x16x16_bf16",
    # CDNA4 (gfx950) only: the double-depth shapes (Note [portattn MFMA double depth] in csrc/cdna.h)
    ("gfx94", "float16", "32x32x16"): "v_mfma_f32_32x32x16_f16",
    ("gfx94", "bfloat16", "32x32x16"): "v_mfma_f32_32x32x16_bf16",
    ("gfx94", "float16", "16x16x32"): "v_mfma_f32_16x16x32_f16",
    ("gfx94", "bfloat16", "16x16x32"): "v_mfma_f32_16x16x32_bf16",
    ("wmma", "float16", "16x16x16"): "v_wmma_f32_16x16x16_f16",
    ("wmma", "bfloat16", "16x16x16"): "v_wmma_f32_16x16x16_bf16",
}


def _mfma_mnemonic(arch: str, dtype: str, shape: str = "32x32x8") -> str:
    # gfx950 keeps gfx94x's mnemonics of the shallow shapes and adds the double-depth ones.
    if variants.isa_of(arch).startswith("wmma"):
        family = "wmma"
    else:
        family = "gfx94" if variants.amd_at_least(arch, "gfx940") else arch
    return MFMA_MNEMONICS[(family, dtype, shape)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(build folder, extension path) of a build of every variant for every ISA_ARCHS arch."""
    tools = rocm_build.find_toolchain()
    if tools is None or not all(tools.can_compile(arch) for arch in ISA_ARCHS):
        pytest.skip(f"no HIP toolchain for {', '.join(ISA_ARCHS)} (run .ci/install_rocm_toolchain.sh)")
    build_dir = os.environ.get("PORTATTN_ROCM_BUILD_DIR") or str(tmp_path_factory.mktemp("rocm_build"))
    ext_path = os.path.join(build_dir, "ext", "_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    env = dict(os.environ)
    env["PORTATTN_HIP_ARCHS"] = ";".join(ISA_ARCHS)
    for restriction in ("PORTATTN_HEADDIMS", "PORTATTN_DTYPES"):
        env.pop(restriction, None)  # the check covers every variant
    rocm_build.build(ext_path, build_dir, env)
    return build_dir, ext_path


def parse_kernel_metadata(assembly: str) -> dict:
    """{kernel symbol: {".vgpr_count": int, ...}} from a .s file's amdhsa.kernels metadata."""
    block = assembly.split(".amdgpu_metadata", 1)[1].split(".end_amdgpu_metadata", 1)[0]
    kernels, current = {}, None
    for line in block.splitlines():
        entry = re.match(r"^  - (\.\w+):\s*(.*)$", line)
        field = re.match(r"^    (\.\w+):\s*(.*)$", line)
        if entry:
            current = {}
            key, value = entry.groups()
        elif field and current is not None:
            key, value = field.groups()
        else:
            continue
        current[key] = int(value) if re.fullmatch(r"-?\d+", value.strip()) else value.strip()
        if key == ".name":
            kernels[value.strip()] = current
    return kernels


def kernel_body(assembly: str, symbol: str) -> str:
    start = assembly.index(f"\n{symbol}:")
    return assembly[start:assembly.index(".Lfunc_end", start)]


def designed_waves(total_registers: int, tile=None) -> int:
    """Waves per SIMD the register file allows at this per-lane count (CDNA: unified
    VGPR+AGPR; RDNA wave32: VGPRs only)."""
    if tile is not None and tile.wmma:
        granule = variants.RDNA_REGISTER_GRANULE
        allocated = -(-max(total_registers, 1) // granule) * granule
        return min(16, variants.RDNA_REGISTERS_PER_SIMD_LANE // allocated)
    granule = variants.REGISTER_GRANULE
    allocated = -(-max(total_registers, 1) // granule) * granule
    return min(8, variants.REGISTERS_PER_SIMD_LANE // allocated)


def kernel_tile(variant, symbol: str):
    """The KernelTile (budget) of a kernel symbol of `variant`, by its template name."""
    for tile in variant.config.kernels:
        name = f"{tile.kernel}_kernel"
        if f"{len(name)}{name}" in symbol:  # Itanium mangling: <length><identifier>
            return tile
    raise AssertionError(f"kernel {symbol} is not in the variant table")


def resource_reports(build_dir: str, variant, direction: str) -> list:
    """[(KernelTile, resources)] for every kernel of one instantiation's device assembly."""
    path = rocm_build.device_assembly(build_dir)[(variant.arch, variant.stem(direction))]
    with open(path) as handle:
        assembly = handle.read()
    reports = []
    for symbol, meta in parse_kernel_metadata(assembly).items():
        body = kernel_body(assembly, symbol)
        reports.append((kernel_tile(variant, symbol), {
            "vgpr": meta[".vgpr_count"], "agpr": meta.get(".agpr_count", 0), "sgpr": meta[".sgpr_count"],
            "wave": meta[".wavefront_size"],
            "vgpr_spill": meta[".vgpr_spill_count"], "sgpr_spill": meta[".sgpr_spill_count"],
            "lds": meta[".group_segment_fixed_size"], "scratch": meta[".private_segment_fixed_size"],
            "mfma": re.findall(r"^\s+(v_(?:mfma|wmma)_\w+)", body, flags=re.MULTILINE),
        }))
    return reports


def budget_problems(variant, tile, r) -> list:
    # .vgpr_count is the unified VGPR+AGPR total on gfx90a/gfx94x (AGPRs sit above the arch VGPRs).
    problems = []
    want = {_mfma_mnemonic(variant.arch, variant.dtype, shape) for shape in tile.mfma_shapes}
    if tile.mfma_per_iteration == 0:
        if r["mfma"]:
            problems.append(f"unexpected MFMA instructions {sorted(set(r['mfma']))}")
    elif not r["mfma"]:
        problems.append("no MFMA instruction")
    elif set(r["mfma"]) != want:
        problems.append(f"MFMA instructions {sorted(set(r['mfma']))}, expected {sorted(want)}")
    elif len(r["mfma"]) % tile.static_mfma_count:
        problems.append(f"{len(r['mfma'])} MFMAs is not a whole number of {tile.static_mfma_count}-MFMA blocks")
    if r["wave"] != (32 if tile.wmma else 64):
        problems.append(f"wavefront size {r['wave']}")
    if r["vgpr_spill"] or r["sgpr_spill"]:
        problems.append(f"spills: {r['vgpr_spill']} VGPR, {r['sgpr_spill']} SGPR")
    if r["scratch"]:
        problems.append(f"{r['scratch']} bytes of scratch (private segment)")
    if r["lds"] != tile.lds_bytes:
        problems.append(f"LDS {r['lds']} bytes, designed {tile.lds_bytes}")
    if r["lds"] > tile.lds_per_cu:
        problems.append(f"LDS {r['lds']} > {tile.lds_per_cu}")
    if r["vgpr"] > tile.register_budget or designed_waves(r["vgpr"], tile) < tile.waves_per_simd:
        problems.append(
            f"VGPR+AGPR {r['vgpr']} (AGPR {r['agpr']}) > budget {tile.register_budget} "
            f"for {tile.waves_per_simd} waves per SIMD"
        )
    return problems


@pytest.mark.parametrize(
    "variant, direction", [(v, d) for v in variants.select(ISA_ARCHS) for d in v.directions],
    ids=lambda x: x.stem("fwd").replace("fwd_", "") if hasattr(x, "stem") else x,
)
def test_kernels_isa_meet_their_budget(built, variant, direction):
    reports = resource_reports(built[0], variant, direction)
    assert {tile.kernel for tile, _ in reports} == set(variants.DIRECTION_KERNELS[direction])
    problems = [f"{tile.kernel}: {problem}" for tile, r in reports for problem in budget_problems(variant, tile, r)]
    assert not problems, f"{variant.stem(direction)}: " + "; ".join(problems)


def fp8_decode_problems(build_dir: str, variant) -> list:
    """Why a decode instantiation's device assembly would not serve FP8 caches: it must hold
    decode_kernel<Tile, true> (the e4m3 cache, Itanium "...Lb1EEEv") beside <Tile, false>, and
    every kernel must keep fp32 denormals (mode 3), which csrc/fp8.h's exact e4m3 conversion needs
    for the e4m3 subnormals."""
    path = rocm_build.device_assembly(build_dir)[(variant.arch, variant.stem("decode"))]
    with open(path) as handle:
        assembly = handle.read()
    flags = sorted(match.group(1) for symbol in parse_kernel_metadata(assembly)
                   if (match := re.search(r"13decode_kernelI.*Lb([01])EEEv\d+PortattnDecodeParams$", symbol)))
    problems = [] if flags == ["0", "1"] else [f"decode_kernel instantiations (kFp8) {flags}, expected ['0', '1']"]
    modes = set(re.findall(r"\.amdhsa_float_denorm_mode_32 (\d)", assembly))
    if modes != {"3"}:
        problems.append(f"fp32 denormal modes {sorted(modes)}: fp8.h's subnormal conversion needs 3 (kept)")
    return problems


@pytest.mark.parametrize("variant", variants.select(ISA_ARCHS), ids=lambda v: v.stem("decode"))
def test_decode_instantiations_hold_the_fp8_kernel(built, variant):
    """fp8_kv on every arch: each decode instantiation compiles the e4m3 kernel too (its budget is
    checked with the 16-bit one's by test_kernels_isa_meet_their_budget: same tile, same name)."""
    assert fp8_decode_problems(built[0], variant) == []


CDNA4_SHAPES = {"fwd": ("32x32x16",), "bwd_dq": ("32x32x16",), "bwd_dkdv": ("32x32x16",),
                "decode": ("16x16x32", "16x16x16")}


@pytest.mark.parametrize("variant", variants.select(["gfx950"]), ids=lambda v: v.stem("fwd"))
def test_cdna4_kernels_use_the_double_depth_mfma(built, variant):
    """gfx950: every product but the decode's O^T (16 keys per wave: one shallow step) is a
    double-depth MFMA, one instruction per two of gfx942's: the kernel holds whole loop bodies of
    mfma_per_iteration MFMAs, each doing per key as many shallow steps as the gfx942 build of the
    head dim (whose key block is 32 where gfx950's D=256 forward takes 64), without spills."""
    cdna3 = dataclasses.replace(variant, arch="gfx942",
                                config=next(c for c in variants.CONFIGS if c.head_dim == variant.config.head_dim))
    for direction in variant.directions:
        shallow = {tile.kernel: (tile, r) for tile, r in resource_reports(built[0], cdna3, direction)}
        for tile, r in resource_reports(built[0], variant, direction):
            if tile.kernel not in CDNA4_SHAPES:
                continue
            assert tile.mfma_shapes == CDNA4_SHAPES[tile.kernel]
            wide = _mfma_mnemonic("gfx950", variant.dtype, CDNA4_SHAPES[tile.kernel][0])
            n_wide = r["mfma"].count(wide)
            assert n_wide and len(r["mfma"]) % tile.mfma_per_iteration == 0, (tile.kernel, len(r["mfma"]))
            assert not (r["vgpr_spill"] or r["sgpr_spill"] or r["scratch"]), tile.kernel
            copies = len(r["mfma"]) // tile.mfma_per_iteration  # loop bodies the compiler emitted
            steps = (2 * n_wide + len(r["mfma"]) - n_wide) // copies  # shallow steps per block
            cdna3_tile, cdna3_r = shallow[tile.kernel]
            assert cdna3_r["mfma"] and len(cdna3_r["mfma"]) % cdna3_tile.mfma_per_iteration == 0, tile.kernel
            cdna3_steps = cdna3_tile.mfma_per_iteration  # one shallow step per instruction
            assert steps * cdna3_tile.block == cdna3_steps * tile.block, (tile.kernel, steps, cdna3_steps)


def test_every_variant_has_assembly_for_both_archs(built):
    build_dir, _ = built
    found = rocm_build.device_assembly(build_dir)
    missing = [v.stem(d) for v in variants.select(ISA_ARCHS) for d in v.directions
               if (v.arch, v.stem(d)) not in found]
    assert not missing, f"no device assembly for {missing}"


def _load_built_module(ext_path: str):
    spec = importlib.util.spec_from_file_location("portattn_rocm_isa_test._C", ext_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_module_features_equal_the_declaration(built):
    """No silent ignores: the declared ROCm features are exactly those the module implements."""
    from portattn.capability.specs.rocm import SPEC

    _, ext_path = built
    config = _load_built_module(ext_path).build_config()
    assert set(config["features"]) == set(SPEC.supported)
    assert sorted(config["archs"]) == sorted(ISA_ARCHS)
    from portattn.capability.matrix import feature_status

    for arch in ISA_ARCHS:  # per arch (arch_features)
        declared = {f for f, status in feature_status("rocm", arch).items() if status != "no"}
        assert set(config["features_by_arch"][arch]) == declared, arch
    assert max(config["head_dims"]) == SPEC.head_dim_max == variants.MAX_HEAD_DIM
    assert set(config["dtypes"]) == set(SPEC.dtypes)


def _fwd_args(**overrides):
    """A well-formed fwd() argument list (16-byte aligned fake pointers) with overrides."""
    from portattn.backends.abi import FwdArgs

    args = dict(
        q=4096, k=8192, v=12288, out=16384, lse=20480,
        q_strides=(2048, 128, 64, 1), k_strides=(2048, 128, 64, 1), v_strides=(2048, 128, 64, 1),
        out_strides=(2048, 128, 64, 1), lse_batch_stride=32, lse_head_stride=16, dtype=0, batch=1,
        nheads=2, nheads_k=2, headdim=64, seqlen_q=16, seqlen_k=16, cu_seqlens_q=0, cu_seqlens_k=0,
        seqused_k=0, softmax_scale=0.125, softcap=0.0, window_left=-1, window_right=-1,
        alibi_slopes=0, alibi_batch_stride=0, dropout_p=0.0, philox_seed=1, philox_offset=0, stream=0,
        total_q=0, total_k=0, philox_state=0, sm_margin=0,
    )
    args.update(overrides)
    return list(FwdArgs(**args))  # by name: a field missing or misplaced fails here


def _decode_args(**overrides):
    """A well-formed decode() argument list (common/binding_args.h PORTATTN_DECODE_ARGS) with overrides."""
    strides = (2048, 128, 64, 1)
    args = dict(
        q=4096, k=8192, v=12288, out=16384, lse=20480, q_strides=strides, k_strides=strides, v_strides=strides,
        out_strides=strides, lse_batch_stride=32, lse_head_stride=16, dtype=1, batch=1, nheads=8, nheads_k=2,
        headdim=64, seqlen_q=1, seqlen_k=16, cu_seqlens_q=0, cu_seqlens_k=0, cache_seqlens=24576, seqlen_new=0,
        cache_leftpad=0, cache_batch_idx=0, block_table=0, block_table_batch_stride=0, page_size=0, num_pages=0,
        cache_batches=1, kv_capacity=16, total_q=0, total_k=0, softmax_scale=0.125, softcap=0.0, window_left=-1,
        window_right=-1, alibi_slopes=0, alibi_batch_stride=0, num_splits=1, o_partial=0, lse_partial=0, stream=0,
        errors=0, cache_dtype=0, k_descale=0, v_descale=0, k_descale_batch_stride=0, k_descale_head_stride=0,
        v_descale_batch_stride=0, v_descale_head_stride=0,
    )
    args.update(overrides)
    return list(args.values())


def _bwd_args(deterministic=False, **fwd_overrides):
    """A well-formed bwd() argument list: its own arguments, then fwd()'s."""
    strides = (2048, 128, 64, 1)
    own = [32768, strides, 36864, strides, 40960, strides, 45056, strides, 49152, 1 << 20, deterministic]
    return own + _fwd_args(**fwd_overrides)


FEATURE_CALLS = {  # one call per declared feature, using it: (module function, arguments)
    "forward": ("fwd", _fwd_args()),
    "causal": ("fwd", _fwd_args(window_right=0)),
    "window": ("fwd", _fwd_args(window_left=8, window_right=2)),
    "softcap": ("fwd", _fwd_args(softcap=30.0)),
    "alibi": ("fwd", _fwd_args(alibi_slopes=24576)),
    "dropout": ("fwd", _fwd_args(dropout_p=0.1)),
    "gqa": ("fwd", _fwd_args(nheads_k=1)),
    "varlen": ("fwd", _fwd_args(cu_seqlens_q=28672, cu_seqlens_k=28672, q_strides=(128, 64, 1))),
    "backward": ("bwd", _bwd_args()),
    "deterministic_backward": ("bwd", _bwd_args(deterministic=True)),
    "decode": ("decode", _decode_args(num_splits=4, o_partial=32768, lse_partial=36864)),
    "paged_kv": ("decode", _decode_args(block_table=28672, block_table_batch_stride=4, page_size=16,
                                        num_pages=8, k_strides=(2048, 128, 64, 1), kv_capacity=64)),
    "fp8_kv": ("decode", _decode_args(cache_dtype=1, k_descale=32768, v_descale=36864, k_descale_batch_stride=2,
                                      k_descale_head_stride=1, v_descale_batch_stride=2, v_descale_head_stride=1)),
}


@pytest.mark.parametrize("feature", sorted(FEATURE_CALLS))
def test_each_declared_feature_passes_the_module_up_to_the_device(built, feature):
    """Every declared feature passes the module's checks and reaches the HIP device step
    (which fails on this GPU-less machine); a feature the kernels did not implement would be
    refused with ValueError before that."""
    from portattn.capability.specs.rocm import SPEC

    assert set(FEATURE_CALLS) == set(SPEC.supported)
    module = _load_built_module(built[1])
    count, status = module.device_count()
    if count:
        pytest.skip(f"an AMD GPU is present ({count}); this test needs the no-device path")
    function, args = FEATURE_CALLS[feature]
    with pytest.raises(RuntimeError, match="hipGet"):
        getattr(module, function)(*args)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"headdim": 264}, "headdim 264"),
        ({"headdim": 60}, "multiple of 8"),
        ({"k": 8200}, "k must be 16-byte aligned"),
        ({"v_strides": (2048, 132, 66, 1)}, "v strides"),
        ({"nheads": 3, "nheads_k": 2}, "nheads % nheads_k"),
        ({"cu_seqlens_q": 28672}, "given together"),
    ],
)
def test_fwd_rejects_broken_invariants(built, overrides, message):
    module = _load_built_module(built[1])
    with pytest.raises(ValueError, match=message):
        module.fwd(*_fwd_args(**overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_splits": 0}, "num_splits 0"),
        ({"num_splits": 129}, r"num_splits 129 must be in \[1, 128\]"),
        ({"num_splits": 2}, "o_partial"),
        ({"block_table": 28672}, "page_size > 0"),
        ({"headdim": 264}, "headdim 264"),
        ({"k": 8200}, "k must be 16-byte aligned"),
        ({"nheads": 3}, "nheads % nheads_k"),
        ({"cache_dtype": 2}, "cache_dtype 2 must be 0"),
    ],
)
def test_decode_rejects_broken_invariants(built, overrides, message):
    module = _load_built_module(built[1])
    with pytest.raises(ValueError, match=message):
        module.decode(*_decode_args(**overrides))


def test_decode_tile_needs_no_device(built):
    """The split planner's tile facts come from the variant table (the same on every arch)."""
    module = _load_built_module(built[1])
    for config in variants.CONFIGS:
        assert module.decode_tile(config.head_dim) == {
            "stage_keys": config.decode.block, "threads": variants.DECODE_WAVES * 64,
            "smem_bytes": config.decode.lds_bytes,
        }


def test_bwd_rejects_a_short_workspace(built):
    module = _load_built_module(built[1])
    needed = module.bwd_workspace_bytes(1, 2, 2, 64, 16, 16, False)
    assert needed == 1 * 2 * 16 * 4  # fp32 rowsum(dO * O) per (batch, head, query)
    args = _bwd_args()
    args[9] = needed - 1
    with pytest.raises(ValueError, match="workspace"):
        module.bwd(*args)


def test_backend_without_amd_gpu_is_unavailable_with_a_reason():
    torch = pytest.importorskip("torch")
    from portattn.backends.rocm import RocmBackend
    from portattn.capability.callspec import CallSpec

    backend = RocmBackend()
    if torch.version.hip is not None and not backend.unavailable_reason:
        pytest.skip("a usable AMD GPU is present")
    reason = backend.unavailable_reason
    assert re.search(r"not a ROCm build|not built|cannot load|no AMD GPU", reason), reason
    call = CallSpec("float16", 64, 64, "cuda", frozenset({"forward"}))
    assert backend.unsupported_reasons(call) == [reason]


def test_declaration_on_amd_devices():
    """On a (fake) MI300, RDNA3 and RDNA4 the declared features (backward, decode and paged
    caches included) are served; a head dim past the largest built is a reason."""
    from portattn.capability.archs import amd_arch
    from portattn.capability.matrix import check_call
    from portattn.capability.probe import DeviceInfo
    from portattn.capability.callspec import CallSpec

    mi300 = DeviceInfo(0, "amd", "AMD Instinct MI300X", amd_arch("gfx942"), 304, 64, 65536,
                       None, None, None, "fake")
    forward = CallSpec("bfloat16", 128, 128, "cuda", frozenset({"forward", "backward", "causal", "dropout"}))
    assert check_call("rocm", mi300, forward) == []
    paged = CallSpec("bfloat16", 128, 128, "cuda", frozenset({"forward", "decode", "paged_kv", "gqa"}))
    assert check_call("rocm", mi300, paged) == []
    rdna_forward = CallSpec("bfloat16", 128, 128, "cuda", frozenset({"forward", "causal", "dropout", "gqa"}))
    for name, arch in (("AMD Radeon RX 7900 XTX", "gfx1100"), ("AMD Radeon RX 9070 XT", "gfx1201")):
        rdna = DeviceInfo(0, "amd", name, amd_arch(arch), 64, 32, 65536, None, None, None, "fake")
        assert check_call("rocm", rdna, paged) == [], arch
        assert check_call("rocm", rdna, rdna_forward) == [], arch
        assert check_call("rocm", rdna, forward) == [], f"{arch}: the backward is built"
    too_big = CallSpec("float16", 264, 264, "cuda", frozenset({"forward"}))
    assert any("264" in reason for reason in check_call("rocm", mi300, too_big))


# ---------------------------------------------------------------------------------------------
# Build selection (torch-free, no toolchain needed)


def test_head_dim_restriction_selects_the_serving_configs():
    chosen = variants.select(["gfx942"], ["bf16"], [40, 128])  # README spells them fp16 / bf16
    assert [(v.dtype, v.config.head_dim) for v in chosen] == [("bfloat16", 64), ("bfloat16", 128)]
    assert [v.dtype for v in variants.select(["gfx90a"], ["float16", "fp16"], [64])] == ["float16"]
    with pytest.raises(ValueError, match=f"264 exceeds the ROCm maximum {variants.MAX_HEAD_DIM}"):
        variants.select(["gfx942"], None, [264])
    with pytest.raises(ValueError, match="PORTATTN_DTYPES"):
        variants.select(["gfx942"], ["float32"])


def _debian_tools(clang: bool):
    return rocm_build.Toolchain("debian", "/usr", "/usr/bin/hipcc", "/usr/bin/clang++-19" if clang else None,
                                "/lib/bitcode" if clang else None)


def test_arch_selection_from_env_and_toolchain(monkeypatch):
    monkeypatch.setattr(rocm_build, "_present_gpu_archs", lambda tools, env: [])
    assert rocm_build.selected_archs(_debian_tools(True), {}) == ["gfx90a", "gfx942"]
    # Debian without clang-19 still builds what hipcc 5.2 can, instead of failing the install.
    assert rocm_build.selected_archs(_debian_tools(False), {}) == ["gfx90a"]
    assert rocm_build.selected_archs(_debian_tools(True), {"PORTATTN_HIP_ARCHS": "gfx942"}) == ["gfx942"]
    with pytest.raises(ValueError, match="gfx1030"):
        rocm_build.selected_archs(_debian_tools(True), {"PORTATTN_HIP_ARCHS": "gfx90a;gfx1030"})
    assert rocm_build.selected_archs(_debian_tools(True), {"PORTATTN_HIP_ARCHS": "gfx1100,gfx1201"}) == [
        "gfx1100", "gfx1201"]
    with pytest.raises(RuntimeError, match="cannot compile gfx942"):
        _debian_tools(False).compiler_for("gfx942")
    monkeypatch.setattr(rocm_build, "_present_gpu_archs", lambda tools, env: ["gfx942"])
    assert rocm_build.selected_archs(_debian_tools(True), {}) == ["gfx942"]


def test_build_config_reports_lds_per_head_dim(built):
    """The smallest LDS per workgroup over the built archs, per direction and head dim."""
    config = _load_built_module(built[1]).build_config()
    every = [*variants.CONFIGS, *(c for configs in variants.RDNA_CONFIGS.values() for c in configs)]
    assert config["smem_bytes"] == {
        "forward": {c.head_dim: min(x.fwd.lds_bytes for x in every if x.head_dim == c.head_dim)
                    for c in variants.CONFIGS},
        "backward": {c.head_dim: min(max(x.bwd_dq.lds_bytes, x.bwd_dkdv.lds_bytes) for x in every
                                     if x.head_dim == c.head_dim) for c in variants.CONFIGS},
        "decode": {c.head_dim: min(x.decode.lds_bytes for x in every if x.head_dim == c.head_dim)
                   for c in variants.CONFIGS},
    }
