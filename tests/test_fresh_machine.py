"""What a fresh machine sees: every supported Python, no package installed by hand, the public API as typed.

- the error table: an ImportError of the standard library is a bug in ckptool (exit 3, "report it"), never advice
  to ``pip install --upgrade typing``; nothing in ckptool needs Python 3.11+ (``pyproject.toml`` claims 3.10);
- ``fixtures/`` and ``tests/`` are on ``sys.path`` (tests/conftest.py), so no folder there may pose as a package a
  test imports (``fixtures/deepspeed/`` did: ``import deepspeed`` passed without deepspeed installed);
- ``typing.get_type_hints`` resolves every public function of ``ckptool.__all__`` (where torch is missing, the torch
  functions' hints raise ``ModuleNotFoundError`` naming torch, never ``NameError``);
- the errors live in ``ckptool.errors``; the rename functions are overloaded (a path gives a ``RenameResult``, a
  mapping a mapping of its own type); ``safetensors`` is imported only by ``torch_ops`` and comes with that extra;
- the usage errors the README promises print the ``Try 'ckptool CMD --help'`` line.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import ckptool
from ckptool.cli._errors import EXIT_BUG, EXIT_FAILURE, describe_error
from ckptool.errors import CkptError

pytestmark = pytest.mark.torchfree

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(ckptool.__file__).resolve().parent
LPIPS = ROOT / "fixtures" / "real" / "lpips-v0.1-alex.pth"


# ------------------------------------------------------------------------------------------------ error table
@pytest.mark.parametrize("exc", [
    ImportError("cannot import name 'Never' from 'typing' (/usr/lib/python3.10/typing.py)", name="typing"),
    ModuleNotFoundError("No module named 'tomllib'", name="tomllib"),
    ImportError("cannot import name 'UTC' from 'datetime'", name="datetime"),
    ModuleNotFoundError("No module named '_lzma'", name="_lzma"),
])
def test_a_standard_library_import_error_is_an_internal_error(exc: ImportError) -> None:
    message, code = describe_error(exc)
    assert code == EXIT_BUG
    assert message.startswith("internal error (a bug in ckptool): ") and "report it" in message
    assert str(exc).split(" (")[0] in message and "pip install" not in message
    assert "Python 3." in message  # the version whose standard library lacked it


@pytest.mark.parametrize("exc, advice", [
    (ModuleNotFoundError("No module named 'yaml'", name="yaml"), "pip install pyyaml"),
    (ModuleNotFoundError("No module named 'torch'", name="torch"), "pip install 'ckptool[torch]'"),
    (ModuleNotFoundError("No module named 'safetensors'", name="safetensors"), "pip install 'ckptool[torch]'"),
    (ImportError("cannot import name 'x' from 'tqdm'", name="tqdm"), "pip install --upgrade tqdm"),
])
def test_a_missing_or_broken_package_still_gets_pip_advice(exc: ImportError, advice: str) -> None:
    message, code = describe_error(exc)
    assert code == EXIT_FAILURE and message.endswith(advice), message


def test_the_command_reports_a_standard_library_import_error_as_a_bug(run_cli, monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """As ``typing.Never`` on Python 3.10 did, end to end: one line, exit 3, no pip advice."""
    import ckptool.cli.inspect as cli_inspect

    def fail(*args: object, **kwargs: object) -> None:
        raise ImportError("cannot import name 'Never' from 'typing'", name="typing")

    monkeypatch.setattr(cli_inspect, "inspect", fail)
    src = shutil.copy(LPIPS, tmp_path / "a.pth")
    r = run_cli("inspect", src)
    assert r.exit_code == EXIT_BUG, r.output
    (line,) = r.output.strip().splitlines()
    assert line.startswith("Error: internal error (a bug in ckptool): ImportError: cannot import name 'Never'")
    assert "pip install" not in line


# Python 3.11+ only: names of typing and other modules, and modules (pyproject.toml claims >= 3.10)
_NEW_TYPING = {"Never", "Self", "LiteralString", "TypeVarTuple", "Unpack", "Required", "NotRequired", "assert_never",
               "assert_type", "reveal_type", "dataclass_transform", "get_overloads", "clear_overloads", "override",
               "TypeAliasType", "ReadOnly", "TypeIs"}
_NEW_NAMES = {"typing": _NEW_TYPING, "enum": {"StrEnum", "verify", "ReprEnum", "global_enum"},
              "datetime": {"UTC"}, "hashlib": {"file_digest"}, "itertools": {"batched"},
              "asyncio": {"TaskGroup", "timeout", "Runner"}, "operator": {"call"}}
_NEW_MODULES = {"tomllib", "wsgiref.types"}


def _python_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _python_files(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_nothing_needs_python_3_11(path: Path) -> None:
    """Python 3.10's grammar parses every module, and none imports a 3.11+ name of the standard library (the CI job
    on Python 3.10 runs the torch-free suite; this finds the cause at once, on any Python)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), feature_version=(3, 10))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in _NEW_NAMES:
            found += [f"{node.module}.{a.name}" for a in node.names if a.name in _NEW_NAMES[node.module]]
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [m for m in mods if m in _NEW_MODULES]
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.attr in _NEW_NAMES.get(node.value.id, ())):
            found.append(f"{node.value.id}.{node.attr}")
    assert not found, f"{path}: Python 3.11+ only: {found}"


