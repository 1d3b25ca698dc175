"""What a newcomer meets first (issue 37): the bare command and the documents' statements about the commands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptool.cli import COMMANDS, cli

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.torchfree


def test_bare_ckptool_prints_the_help_on_stdout_and_exits_0() -> None:
    """``ckptool`` alone prints the normal multi-line help to stdout and exits 0, as ``git`` does (Click >= 8.2
    would make it a one-line usage error on stderr, exit 2)."""
    r = subprocess.run([sys.executable, "-m", "ckptool"], capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert r.stdout.startswith("Usage: ckptool [OPTIONS] COMMAND [ARGS]...\n")
    assert "Commands:" in r.stdout and len(r.stdout.splitlines()) > 20
    assert not r.stdout.startswith("Error")


def test_bare_ckptool_through_click_runner() -> None:
    r = CliRunner().invoke(cli, [])
    assert r.exit_code == 0
    assert "Commands:" in r.output and "\n  inspect " in r.output


def test_readme_command_table_names_every_command() -> None:
    """The README's table of commands lists every command the CLI has (rename, filter and average were missing)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first_cells = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `ckptool ")]
    table = {m.group(1) for cell in first_cells for m in re.finditer(r"`(?:ckptool )?([a-z][a-z-]*)", cell)}
    missing = sorted(set(COMMANDS) - table)
    assert not missing, f"README's command table lacks {missing}"
