"""Build the CUDA backend (torch-free; setup.py imports this file by path).

Two artifacts, both written next to `ext_path`:

1. `libportattn_cuda.so`: every nvcc translation unit (the generated
   per-(family, head dim, dtype) kernel files of variants.py, the table, the C
   entry points). It has no Python or torch dependency, so one build serves
   every Python version and every torch version, and it is the slow part.
2. `_C<EXT_SUFFIX>` (the extension module at ext_path): csrc/binding.cpp only,
   compiled by the host C++ compiler against this Python's headers and
   pybind11, linked to (1) with rpath $ORIGIN. Seconds to build, so moving to
   another Python (the GPU machine runs 3.12, development here 3.11) rebuilds
   only this (`python build.py --inplace --binding-only`).

cudart is linked statically into (1) (nvcc's default). Inside a torch process
that is safe: the runtime API of both copies sits on the driver's primary
context, so torch's streams (driver objects; we get the raw handle from
torch._C._cuda_getCurrentRawStream) and its allocations are valid for our
launches, and we never depend on finding a libcudart.so of the right major
version at load time (torch's copy lives in a wheel folder that is not on the
loader path). The driver itself (libcuda.so.1) is only opened at the first
CUDA call, so importing the module on a machine without a GPU works.

Restrictions (variants.py): PORTATTN_CUDA_ARCHS, PORTATTN_HEADDIMS,
PORTATTN_DTYPES; MAX_JOBS caps ninja's parallelism. The sm_90a kernels
(csrc/hopper_*.cu and their generated hopper_* variants, sm_90a only; _C.hopper_fwd
and _C.hopper_bwd) are built when the archs include sm_90; PORTATTN_CUDA_HOPPER=0
leaves them out, =1 forces them.
PORTATTN_PTXAS_VERBOSE=1 prints ptxas register/spill/shared-memory reports; PORTATTN_NVCC_FLAGS adds
nvcc flags (tuning experiments, e.g. -DPORTATTN_FWD_HD64_BLOCK_N=64).
"""
from __future__ import annotations

import filecmp
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from typing import Mapping, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")
_COMMON = os.path.join(os.path.dirname(_HERE), "common")
LIBRARY_NAME = "libportattn_cuda.so"
# Files build() writes beside the extension module that must travel with it
# (setup.py copies them for in-place / editable installs).
SIBLING_FILES = (LIBRARY_NAME,)


def _load_sibling(name: str, path: str):
    # By path, so that setup.py needs neither torch nor an importable portattn.
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


variants = _load_sibling("_portattn_cuda_variants", os.path.join(_HERE, "variants.py"))
ninja_build = _load_sibling("_portattn_ninja_build", os.path.join(os.path.dirname(_HERE), "ninja_build.py"))


def find_nvcc(env: Mapping[str, str] = os.environ) -> Optional[str]:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = env.get(var)
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.path.exists(default) else None


def toolchain() -> Optional[str]:
    """'nvcc 13.0 at /usr/local/cuda/bin/nvcc', or None when nvcc is absent."""
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+\.\d+)", text)
    return f"nvcc {match.group(1) if match else '?'} at {nvcc}"


def _write_if_changed(path: str, text: str) -> None:
    if os.path.exists(path) and open(path).read() == text:
        return
    with open(path, "w") as handle:
        handle.write(text)


def _hand_written_sources() -> list:
    """Every csrc/*.cu that is not a per-variant template (entry points, helpers),
    except the opt-in Hopper ones (_hopper_sources)."""
    return sorted(os.path.join(_CSRC, f) for f in os.listdir(_CSRC)
                  if f.endswith(".cu") and not variants.is_hopper_source(f))


def _hopper_sources() -> list:
    return sorted(os.path.join(_CSRC, f) for f in os.listdir(_CSRC)
                  if f.endswith(".cu") and variants.is_hopper_source(f))


def build_library(lib_path: str, build_temp: str, env: Mapping[str, str]) -> None:
    nvcc = find_nvcc(env)
    if nvcc is None:
        raise RuntimeError("portattn: the CUDA backend needs nvcc (set CUDA_HOME)")
    plan = variants.plan_from_env(env)
    gen_dir = os.path.join(build_temp, "generated")
    obj_dir = os.path.join(build_temp, "obj")
    os.makedirs(gen_dir, exist_ok=True)
    os.makedirs(obj_dir, exist_ok=True)
    generated = []
    for name, text in variants.generated_sources(plan).items():
        path = os.path.join(gen_dir, name)
        _write_if_changed(path, text)
        generated.append(path)
    # A plan change must relink even if no object changed (e.g. fewer variants).
    _write_if_changed(os.path.join(gen_dir, "plan.txt"), repr(plan))
    hopper_generated = [path for path in generated if variants.is_hopper_source(os.path.basename(path))]
    sources = [path for path in generated if path not in hopper_generated] + _hand_written_sources()

    common = ["-O3", "-std=c++17", "-DNDEBUG", "-Xcompiler", "-fPIC", f"-I{_CSRC}", f"-I{_COMMON}"]
    extra = ["-Xptxas=-v"] if env.get("PORTATTN_PTXAS_VERBOSE") == "1" else []
    extra += shlex.split(env.get("PORTATTN_NVCC_FLAGS", ""))
    flags = common + variants.gencode_flags(plan) + extra
    compiles = [(source, flags) for source in sources]
    # ---- Hopper path (variants.HOPPER_ENV): its own sources, generated and hand-written, sm_90a only ----
    if plan.hopper:
        hopper_flags = common + list(variants.HOPPER_GENCODE) + extra
        compiles += [(source, hopper_flags) for source in hopper_generated + _hopper_sources()]
    build = ninja_build.NinjaBuild(os.path.join(build_temp, "ninja_lib"))
    objects = []
    for source, flags in compiles:
        obj = os.path.join(obj_dir, os.path.basename(source) + ".o")
        build.compiles.append(
            ninja_build.CompileStep(
                source=source,
                output=obj,
                command=[nvcc, *flags, "-MD", "-MF", "$depfile", "-c", "$in", "-o", "$out"],
                depfile=obj + ".d",
            )
        )
        objects.append(obj)
    build.links.append(
        ninja_build.LinkStep(
            inputs=objects,
            output=lib_path,
            command=[nvcc, "-shared", "-cudart", "static", "$in", "-o", "$out"],
        )
    )
    build.run(env)


