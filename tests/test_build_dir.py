"""A second `pip install` reuses the first one's objects: one persistent ninja folder per backend."""
import importlib.util
import os
import shutil
import sys

import pytest
import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ninja_build = _load("_test_ninja_build", os.path.join(ROOT, "portattn", "backends", "ninja_build.py"))


def test_persistent_build_dir_is_in_the_source_tree_or_the_override(tmp_path):
    assert ninja_build.persistent_build_dir(ROOT, "cuda", {}) == os.path.join(ROOT, ".portattn_build", "cuda")
    override = {"PORTATTN_BUILD_DIR": str(tmp_path)}
    assert ninja_build.persistent_build_dir(ROOT, "rocm", override) == str(tmp_path / "rocm")
    assert ".portattn_build/" in open(os.path.join(ROOT, ".gitignore")).read().split()


def test_setup_hands_every_install_the_same_build_dir(monkeypatch, tmp_path):
    """Two installs (setuptools gives each its own temporary build_temp) build in one folder."""
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.setenv("PORTATTN_BACKENDS", "none")
    monkeypatch.setenv("PORTATTN_BUILD_DIR", str(tmp_path / "objects"))
    setup_module = _load("_test_setup", os.path.join(ROOT, "setup.py"))
    seen = []
    fake_backend = type(sys)("fake_build")
    fake_backend.build = lambda ext_path, build_temp, env: seen.append(build_temp)
    monkeypatch.setattr(setup_module, "load_build_module", lambda backend: fake_backend)
    for install in ("first", "second"):
        command = captured["cmdclass"]["build_ext"](setuptools.Distribution())
        command.initialize_options()
        command.build_temp = str(tmp_path / f"setuptools-temp-{install}")
        command.build_lib = str(tmp_path / f"lib-{install}")
        command.inplace = False
        command.get_ext_fullpath = lambda name, lib=command.build_lib: os.path.join(lib, *name.split(".")) + ".so"
        command.build_extension(setuptools.Extension("portattn.backends.cuda._C", sources=[]))
    assert seen == [str(tmp_path / "objects" / "cuda")] * 2


def test_ninja_rebuilds_only_what_changed(tmp_path):
    """A tiny build through the same NinjaBuild the backends use: the second run compiles nothing."""
    if shutil.which("ninja") is None and ninja_build._ninja_from_pip() is None:
        pytest.skip("ninja is not installed (pip install ninja)")
    log = tmp_path / "compiled.log"
    sources = []
    for name in ("a.cu", "b.cu"):
        path = tmp_path / name
        path.write_text(f"// {name}\n")
        sources.append(str(path))

    def run():
        build = ninja_build.NinjaBuild(str(tmp_path / "build"))
        objects = []
        for source in sources:
            obj = source + ".o"
            # "$0"/"$1" reach sh literally; ninja substitutes $in and $out.
            build.compiles.append(ninja_build.CompileStep(
                source=source, output=obj,
                command=["sh", "-c", f'cp "$0" "$1" && basename "$0" >> {log}', "$in", "$out"]))
            objects.append(obj)
        build.links.append(ninja_build.LinkStep(inputs=objects, output=str(tmp_path / "lib.so"),
                                                command=["sh", "-c", 'cat "$@" > lib.tmp && mv lib.tmp "$0"', "$out", "$in"]))
        build.run({"MAX_JOBS": "1"})

    run()
    assert sorted(log.read_text().split()) == ["a.cu", "b.cu"]
    run()  # a second install: nothing changed, nothing compiles
    assert sorted(log.read_text().split()) == ["a.cu", "b.cu"]
    (tmp_path / "b.cu").write_text("// b.cu, edited\n")
    os.utime(tmp_path / "b.cu", (os.path.getmtime(tmp_path / "a.cu") + 10,) * 2)
    run()
    assert sorted(log.read_text().split()) == ["a.cu", "b.cu", "b.cu"]
