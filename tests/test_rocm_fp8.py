"""csrc/fp8.h on the CPU: the ROCm decode's e4m3 conversions, compiled for the host through the
emulation header (tests/rocm_emulation/hip_emu.h) and called with ctypes, against torch.

Reading: every one of the 256 bytes widens to exactly torch's float8_e4m3fn -> float16 / bfloat16,
except e4m3's NaN bytes 0x7f / 0xff, which read as +-480 (docs/rocm.md, as the CUDA decode).
Writing: e4m3(x / descale) gives the bytes of portattn/kvcache.py's quantize_fp8 (the reference
append) for ties, subnormals, the saturation boundary, infinities and NaN.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "portattn", "backends", "rocm", "csrc")
EMU_HEADER = os.path.join(ROOT, "tests", "rocm_emulation", "hip_emu.h")
HOST_CLANG = "clang++-19"  # as tests/test_rocm_emulated.py: _Float16 on the host

SOURCE = r"""
#define PORTATTN_ROCM_ARCH_NS emu
#include "fp8.h"
using namespace portattn::rocm;
using namespace portattn::rocm::emu;
extern "C" void widen_all(int bf16, uint16_t* out) {
  for (uint32_t byte = 0; byte < 256; ++byte) out[byte] = bf16 ? fp8::e4m3_to<true>(byte) : fp8::e4m3_to<false>(byte);
}
extern "C" void widen8(int bf16, const uint8_t* in, uint16_t* out) {  // e4m3x8_to: 8 bytes -> 8 values in order
  u32x2 bytes;
  __builtin_memcpy(&bytes, in, 8);
  const u32x4 words = bf16 ? fp8::e4m3x8_to<true>(bytes) : fp8::e4m3x8_to<false>(bytes);
  __builtin_memcpy(out, &words, 16);
}
extern "C" void quantize_all(const float* x, const float* descale, int n, uint8_t* out) {
  for (int i = 0; i < n; ++i) out[i] = fp8::quantize(x[i], descale[i]);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if shutil.which(HOST_CLANG) is None:
        pytest.skip(f"{HOST_CLANG} not found (run .ci/install_rocm_toolchain.sh)")
    folder = tmp_path_factory.mktemp("rocm_fp8")
    source, library = folder / "fp8_host.cpp", folder / "fp8_host.so"
    source.write_text(SOURCE)
    subprocess.run([HOST_CLANG, "-std=c++20", "-O2", "-fPIC", "-shared", "-Wno-unknown-attributes",
                    "-Wno-ignored-attributes", f'-DPORTATTN_ROCM_EMULATE="{EMU_HEADER}"',
                    '-DPORTATTN_EMU_ARCH="emu"', "-DPORTATTN_EMU_WAVE=64", f"-I{CSRC}", str(source),
                    "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_byte_widens_exactly(lib, dtype):
    bits = torch.zeros(256, dtype=torch.int16)
    lib.widen_all(int(dtype == torch.bfloat16), _ptr(bits))
    kernel = bits.view(dtype)
    expected = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).to(dtype)
    nan_bytes = torch.tensor([0x7f, 0xff])
    assert expected[nan_bytes].isnan().all()
    assert kernel[nan_bytes].tolist() == [480.0, -480.0]  # e4m3's NaN bytes: +-480, not NaN
    finite = torch.ones(256, dtype=torch.bool)
    finite[nan_bytes] = False
    assert torch.equal(kernel.view(torch.int16)[finite], expected.view(torch.int16)[finite])  # -0 and subnormals too


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_eight_bytes_widen_in_order(lib, dtype):
    raw = torch.tensor([0x01, 0x08, 0x38, 0x7e, 0x80, 0x81, 0xb8, 0xfe], dtype=torch.uint8)
    out = torch.zeros(8, dtype=torch.int16)
    lib.widen8(int(dtype == torch.bfloat16), _ptr(raw), _ptr(out))
    assert torch.equal(out.view(dtype), raw.view(torch.float8_e4m3fn).to(dtype))


def test_quantize_matches_the_reference_append(lib):
    from portattn.kvcache import quantize_fp8

    generator = torch.Generator().manual_seed(0)
    e4m3 = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[~e4m3.isnan()]
    steps = e4m3.unique()
    midpoints = (steps[1:] + steps[:-1]) / 2  # ties: round to the even neighbour
    near = torch.cat([midpoints, torch.nextafter(midpoints, torch.tensor(float("inf"))),
                      torch.nextafter(midpoints, torch.tensor(float("-inf")))])
    wide = torch.randn(20000, generator=generator) * 10.0 ** (torch.rand(20000, generator=generator) * 12.0 - 6.0)
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 463.99, 479.0, 480.0, 1e30, float("inf"),
                            float("-inf"), float("nan"), -float("nan"), 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11,
                            2.0 ** -6, 2.0 ** -6 - 2.0 ** -12, 1e-40])
    x = torch.cat([e4m3, near, wide, special])
    descale = torch.ones_like(x)
    descale[len(e4m3) + len(near):] = torch.rand(len(wide) + len(special), generator=generator) * 3.0 + 0.01
    out = torch.zeros(x.numel(), dtype=torch.uint8)
    lib.quantize_all(_ptr(x), _ptr(descale), x.numel(), _ptr(out))
    # quantize_fp8's layout: x (batch, seqlen, nheads_k, headdim), descale (batch, nheads_k).
    expected = quantize_fp8(x.view(-1, 1, 1, 1), descale.view(-1, 1)).view(torch.uint8).flatten()
    mismatch = (out != expected).nonzero().flatten()
    assert mismatch.numel() == 0, [(x[i].item(), descale[i].item(), out[i].item(), expected[i].item())
                                   for i in mismatch[:8]]
