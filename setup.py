"""Build and install portattn.

`pip install .` looks for a GPU toolchain and builds the matching backend:
nvcc (CUDA_HOME or PATH) -> backends/cuda, hipcc / ROCm (ROCM_PATH, /opt/rocm)
-> backends/rocm; with neither it installs the pure-Python package (reference
backend only) in seconds. PORTATTN_BACKENDS=auto|none|cuda|rocm|cuda,rocm forces
the choice; a forced backend whose toolchain is missing stops the build with a
message saying what was looked for. Each backend's build.py (torch-free) does the
compiling with ninja; restriction variables are listed in README.md.
"""
import importlib.util
import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
BACKENDS = ("cuda", "rocm")


def load_build_module(backend):
    """backends/<name>/build.py, loaded by path: importing portattn itself would need torch."""
    path = os.path.join(ROOT, "portattn", "backends", backend, "build.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(f"_portattn_build_{backend}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_ninja_build():
    """backends/ninja_build.py, loaded by path (torch-free, like build.py)."""
    path = os.path.join(ROOT, "portattn", "backends", "ninja_build.py")
    spec = importlib.util.spec_from_file_location("_portattn_ninja_build", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def chosen_backends():
    request = os.environ.get("PORTATTN_BACKENDS", "auto").strip().lower() or "auto"
    if request == "none":
        return []
    names = BACKENDS if request == "auto" else tuple(n.strip() for n in request.split(",") if n.strip())
    chosen = []
    for name in names:
        if name not in BACKENDS:
            raise SystemExit(f"PORTATTN_BACKENDS={request!r}: unknown backend {name!r} (choose from auto, none, {', '.join(BACKENDS)})")
        module = load_build_module(name)
        toolchain = module.toolchain() if module is not None else None
        if toolchain is None:
            if request != "auto":
                looked = getattr(module, "TOOLCHAIN_HINT", "its compiler") if module else "backend sources"
                raise SystemExit(f"PORTATTN_BACKENDS={request}: the {name} toolchain was not found (looked for {looked})")
            continue
        print(f"portattn: building the {name} backend with {toolchain}")
        chosen.append(name)
    if not chosen:
        print("portattn: no GPU toolchain found or requested; installing the pure-Python package (reference backend)")
    return chosen


class BuildBackends(build_ext):
    """Hands each backend extension to its own build.py (ninja, one TU per variant)."""

    def build_extension(self, ext):
        backend = ext.name.split(".")[-2]
        module = load_build_module(backend)
        ext_path = os.path.abspath(self.get_ext_fullpath(ext.name))
        # Not self.build_temp: see persistent_build_dir (a second install reuses the objects).
        build_temp = load_ninja_build().persistent_build_dir(ROOT, backend, os.environ)
        os.makedirs(os.path.dirname(ext_path), exist_ok=True)
        module.build(ext_path, build_temp, dict(os.environ))

    def copy_extensions_to_source(self):
        # In-place and editable builds copy only the extension module itself; a
        # backend's sibling files (SIBLING_FILES in its build.py, e.g. the CUDA
        # kernels' libportattn_cuda.so that _C loads via rpath $ORIGIN) must follow it.
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            module = load_build_module(ext.name.split(".")[-2])
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            for name in getattr(module, "SIBLING_FILES", ()):
                self.copy_file(os.path.join(os.path.dirname(regular_file), name),
                               os.path.join(os.path.dirname(inplace_file), name), level=self.verbose)


ext_modules = [Extension(f"portattn.backends.{name}._C", sources=[]) for name in chosen_backends()]

setup(
    name="portattn",
    version="0.2.0",
    description="Hardware-portable exact attention (FlashAttention-class kernels) for PyTorch on NVIDIA and AMD GPUs",
    long_description=open(os.path.join(ROOT, "README.md")).read() if os.path.exists(os.path.join(ROOT, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["portattn", "portattn.*"]),
    # torch is a run-time requirement only; no version pin, since nothing links libtorch.
    install_requires=["torch>=2.4"],
    # Everything the test suite imports (tests/test_install_extras.py keeps this list
    # complete): matplotlib for the benchmark plots, pybind11 for the ROCm emulation
    # build, ring-flash-attn for the context-parallel tests, transformers for
    # tests/test_transformers_integration.py (pure Python, about 20 s to install), hypothesis
    # for the property-based tests (tests/test_properties.py), pytest-xdist to run the suite on
    # two processes (README's test command; tests/conftest.py groups the tests by file, and the
    # ROCm emulation by family: much of the suite's time is single-threaded compiles), ninja so
    # the tests' builds run the ninja the install ran (backends/ninja_build.py says why).
    extras_require={"test": ["pytest>=7", "pytest-xdist>=3", "numpy", "hypothesis>=6", "matplotlib", "pybind11>=2.12",
                             "ring-flash-attn>=0.1.8,<0.2", "transformers>=4.57", "ninja"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildBackends},
    entry_points={"console_scripts": ["portattn-report=portattn.report:main"]},
    zip_safe=False,
)