# ------------------------------------------------------------------------------------------------ sys.path
def _imported_top_names() -> set[str]:
    names: set[str] = set()
    for folder in (ROOT / "tests", ROOT / "fixtures"):
        for path in folder.glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
                elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args
                      and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                    names.add(node.args[0].value.split(".")[0])
    return names


def test_no_folder_on_the_test_path_poses_as_a_package() -> None:
    """tests/conftest.py puts fixtures/ and tests/ on sys.path; a folder there named like a package a test imports
    would import as an empty namespace package where the package is not installed, so a guard such as ``import
    deepspeed`` passes and the test fails further on (``No module named 'deepspeed.utils'``)."""
    assert str(ROOT / "fixtures") in sys.path  # the conftest this guards against
    names = _imported_top_names()
    assert {"deepspeed", "torch", "safetensors"} <= names
    posing = []
    for name in sorted(names):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin is None:  # a namespace package: only folders, no __init__.py
            inside = [p for p in (spec.submodule_search_locations or []) if Path(p).resolve().is_relative_to(ROOT)]
            if inside:
                posing.append((name, inside))
    assert not posing, f"folders that import as packages: {posing}"


def test_every_fixture_folder_name_is_not_importable() -> None:
    """The folders of fixtures/ that hold files, not modules, carry a name Python cannot import (a hyphen), or one
    no test imports."""
    names = _imported_top_names()
    for folder in (ROOT / "fixtures").iterdir():
        if folder.is_dir() and folder.name.isidentifier() and folder.name != "__pycache__":
            assert folder.name not in names, folder


# ------------------------------------------------------------------------------------------------ the API
def _public_functions() -> list[str]:
    return sorted(n for n in ckptool.__all__ if inspect.isfunction(getattr(ckptool, n)))


def _needs_torch(fn: typing.Any) -> bool:
    return fn.__module__.startswith("ckptool.torch_ops.") and fn.__module__ != "ckptool.torch_ops.portable"


@pytest.mark.parametrize("name", _public_functions())
def test_type_hints_of_every_public_function_resolve(name: str) -> None:
    from conftest import has_torch

    fn = getattr(ckptool, name)
    if has_torch() or not _needs_torch(fn):
        hints = typing.get_type_hints(fn)
        assert "return" in hints
    else:  # the annotations name torch classes: resolving them needs torch, and says so
        with pytest.raises(ModuleNotFoundError, match="torch"):
            typing.get_type_hints(fn)


def test_load_into_hints_are_torch_classes() -> None:
    torch = pytest.importorskip("torch")
    hints = typing.get_type_hints(ckptool.load_into)
    assert hints["model"] is torch.nn.Module
    assert torch.device in typing.get_args(hints["device"])
    assert typing.get_type_hints(ckptool.verify)["return"] is ckptool.VerifyReport


def test_errors_live_in_ckptool_errors_and_old_paths_still_work() -> None:
    import ckptool.errors as errors
    from ckptool.ops import convert
    from ckptool.ops.convert import verify
    from ckptool.torch_ops import reports

    assert errors.VerificationError is convert.VerificationError is verify.VerificationError
    assert errors.VerificationError is ckptool.VerificationError
    assert errors.StateDictMismatchError is reports.StateDictMismatchError is ckptool.StateDictMismatchError
    for cls in (errors.VerificationError, errors.StateDictMismatchError):
        assert issubclass(cls, CkptError) and cls.__module__ == "ckptool.errors"
    report = object()
    assert errors.StateDictMismatchError("x", report).report is report


