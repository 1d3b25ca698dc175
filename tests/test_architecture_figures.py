"""Issue 35's figures of ``ckptool/`` (``tools/architecture_figures.py``, also a CI gate): no format-name comparison
or parser call outside the readers layer, no private name imported across modules, no function above complexity 20,
at most 12 modules directly in ``ops/``, at most 8 tensor / storage classes."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.torchfree


def _figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("architecture_figures", ROOT / "tools" / "architecture_figures.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("figure", ["format-name comparisons", "parser calls", "private imports",
                                    "complex functions", "modules in ops/", "tensor classes",
                                    "single-format facts", "upward plug-ins", "format-module imports"])
def test_figure_within_its_limit(figure: str) -> None:
    figures = _figures()
    found = figures.FIGURES[figure]()
    assert len(found) <= figures.LIMITS[figure], "\n".join(found)


def test_the_checks_see_what_they_count(tmp_path: Path) -> None:
    """Each check finds a planted case (so a figure of 0 means none, not a check that cannot see)."""
    figures = _figures()
    code = (
        "from ckptool.formats import detect\n"
        "from ckptool.formats.sharded import read_index\n"
        "from ckptool.scanning.pickles import _Scanner\n"
        "class WideTensor: pass\n"
        "def f(fmt, p, a, b, c, d, e):\n"
        "    if fmt == 'dcp' or fmt == detect.TORCH_ZIP:\n"
        "        return read_index(p)\n"
        "    return " + " or ".join(f"(a and b and c and d and e and {i})" for i in range(5)) + "\n"
        "def g(opened):\n"
        "    from ckptool.cli.scan import main\n"
        "    return opened.spec.header, opened.spec.tagged, 'ckptool.cli.inspect:main', main\n"
    )
    planted = figures.PKG / "ops" / "_planted_for_test.py"
    planted.write_text(code, encoding="utf-8")
    try:
        assert any("_planted_for_test" in p for p in figures.format_comparisons())
        assert sum("_planted_for_test" in p for p in figures.format_comparisons()) == 2
        assert any("_planted_for_test" in p and "read_index" in p for p in figures.parser_calls())
        assert any("_planted_for_test" in p and "_Scanner" in p for p in figures.private_imports())
        assert any("_planted_for_test" in p for p in figures.complex_functions())
        assert any("_planted_for_test" in p for p in figures.tensor_classes())
        assert sum("_planted_for_test" in p for p in figures.single_format_facts()) == 2
        assert sum("_planted_for_test" in p for p in figures.upward_plugins()) == 2
        assert sum("_planted_for_test" in p for p in figures.format_module_imports()) == 2
    finally:
        planted.unlink()


def test_format_module_imports_inside_functions_and_in_strings_count(tmp_path: Path) -> None:
    """An import inside a function and a ``"ckptool.formats.<module>:function"`` plug-in string that name a format's
    own module count as much as an import line at the top: hiding one in a function or a string does not bring the
    figure down (the shared tensor model, ``formats.tensors`` / ``dtypes`` / ``nodes``, is not counted)."""
    figures = _figures()
    code = (
        "from ckptool.formats.tensors import Source\n"
        "from ckptool.formats.dtypes import element_size\n"
        "def f(p):\n"
        "    from ckptool.formats.torch_package import read_package\n"
        "    import ckptool.formats.pt2\n"
        "    return read_package(p), 'ckptool.formats.detect:zip_kind', 'ckptool.formats.pt2', Source\n"
    )
    planted = figures.PKG / "torch_ops" / "_planted_for_test.py"
    planted.write_text(code, encoding="utf-8")
    try:
        found = [p for p in figures.format_module_imports() if "_planted_for_test" in p]
        assert sorted(int(p.rsplit(":", 1)[1]) for p in found) == [4, 5, 6, 6], found
    finally:
        planted.unlink()


def test_the_format_modules_are_every_format_module_and_import_linter_forbids_them() -> None:
    """The figure's ``FORMAT_MODULES`` are every module of ``ckptool/formats`` but the shared tensor model (issue 46:
    ops, cli and torch_ops use ``formats.tensors``, ``dtypes``, ``nodes``, the readers and the writers), and
    pyproject.toml's import-linter contract for ops, cli and torch_ops forbids exactly those, so that
    ``lint-imports`` holds the figure at 0 in CI."""
    figures = _figures()
    shared = {"__init__", "tensors", "dtypes", "nodes"}
    on_disk = {p.stem for p in (figures.PKG / "formats").glob("*.py")} - shared
    assert on_disk == figures.FORMAT_MODULES
    assert figures.LIMITS["format-module imports"] == 0
    # the contract's table, read without a TOML parser (Python 3.10 has none in its standard library)
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = text.split('name = "The operations read and write through the readers and writers', 1)[1]
    block = block.split("[[tool.importlinter.contracts]]", 1)[0]
    lists = {k: re.findall(r'"([^"]+)"', v) for k, v in re.findall(r"^(\w+) = (\[[^\]]*\])", block, re.M)}
    assert sorted(lists["source_modules"]) == ["ckptool.cli", "ckptool.ops", "ckptool.torch_ops"]
    assert {m.removeprefix("ckptool.formats.") for m in lists["forbidden_modules"]} == on_disk
