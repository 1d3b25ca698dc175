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


def test_convert_doc_states_the_progress_threshold_of_the_code() -> None:
    """docs/commands/convert.md says when the progress bar starts: the CLI's own threshold (it said 256 MiB)."""
    from ckptool.cli._common import PROGRESS_MIN

    text = (ROOT / "docs" / "commands" / "convert.md").read_text(encoding="utf-8")
    pattern = r"progress bar when stderr is a terminal and the data is over (\d+) MiB"
    stated = {int(n) for n in re.findall(pattern, text)}
    assert stated == {PROGRESS_MIN >> 20}


def test_readme_installs_from_the_repository() -> None:
    """ckptool is not on a package index: the README's install lines install the checkout, not a name pip would look
    up on an index."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert not re.search(r"^pip install '?ckptool", text, re.M)
    assert re.search(r"^pip install \.", text, re.M)


def test_inspect_help_names_every_registry_format() -> None:
    """``inspect --help`` lists the formats it prints: every entry of the registry (it named 7 of 11)."""
    from ckptool.readers import FORMATS

    r = CliRunner().invoke(cli, ["inspect", "--help"], terminal_width=400)
    listed = re.search(r"Prints the format \(([^)]*)\)", " ".join(r.output.split()))
    assert listed is not None, r.output
    assert [f.strip() for f in listed.group(1).split(",")] == list(FORMATS)
