"""Statements of the documentation held to the code (issue 37, item 3: what a newcomer reads agrees with what the
tool does): the formats and kinds ``docs/commands/inspect.md`` lists are those ``inspect --help`` lists and the
registry holds; the progress threshold the pages give is the CLI's; README's command table names every command
and says how to install from the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckptool.cli import COMMANDS
from ckptool.cli._common import PROGRESS_MIN
from ckptool.readers import FORMATS

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.torchfree


def _help(command: str) -> str:
    from click.testing import CliRunner

    from ckptool.cli import cli

    res = CliRunner().invoke(cli, [command, "--help"], terminal_width=100)
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def _bullet(page: str, start: str) -> str:
    """The text of the bullet of ``page`` starting with ``start`` (to the next bullet), on one line."""
    text = (ROOT / page).read_text(encoding="utf-8")
    m = re.search(rf"^- {re.escape(start)}(.*?)(?=^- |\Z)", text, re.S | re.M)
    assert m is not None, f"{page}: no bullet starting with {start!r}"
    return " ".join(m.group(1).split())


def test_inspect_page_lists_the_formats_of_the_help_and_the_registry() -> None:
    help_text = _help("inspect")
    listed = re.search(r"Prints the format \(([^)]*)\)", help_text)
    assert listed is not None, help_text
    in_help = {f.strip().replace("- ", "-") for f in listed.group(1).split(",")}
    assert in_help == set(FORMATS)
    in_page = set(re.findall(r"`([a-z-]+)`", _bullet("docs/commands/inspect.md", "Formats recognised")))
    assert in_page >= set(FORMATS), sorted(set(FORMATS) - in_page)


def test_inspect_page_lists_the_kinds_of_the_help() -> None:
    help_text = _help("inspect")
    listed = re.search(r"the kind \(([^)]*)\)", help_text)
    assert listed is not None, help_text
    in_help = {k.strip() for k in listed.group(1).split(",")}
    in_page = set(re.findall(r"`([a-z_]+)`", _bullet("docs/commands/inspect.md", "Kinds:")))
    assert in_page >= in_help, sorted(in_help - in_page)


def test_the_progress_threshold_the_pages_give_is_the_cli_s() -> None:
    said = []
    for page in sorted((ROOT / "docs" / "commands").glob("*.md")):
        text = " ".join(page.read_text(encoding="utf-8").split())
        said += [(page.name, m) for m in re.finditer(r"progress bar[^.]*?(?:over|more than) (\d+) MiB", text)]
    assert any(name == "convert.md" for name, _m in said)
    for name, m in said:
        assert int(m.group(1)) << 20 == PROGRESS_MIN, (name, m.group(0))


def test_readme_names_every_command_and_installs_from_the_repository() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = "\n".join(line for line in readme.splitlines() if line.startswith("| `ckptool"))
    for name in COMMANDS:
        assert re.search(rf"`(?:ckptool )?{re.escape(name)}[` ]", table), f"README's command table lacks {name}"
    assert "pip install ckptool" not in readme  # not on an index: from the repository, or a wheel built from it
    assert "pip install ." in readme and "wheel" in readme
