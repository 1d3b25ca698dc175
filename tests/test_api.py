"""The public API: ``ckptool.__all__`` lists real objects with real types, and no submodule shadows them."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import ckptool

pytestmark = pytest.mark.torchfree  # needs no torch: .ci/run also runs it where torch is not installed

ROOT = Path(__file__).resolve().parents[1]


def _all_submodules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(ckptool.__path__, "ckptool.") if ".demo" not in m.name]


def test_every_public_name_resolves_to_a_function_or_class() -> None:
    for name in ckptool.__all__:
        value = getattr(ckptool, name)
        assert not isinstance(value, types.ModuleType), name
        assert callable(value), name


def test_lazy_names_come_from_the_module_named_in_the_table() -> None:
    for name, mod in ckptool._LAZY.items():
        assert name in ckptool.__all__
        assert getattr(ckptool, name) is getattr(importlib.import_module(mod), name)


def test_no_submodule_shares_a_name_with_a_public_function() -> None:
    top = {m.name for m in pkgutil.iter_modules(ckptool.__path__)}
    assert not top & set(ckptool.__all__)


def test_importing_every_submodule_leaves_the_public_functions_in_place() -> None:
    """Before the layered package, ``import ckptool.convert`` replaced the function ``ckptool.convert``."""
    code = (
        "import importlib, types, ckptool\n"
        f"for m in {_all_submodules()!r}: importlib.import_module(m)\n"
        "bad = [n for n in ckptool.__all__ if isinstance(getattr(ckptool, n), types.ModuleType)]\n"
        "assert not bad, bad\n"
        "assert callable(ckptool.convert) and callable(ckptool.inspect) and callable(ckptool.scan)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_importing_ckptool_imports_neither_torch_nor_the_torch_layer() -> None:
    code = (
        "import sys, ckptool\n"
        "assert 'torch' not in sys.modules\n"
        "heavy = ('ckptool.torch_ops', 'ckptool.ops.convert', 'ckptool.demo')\n"
        "loaded = [m for m in sys.modules if m.startswith(heavy)]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ckptool.nope  # noqa: B018


def test_type_checkers_see_real_types(tmp_path: Path) -> None:
    """mypy sees the lazily loaded names with their real signatures (not ``Any``): misuse is an error."""
    api = pytest.importorskip("mypy.api")
    snippet = tmp_path / "use_api.py"
    snippet.write_text(
        "import ckptool\n"
        "a: int = ckptool.convert\n"
        "b: int = ckptool.load_into\n"
        "c: int = ckptool.inspect('x').tensors\n"
        "d: int = ckptool.scan_file('x')\n"
    )
    out, _err, status = api.run(["--strict", "--no-incremental", "--follow-imports=silent", str(snippet)])
    assert status == 1, out
    assert out.count("Incompatible types in assignment") == 4, out
