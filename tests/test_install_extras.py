"""The `[test]` extra installs every package the test suite imports (a fresh venv passes)."""
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
# Installed by the README's first step or by the package itself, not by the extra.
PROVIDED = {"torch", "portattn", "setuptools", "_pytest", "flash_attn"}  # flash_attn: portattn.compat
# pip name -> import name, where they differ.
IMPORT_NAMES = {"ring-flash-attn": "ring_flash_attn"}


def _test_extra() -> set:
    text = open(os.path.join(ROOT, "setup.py")).read()
    listed = re.search(r'extras_require=\{"test": \[(.*?)\]\}', text, re.S).group(1)
    names = set()
    for requirement in re.findall(r'"([^"]+)"', listed):
        name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
        names.add(IMPORT_NAMES.get(name, name))
    return names


def _imported_top_level(path: str) -> set:
    tree = ast.parse(open(path).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names  # pytest.importorskip(...) names are optional: those tests skip with the reason


def test_every_third_party_import_of_the_tests_is_in_the_extra():
    extra = _test_extra()
    # The tests' own helper modules (tests/, tests/gpu/) and bench/ (and bench/tools/) scripts they import.
    local = {name[:-3] for folder in (TESTS, os.path.join(TESTS, "gpu"), os.path.join(ROOT, "bench"),
                                      os.path.join(ROOT, "bench", "tools"))
             for name in os.listdir(folder) if name.endswith(".py")}
    missing = {}
    for folder, _, files in os.walk(TESTS):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for module in _imported_top_level(path):
                if module in sys.stdlib_module_names or module in PROVIDED or module in local or module in extra:
                    continue
                missing.setdefault(module, []).append(os.path.relpath(path, ROOT))
    assert not missing, f"add to setup.py's [test] extra (or skip with a reason): {missing}"


def test_extra_has_what_the_issue_found_missing():
    # transformers: tests/test_transformers_integration.py (the HF integration, issue 12 item 6).
    assert {"pytest", "matplotlib", "pybind11", "ring_flash_attn", "transformers"} <= _test_extra()