def test_rename_functions_are_overloaded_for_paths_and_mappings(tmp_path: Path) -> None:
    """mypy sees a RenameResult for a path and the mapping's own type for a mapping; a file-only argument with a
    mapping is a type error."""
    if not (PACKAGE.parent / "pyproject.toml").is_file():
        pytest.skip("ckptool is installed, not a source checkout: mypy would check the installed copy")
    pytest.importorskip("mypy")
    pytest.importorskip("torch", reason="mypy follows ckptool.torch_ops into torch's own types")
    snippet = tmp_path / "use.py"
    snippet.write_text(
        "from collections import OrderedDict\n"
        "import ckptool\n"
        "reveal_type(ckptool.strip_dataparallel(OrderedDict(a=1)))\n"
        "reveal_type(ckptool.strip_prefix('a.pth', 'model.'))\n"
        "reveal_type(ckptool.add_prefix({'a': 1}, 'module.'))\n"
        "reveal_type(ckptool.unwrap('a.pth', 'b.pth', to='cpu'))\n"
        "reveal_type(ckptool.rename_state_dict({'a': 1}, str.upper))\n"
        "ckptool.unwrap({'a': 1}, 'b.pth')\n", encoding="utf-8")
    res = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
                          "--no-error-summary", str(snippet)], cwd=PACKAGE.parent, capture_output=True, text=True,
                         check=False, timeout=600)
    revealed = [t.replace("builtins.", "") for t in re.findall(r'Revealed type is "([^"]+)"', res.stdout)]
    assert revealed == ["collections.OrderedDict[str, int]", "ckptool.ops.rewrite.stream.RenameResult",
                        "dict[str, int]",
                        "ckptool.ops.rewrite.stream.RenameResult", "dict[str, int]"], res.stdout
    assert re.search(r"use\.py:8: error: No overload variant of \"unwrap\"", res.stdout), res.stdout


def test_safetensors_is_imported_only_by_torch_ops_and_comes_with_the_torch_extra() -> None:
    outside = []
    for path in _python_files():
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(m.split(".")[0] == "safetensors" for m in mods) and not rel.startswith("torch_ops/"):
                outside.append(rel)
    assert not outside, outside
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    base = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.S | re.M)
    torch_extra = re.search(r"^torch = \[(.*?)\]", pyproject, re.M)
    assert base and torch_extra
    assert "safetensors" not in base.group(1) and "safetensors" in torch_extra.group(1)


def test_convert_checks_with_its_own_reader_without_the_safetensors_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """NumPy installed but not safetensors (``pip install ckptool numpy``): the check must not import safetensors."""
    from ckptool.torch_ops import convert_verify

    monkeypatch.setattr(convert_verify, "is_installed", lambda module: module != "safetensors")
    assert convert_verify.safetensors_framework({"float32"}) is None
    monkeypatch.setattr(convert_verify, "is_installed", lambda module: True)
    assert convert_verify.safetensors_framework({"float32"}) == "numpy"


# ------------------------------------------------------------------------------------------------ usage errors
@pytest.mark.parametrize("args, command, message", [
    (["inspect", "missing.pth"], "inspect", "missing.pth: no such file"),
    (["remap", "a.pth", "--to", "gpu9"], "remap", "unknown device 'gpu9'"),
    (["remap", "a.pth", "--to", "cpu", "-o", "exists.pth"], "remap", "output exists.pth exists"),
    (["remap", "a.pth", "--to", "cpu", "-o", "a.pth"], "remap", "output a.pth is the input file"),
    (["strip-dataparallel", "a.pth", "-o", "a.pth"], "strip-dataparallel", "output a.pth is the input file"),
])
def test_usage_errors_say_where_the_usage_is(args: list[str], command: str, message: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The README: exit 2, one ``Error: ...`` line plus ``Try 'ckptool CMD --help' for help.``"""
    shutil.copy(LPIPS, tmp_path / "a.pth")
    (tmp_path / "exists.pth").write_bytes(b"keep")
    res = subprocess.run([sys.executable, "-m", "ckptool", *args], cwd=tmp_path, capture_output=True, text=True,
                         check=False, timeout=120)
    assert res.returncode == 2 and res.stdout == "", res
    error, hint = res.stderr.splitlines()
    assert error.startswith(f"Error: {message}"), res.stderr
    assert hint == f"Try 'ckptool {command} --help' for help."
    assert (tmp_path / "exists.pth").read_bytes() == b"keep"


def test_readme_names_the_lines_the_signals_print() -> None:
    """SIGINT prints ``Interrupted: ...``, SIGTERM ``Terminated: ...`` (tests/test_signals.py); the README says both."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`Interrupted: nothing was written to OUT`" in readme
    assert "`Terminated: nothing was written to OUT`" in readme


def test_the_demo_prints_calls_of_public_functions() -> None:
    """The Python lines the demo prints (``ckptool.remap(...)``) call names of ``ckptool``;
    ``ckptool.ops.rewrite.remap`` is a module."""
    source = (PACKAGE / "demo" / "run.py").read_text(encoding="utf-8")
    called = set(re.findall(r"\bckptool\.([\w.]+)\(", source))
    assert called
    for name in called:
        assert name in ckptool.__all__ and callable(getattr(ckptool, name)), name
