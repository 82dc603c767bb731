"""Host C++ drivers for the backends/common headers: those headers are host/device code, so
the CPU tests compile a small driver against them as plain C++ and talk to it over stdin/stdout
(tests/test_seq_bounds.py, tests/test_block_range.py)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

COMMON = os.path.join(os.path.dirname(__file__), "..", "portattn", "backends", "common")


def compile_driver(tmp_path_factory, name: str, source: str, flags: tuple = ()) -> str:
    """Path of the driver built from `source` (skips the test module without a C++ compiler).
    `flags`: extra compiler flags (e.g. -Wno-unknown-pragmas for headers with `#pragma unroll`)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    folder = tmp_path_factory.mktemp(name)
    path = folder / "driver.cpp"
    path.write_text(source)
    binary = folder / "driver"
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", *flags, f"-I{COMMON}", str(path), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    return str(binary)


def run_driver(driver: str, lines: list) -> list:
    """The driver's answer to each input line, as a tuple of ints (one output line per input line)."""
    done = subprocess.run([driver], input="".join(line + "\n" for line in lines), check=True,
                          capture_output=True, text=True)
    rows = [tuple(map(int, line.split())) for line in done.stdout.splitlines()]
    assert len(rows) == len(lines)
    return rows
