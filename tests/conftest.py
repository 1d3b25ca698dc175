"""Shared pytest fixtures: the generated checkpoints, the real ones, and a Click runner for the CLI.

``fixtures/`` and ``tests/`` are put on ``sys.path`` here, so tests can ``import make_fixtures``,
``import fixture_models`` (needed to unpickle full-model fixtures) and ``from helpers import ...``.
Nothing here imports ``ckptool`` at import time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES_DIR = REPO / "fixtures"
TESTS_DIR = REPO / "tests"
for _p in (FIXTURES_DIR, TESTS_DIR):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import make_fixtures


@pytest.fixture(scope="session")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every generated fixture, name -> path (see ``make_fixtures.MANIFEST``), built once per session.

    Treat the files as read-only: copy one into ``tmp_path`` before a test changes it in place.
    """
    return make_fixtures.build_all(tmp_path_factory.mktemp("generated"))


@pytest.fixture(scope="session")
def manifest() -> dict[str, make_fixtures.FixtureInfo]:
    """What each generated fixture holds: ``make_fixtures.MANIFEST``."""
    return make_fixtures.MANIFEST


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