def build_binding(ext_path: str, build_temp: str, env: Mapping[str, str],
                  library_dir: Optional[str] = None) -> None:
    """csrc/binding.cpp -> ext_path, linked to library_dir/libportattn_cuda.so (default: beside
    ext_path); at run time the library is found beside the module (rpath $ORIGIN)."""
    import pybind11  # build requirement, torch-free

    out_dir = library_dir or os.path.dirname(os.path.abspath(ext_path))
    os.makedirs(os.path.dirname(os.path.abspath(ext_path)), exist_ok=True)
    if not os.path.exists(os.path.join(out_dir, LIBRARY_NAME)):
        raise RuntimeError(f"portattn: {LIBRARY_NAME} must be built into {out_dir} before the binding")
    cxx = env.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    tag = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    build = ninja_build.NinjaBuild(os.path.join(build_temp, f"ninja_binding{tag.replace('.so', '')}"))
    obj = os.path.join(build.build_dir, "binding.o")
    build.compiles.append(
        ninja_build.CompileStep(
            source=os.path.join(_CSRC, "binding.cpp"),
            output=obj,
            command=[
                cxx, "-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden",
                *([variants.HOPPER_BINDING_DEFINE] if variants.hopper_enabled(env) else []),
                f"-I{sysconfig.get_paths()['include']}", f"-I{pybind11.get_include()}",
                "-MD", "-MF", "$depfile", "-c", "$in", "-o", "$out",
            ],
            depfile=obj + ".d",
        )
    )
    build.links.append(
        ninja_build.LinkStep(
            inputs=[obj, os.path.join(out_dir, LIBRARY_NAME)],
            output=os.path.abspath(ext_path),
            command=[
                cxx, "-shared", obj, f"-L{out_dir}", "-lportattn_cuda",
                "-Wl,-rpath,$ORIGIN", "-o", "$out",
            ],
        )
    )
    build.run(env)


def _install(built: str, target: str) -> None:
    # Each build dir links into itself and copies out only on change: several
    # build dirs (setup.py's, the in-place one, tests) may target the same
    # folder, and ninja would otherwise trust a newer file another one wrote.
    if not os.path.exists(target) or not filecmp.cmp(built, target, shallow=False):
        tmp = target + ".tmp"
        shutil.copyfile(built, tmp)
        shutil.copymode(built, tmp)
        os.replace(tmp, target)


def build(ext_path: str, build_temp: str, env: Mapping[str, str]) -> None:
    """The build interface of docs/ARCHITECTURE.md: library, then the binding. build_temp is
    this backend's own folder (setup.py: .portattn_build/cuda), kept between installs."""
    out_dir = os.path.dirname(os.path.abspath(ext_path))
    os.makedirs(out_dir, exist_ok=True)
    temp = build_temp
    built_lib = os.path.join(temp, "out", LIBRARY_NAME)
    build_library(built_lib, temp, env)
    _install(built_lib, os.path.join(out_dir, LIBRARY_NAME))
    built_ext = os.path.join(temp, "out", os.path.basename(ext_path))
    build_binding(built_ext, temp, env, library_dir=out_dir)
    _install(built_ext, os.path.abspath(ext_path))


def inplace_ext_path() -> str:
    return os.path.join(_HERE, "_C" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build the portattn CUDA backend in place.")
    parser.add_argument("--binding-only", action="store_true",
                        help=f"rebuild only _C against an existing {LIBRARY_NAME} (e.g. another Python)")
    parser.add_argument("--build-temp", default=os.path.join(_HERE, "..", "..", "..", ".portattn_build", "cuda"))
    args = parser.parse_args(argv)
    ext_path = inplace_ext_path()
    build_temp = os.path.abspath(args.build_temp)
    if args.binding_only:
        built_ext = os.path.join(build_temp, "out", os.path.basename(ext_path))
        build_binding(built_ext, build_temp, os.environ, library_dir=_HERE)
        _install(built_ext, ext_path)
    else:
        build(ext_path, build_temp, os.environ)
    print(f"built {ext_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
