"""Builds portattn.backends.rocm._C (torch-free; setup.py and the ISA test import it by path).

Two toolchains:
- a ROCm install (ROCM_PATH, else /opt/rocm): its own hipcc compiles every arch and
  the module links that install's libamdhip64, which is what a user's machine needs;
- Debian 12 without ROCm (CI): Debian's hipcc 5.2 compiles gfx90a, clang-19 compiles
  gfx942, gfx1100 and gfx1201 (LLVM 15 knows none of them) and clang-22 gfx950 (LLVM 19
  does not know it), against Debian's HIP headers and a device-library folder with the
  ISA-version stubs that .ci/install_rocm_toolchain.sh creates.

Every (variant, arch) is its own translation unit with its kernels in a per-arch
namespace: ninja spreads them over the cores, and objects from two compilers link
into one module without symbol clashes. Each compile keeps its device assembly
(-save-temps=obj), which tests/test_rocm_isa.py reads.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from typing import Mapping, NamedTuple, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")


def _load_sibling(name: str, path: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: variants.py defines dataclasses
        spec.loader.exec_module(module)
    return sys.modules[name]


variants = _load_sibling("portattn_rocm_variants", os.path.join(_HERE, "variants.py"))
ninja_build = _load_sibling("portattn_ninja_build", os.path.join(_HERE, "..", "ninja_build.py"))

DEBIAN_BITCODE = "/usr/lib/x86_64-linux-gnu/amdgcn/bitcode"
DEFAULT_DEVICE_LIB_DIR = "/usr/local/lib/portattn-amdgcn-bitcode"  # .ci/install_rocm_toolchain.sh
DEBIAN_HIPCC_ARCHS = ("gfx90a", "gfx940")  # what LLVM 15 (hipcc 5.2) can target
DEBIAN_CLANG = "clang++-19"
DEBIAN_CLANG_ARCHS = ("gfx942", "gfx1100", "gfx1201")  # LLVM 19 knows these, LLVM 15 does not
DEBIAN_CLANG22 = "clang++-22"  # bookworm-security
DEBIAN_CLANG22_ARCHS = ("gfx950",)  # LLVM 20+
TOOLCHAIN_HINT = "hipcc under ROCM_PATH or /opt/rocm, or Debian's hipcc / clang++-19 / clang++-22 with libamdhip64-dev"
COMMON_FLAGS = ["-std=c++17", "-O3", "-fPIC", "-Wno-unused-command-line-argument"]


class Toolchain(NamedTuple):
    # A NamedTuple, not a dataclass: setup.py loads this file by path without
    # registering it in sys.modules, which dataclasses need.
    kind: str  # "rocm" | "debian"
    root: str  # ROCm root, or /usr for Debian
    hipcc: Optional[str]
    clang: Optional[str]  # Debian only: clang++-19 for targets LLVM 15 lacks
    device_lib_dir: Optional[str]
    clang22: Optional[str] = None  # Debian only: clang++-22 for targets LLVM 19 lacks

    def describe(self) -> str:
        if self.kind == "rocm":
            return f"hipcc at {self.root}"
        parts = []
        if self.hipcc:
            parts.append(f"Debian hipcc ({'/'.join(DEBIAN_HIPCC_ARCHS)})")
        if self.clang:
            parts.append(f"{os.path.basename(self.clang)} ({'/'.join(DEBIAN_CLANG_ARCHS)})")
        if self.clang22:
            parts.append(f"{os.path.basename(self.clang22)} ({'/'.join(DEBIAN_CLANG22_ARCHS)})")
        return " + ".join(parts)

    def has_isa_stub(self, arch: str) -> bool:
        """Whether the device-library folder has `arch`'s ISA-version stub (ROCm 5.2 stops at gfx940;
        find_toolchain only accepts a folder with gfx942's)."""
        return bool(self.device_lib_dir) and (arch == "gfx942" or os.path.exists(
            os.path.join(self.device_lib_dir, f"oclc_isa_version_{arch[3:]}.bc")))

    def can_compile(self, arch: str) -> bool:
        try:
            self.compiler_for(arch)
        except RuntimeError:
            return False
        return True

    def compiler_for(self, arch: str) -> list[str]:
        """argv prefix that compiles one HIP source for `arch` into an object."""
        if self.kind == "rocm":
            return [self.hipcc, *COMMON_FLAGS, f"--offload-arch={arch}"]
        if arch in DEBIAN_HIPCC_ARCHS and self.hipcc:
            return [self.hipcc, *COMMON_FLAGS, f"--offload-arch={arch}"]
        clang = (self.clang if arch in DEBIAN_CLANG_ARCHS else
                 self.clang22 if arch in DEBIAN_CLANG22_ARCHS else None)
        if clang and self.has_isa_stub(arch):
            extra = []
            if clang == self.clang22:
                # LLVM 20+ dropped the __AMDGCN_WAVEFRONT_SIZE macro that ROCm 5.2's
                # amd_warp_functions.h reads; the CDNA kernels are wave64.
                # Its device-library link also lacks __atomic_work_item_fence (cdna.h).
                extra = ["-D__AMDGCN_WAVEFRONT_SIZE=64", "-DPORTATTN_ROCM52_HEADERS_LLVM20"]
            return [
                clang, "-x", "hip", "--rocm-path=/usr", f"--rocm-device-lib-path={self.device_lib_dir}",
                # clang defaults to code object v5 but would link ROCm 5.2's v4 ABI stub.
                "-mcode-object-version=5", *extra, *COMMON_FLAGS, f"--offload-arch={arch}",
            ]
        raise RuntimeError(
            f"portattn ROCm: the Debian toolchain cannot compile {arch} "
            f"(hipcc 5.2: {', '.join(DEBIAN_HIPCC_ARCHS)}; clang-19: {', '.join(DEBIAN_CLANG_ARCHS)}; "
            f"clang-22: {', '.join(DEBIAN_CLANG22_ARCHS)}; each with the device-library stubs from "
            f".ci/install_rocm_toolchain.sh); set PORTATTN_HIP_ARCHS or install ROCm"
        )

    def include_dir(self) -> str:
        return os.path.join(self.root, "include")

    def lib_dir(self) -> str:
        if self.kind == "rocm":
            return os.path.join(self.root, "lib")
        return "/usr/lib/x86_64-linux-gnu"


