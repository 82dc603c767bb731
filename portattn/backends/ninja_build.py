"""A tiny ninja-file writer shared by the compiled backends' build.py (torch-free).

Each translation unit is one `compile` edge, so ninja builds variants in parallel
(MAX_JOBS caps it) and a changed file rebuilds only itself; `depfile` keeps header
dependencies exact. The link step is one edge per output.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass
class CompileStep:
    source: str
    output: str
    command: Sequence[str]  # full argv; "$in", "$out", "$depfile" are substituted by ninja
    depfile: str | None = None


@dataclass
class LinkStep:
    inputs: Sequence[str]
    output: str
    command: Sequence[str]


@dataclass
class NinjaBuild:
    build_dir: str
    compiles: list = field(default_factory=list)
    links: list = field(default_factory=list)

    def write(self) -> str:
        lines = ["ninja_required_version = 1.3", ""]
        for index, step in enumerate(self.compiles):
            lines.append(f"rule compile_{index}")
            lines.append(f"  command = {_join(step.command)}")
            if step.depfile:
                lines.append(f"  depfile = {step.depfile}")
                lines.append("  deps = gcc")
            lines.append(f"  description = compile {os.path.basename(step.source)}")
            lines.append(f"build {_esc(step.output)}: compile_{index} {_esc(step.source)}")
            lines.append("")
        for index, step in enumerate(self.links):
            lines.append(f"rule link_{index}")
            lines.append(f"  command = {_join(step.command)}")
            lines.append(f"  description = link {os.path.basename(step.output)}")
            inputs = " ".join(_esc(path) for path in step.inputs)
            lines.append(f"build {_esc(step.output)}: link_{index} {inputs}")
            lines.append("")
        os.makedirs(self.build_dir, exist_ok=True)
        path = os.path.join(self.build_dir, "build.ninja")
        text = "\n".join(lines)
        # Rewrite only on change so ninja's own bookkeeping stays valid.
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as handle:
                handle.write(text)
        return path

    def run(self, env: Mapping[str, str]) -> None:
        self.write()
        # The `ninja` package's binary first: pip builds the install with it (a build requirement),
        # and a ninja of another version hashes command lines differently (1.11 and the current
        # package disagree), so it would take every object in this folder for stale. With the
        # package in the [test] extra too, the ROCm ISA test reuses the install's objects: CI's
        # ISA build took 605 s on one worker when /usr/bin/ninja 1.11 recompiled all of them.
        ninja = _ninja_from_pip() or shutil.which("ninja")
        if ninja is None:
            raise RuntimeError("portattn: building a compiled backend needs ninja (pip install ninja)")
        jobs = env.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run([ninja, "-C", self.build_dir, "-j", jobs], check=True)


def persistent_build_dir(source_root: str, backend: str, env: Mapping[str, str]) -> str:
    """Where a backend's objects live between installs: PORTATTN_BUILD_DIR/<backend>, by
    default <source tree>/.portattn_build/<backend> (git-ignored).

    setuptools hands build_ext a fresh temporary build_temp for editable installs (and a
    different one per install kind), so objects kept there are lost and a second
    `pip install` recompiled every kernel. In one fixed folder, ninja's own bookkeeping
    (.ninja_log: outputs, command lines, depfiles) rebuilds only what changed.
    """
    base = env.get("PORTATTN_BUILD_DIR") or os.path.join(source_root, ".portattn_build")
    return os.path.join(os.path.abspath(base), backend)


def _ninja_from_pip() -> str | None:
    try:
        import ninja  # type: ignore
    except ImportError:
        return None
    candidate = os.path.join(ninja.BIN_DIR, "ninja")
    return candidate if os.path.exists(candidate) else None


def _esc(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _join(argv: Sequence[str]) -> str:
    # $in/$out/$depfile must reach ninja unquoted; everything else is shell-quoted.
    ninja_vars = {"$in", "$out", "$depfile"}
    return " ".join(arg if arg in ninja_vars else shlex.quote(arg).replace("$", "$$") for arg in argv)
