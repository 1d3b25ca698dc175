"""The README stays short and points at the command reference in docs/, whose `--help` blocks match the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptool.cli import COMMANDS

pytestmark = pytest.mark.torchfree

ROOT = Path(__file__).resolve().parents[1]


def test_command_pages_match_help() -> None:
    """`python docs/generate.py --check` fails when a page's --help block differs from the CLI's (or a command has
    no page)."""
    res = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], capture_output=True,
                         text=True, check=False, cwd=ROOT)
    assert res.returncode == 0, res.stderr


def test_every_command_has_a_help_block() -> None:
    text = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs" / "commands").glob("*.md"))
    assert set(COMMANDS) <= set(re.findall(r"<!-- help: ([\w-]+) -->", text))


def test_readme_is_short_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 250
    assert "<!-- main-command -->" in readme and "<!-- test-command -->" in readme
    for target in re.findall(r"\]\(((?:docs|fixtures)/[^)#]+)\)", readme):
        assert (ROOT / target).exists(), target
    for page in (ROOT / "docs").rglob("*.md"):
        for target in re.findall(r"\]\((\.\.?/[^)#]+)\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).resolve().exists(), (page, target)
