"""Shared pytest fixtures: the generated checkpoints, the real ones, and a Click runner for the CLI.

``fixtures/`` and ``tests/`` are put on ``sys.path`` here, so tests can ``import make_fixtures``,
``import fixture_models`` (needed to unpickle full-model fixtures) and ``from helpers import ...``.
Nothing here imports ``ckptool`` (or torch) at import time.

Without torch (``pip install ckptool`` without the ``torch`` extra; ``.ci/run`` runs ``pytest -m torchfree`` in
such an environment) only test modules that carry the ``torchfree`` marker are collected (the others import torch
at the top), and the generated fixtures, which need torch to be made, are read from :data:`FIXTURES_ENV`, where a
run with torch wrote them; where that folder holds none, tests that need them are skipped.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES_DIR = REPO / "fixtures"
TESTS_DIR = REPO / "tests"
for _p in (FIXTURES_DIR, TESTS_DIR):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

#: the local servers of the remote tests (fixtures ``s3``, ``http``, ``plain_http``), defined once for the session
pytest_plugins = ["remote_servers"]

#: a folder for the generated fixtures: a run with torch writes them there, a run without torch reads them from there
FIXTURES_ENV = "CKPTOOL_FIXTURES_DIR"


@functools.cache
def has_torch() -> bool:
    """True when ``import torch`` works here (it is then imported)."""
    try:
        importlib.import_module("torch")
    except ImportError:
        return False
    return True


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Without torch, leave out test modules that do not mention the ``torchfree`` marker: they import torch."""
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_") or has_torch():
        return None
    return True if "torchfree" not in collection_path.read_text(encoding="utf-8") else None


def _shared_fixtures() -> Path | None:
    folder = os.environ.get(FIXTURES_ENV)
    return Path(folder) if folder else None


@pytest.fixture(scope="session")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every generated fixture, name -> path (see ``make_fixtures.MANIFEST``), built once per session, into
    ``$CKPTOOL_FIXTURES_DIR`` when set (else a temporary folder). Without torch they are read from
    ``$CKPTOOL_FIXTURES_DIR`` (its ``manifest.json`` lists them); the test is skipped when it holds none.

    Treat the files as read-only: copy one into ``tmp_path`` before a test changes it in place.
    """
    shared = _shared_fixtures()
    if has_torch():
        import make_fixtures

        return make_fixtures.build_all(shared or tmp_path_factory.mktemp("generated"))
    if shared is None or not (shared / "manifest.json").is_file():
        pytest.skip(f"the generated fixtures need torch to be made; set {FIXTURES_ENV} to a folder where a run with "
                    "torch wrote them")
    names = json.loads((shared / "manifest.json").read_text(encoding="utf-8"))
    return {name: shared / name for name in sorted(names)}


@pytest.fixture(scope="session")
def manifest() -> dict[str, Any]:
    """What each generated fixture holds: ``make_fixtures.MANIFEST`` (name -> ``FixtureInfo``). Without torch the
    same fields (``description``, ``kind``, ``tags`` as a frozenset, ``full_model``, ``torch_loads``) are read from
    ``$CKPTOOL_FIXTURES_DIR/manifest.json``; the test is skipped when there is none."""
    if has_torch():
        import make_fixtures

        return dict(make_fixtures.MANIFEST)
    shared = _shared_fixtures()
    if shared is None or not (shared / "manifest.json").is_file():
        pytest.skip(f"the fixture manifest needs torch; set {FIXTURES_ENV} to a folder where a run with torch "
                    "wrote it")
    raw = json.loads((shared / "manifest.json").read_text(encoding="utf-8"))
    return {name: types.SimpleNamespace(**{**info, "tags": frozenset(info["tags"])}) for name, info in raw.items()}


@pytest.fixture(scope="session")
def real_dir() -> Path:
    """``fixtures/real``: unchanged checkpoints published by other projects (see its README.md)."""
    return FIXTURES_DIR / "real"


@pytest.fixture
def run_cli() -> Callable[..., Any]:
    """``run_cli(*args, **invoke_kwargs) -> click.testing.Result``: run the ``ckptool`` Click group in-process.

    Arguments are converted with ``str`` (so ``Path`` objects can be passed). Exceptions that are not
    ``SystemExit`` propagate (``catch_exceptions=False``) unless the caller passes ``catch_exceptions=True``.
    """
    from click.testing import CliRunner

    from ckptool.cli import cli  # imported here: conftest must load before the package exists

    def invoke(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("catch_exceptions", False)
        return CliRunner().invoke(cli, [str(a) for a in args], **kwargs)

    return invoke


@pytest.fixture
def shipped(tmp_path: Path) -> Iterator[Any]:
    """Import modules from source written under ``tmp_path`` (``shipped(name, source)``), removed afterwards (the
    model code a torch.package archive interns, in the package tests)."""
    folder = tmp_path / "src"
    folder.mkdir()
    sys.path.insert(0, str(folder))
    names: list[str] = []

    def load(name: str, source: str) -> Any:
        (folder / f"{name}.py").write_text(source, encoding="utf-8")
        names.append(name)
        return importlib.import_module(name)

    yield load
    sys.path.remove(str(folder))
    for name in names:
        sys.modules.pop(name, None)