def find_toolchain(env: Mapping[str, str] = os.environ) -> Optional[Toolchain]:
    rocm_root = env.get("ROCM_PATH") or ("/opt/rocm" if os.path.isdir("/opt/rocm") else None)
    if rocm_root and os.path.exists(os.path.join(rocm_root, "bin", "hipcc")):
        return Toolchain("rocm", rocm_root, os.path.join(rocm_root, "bin", "hipcc"), None, None)
    hipcc = shutil.which("hipcc", path=env.get("PATH"))
    clang = shutil.which(DEBIAN_CLANG, path=env.get("PATH"))
    clang22 = shutil.which(DEBIAN_CLANG22, path=env.get("PATH"))
    if not os.path.exists("/usr/include/hip/hip_runtime.h"):
        return None
    device_lib_dir = env.get("PORTATTN_ROCM_DEVICE_LIB_PATH") or DEFAULT_DEVICE_LIB_DIR
    if not os.path.exists(os.path.join(device_lib_dir, "oclc_isa_version_942.bc")):
        device_lib_dir = None
    # clang refuses HIP without its offload bundler (packages clang-tools-19 / -22).
    if clang and not shutil.which("clang-offload-bundler-19", path=env.get("PATH")):
        clang = None
    if clang22 and not shutil.which("clang-offload-bundler-22", path=env.get("PATH")):
        clang22 = None
    if device_lib_dir is None:
        clang = clang22 = None
    if hipcc is None and clang is None and clang22 is None:
        return None
    return Toolchain("debian", "/usr", hipcc, clang, device_lib_dir, clang22)


def toolchain() -> Optional[str]:
    found = find_toolchain()
    return found.describe() if found else None


def _present_gpu_archs(tools: Toolchain, env: Mapping[str, str]) -> list[str]:
    """gfx targets of the AMD GPUs in this machine (amdgpu-arch, else rocminfo); [] when none."""
    candidates = [
        [os.path.join(tools.root, "llvm", "bin", "amdgpu-arch")],
        ["amdgpu-arch"],
        [os.path.join(tools.root, "bin", "rocminfo")],
        ["rocminfo"],
    ]
    for argv in candidates:
        if not (os.path.exists(argv[0]) or shutil.which(argv[0], path=env.get("PATH"))):
            continue
        try:
            text = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        found = sorted(set(re.findall(r"\bgfx[0-9a-f]+\b", text)))
        if found:
            return found
    return []


def selected_archs(tools: Toolchain, env: Mapping[str, str]) -> list[str]:
    requested = env.get("PORTATTN_HIP_ARCHS")
    if requested:
        archs = [arch.strip() for arch in re.split(r"[;, ]+", requested) if arch.strip()]
    else:
        # Without a GPU, the defaults this toolchain can compile (Debian without
        # clang-19 still builds gfx90a rather than failing the install).
        archs = _present_gpu_archs(tools, env) or [a for a in variants.DEFAULT_ARCHS if tools.can_compile(a)]
    unsupported = [arch for arch in archs if arch not in variants.SUPPORTED_ARCHS]
    if unsupported:
        raise ValueError(
            f"PORTATTN_HIP_ARCHS: {', '.join(unsupported)} not supported; the ROCm kernels need "
            f"CDNA2+ MFMA or RDNA3/4 WMMA ({', '.join(variants.SUPPORTED_ARCHS)})"
        )
    return archs


