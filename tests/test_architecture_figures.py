"""Issue 35's figures of ``ckptool/`` (``tools/architecture_figures.py``, also a CI gate): no format-name comparison
or parser call outside the readers layer, no private name imported across modules, no function above complexity 20,
at most 12 modules directly in ``ops/``, at most 8 tensor / storage classes."""

from __future__ import annotations

import importlib.util
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