def _split(value: Optional[str]) -> list[str]:
    return [item.strip() for item in re.split(r"[;, ]+", value or "") if item.strip()]


def build(ext_path: str, build_temp: str, env: Mapping[str, str]) -> None:
    # PORTATTN_ROCM_BUILD_DIR pins the object folder, so CI's install and
    # tests/test_rocm_isa.py share compiled variants (ninja skips what is current).
    build_temp = env.get("PORTATTN_ROCM_BUILD_DIR") or build_temp
    tools = find_toolchain(env)
    if tools is None:
        raise RuntimeError("portattn ROCm: no HIP toolchain (hipcc / ROCM_PATH / clang-19 + HIP headers)")
    archs = selected_archs(tools, env)
    head_dims = [int(value) for value in _split(env.get("PORTATTN_HEADDIMS"))]
    chosen = variants.select(archs, _split(env.get("PORTATTN_DTYPES")), head_dims)

    gen_dir = os.path.join(build_temp, "gen")
    obj_dir = os.path.join(build_temp, "obj")
    os.makedirs(gen_dir, exist_ok=True)
    os.makedirs(obj_dir, exist_ok=True)
    compile_env_prefix = ["env", "HIP_PLATFORM=amd"]  # nvcc on PATH would make hipcc pick NVIDIA
    includes = [f"-I{_CSRC}", f"-I{tools.include_dir()}"]

    job = ninja_build.NinjaBuild(build_temp)
    objects = []
    for variant in chosen:
        for direction in variant.directions:
            stem = variant.stem(direction)
            source = _write_if_changed(os.path.join(gen_dir, stem + ".hip"),
                                       variants.instantiation_source(variant, direction))
            obj = os.path.join(obj_dir, stem + ".o")
            job.compiles.append(ninja_build.CompileStep(
                source=source, output=obj, depfile=obj + ".d",
                command=[*compile_env_prefix, *tools.compiler_for(variant.arch), *includes,
                         "-save-temps=obj", "-MD", "-MF", "$depfile", "-c", "$in", "-o", "$out"],
            ))
            objects.append(obj)

    compilers = {arch: os.path.basename(tools.compiler_for(arch)[0]) for arch in archs}
    registry = _write_if_changed(os.path.join(gen_dir, "registry.cpp"),
                                 variants.registry_source(chosen, compilers))
    host_cxx = env.get("CXX") or shutil.which("c++") or "g++"
    host_flags = ["-std=c++17", "-O2", "-fPIC", "-D__HIP_PLATFORM_AMD__", "-fvisibility=hidden",
                  f"-I{tools.include_dir()}", f"-I{_CSRC}", f"-I{sysconfig.get_paths()['include']}",
                  f"-I{_pybind11_include()}"]
    for source in (registry, os.path.join(_CSRC, "module.cpp")):
        obj = os.path.join(obj_dir, os.path.basename(source) + ".o")
        job.compiles.append(ninja_build.CompileStep(
            source=source, output=obj, depfile=obj + ".d",
            command=[host_cxx, *host_flags, "-MD", "-MF", "$depfile", "-c", "$in", "-o", "$out"],
        ))
        objects.append(obj)

    link = [host_cxx, "-shared", "$in", "-o", "$out", f"-L{tools.lib_dir()}", "-lamdhip64"]
    if tools.kind == "rocm":
        link.append(f"-Wl,-rpath,{tools.lib_dir()}")
    job.links.append(ninja_build.LinkStep(inputs=objects, output=os.path.abspath(ext_path), command=link))
    os.makedirs(os.path.dirname(os.path.abspath(ext_path)), exist_ok=True)
    job.run(env)


def device_assembly(build_temp: str) -> dict:
    """{(arch, variant stem): path of its device .s} for a finished build in build_temp."""
    found = {}
    for path in glob.glob(os.path.join(build_temp, "obj", "*-hip-amdgcn-amd-amdhsa-*.s")):
        stem, arch = re.match(r"(.+)-hip-amdgcn-amd-amdhsa-(gfx[0-9a-f]+)\.s$", os.path.basename(path)).groups()
        found[(arch, stem)] = path
    return found


def _pybind11_include() -> str:
    import pybind11  # build requirement; only the headers are used

    return pybind11.get_include()


def _write_if_changed(path: str, text: str) -> str:
    # Unchanged generated sources keep their mtime, so ninja rebuilds nothing.
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as handle:
            handle.write(text)
    return path
