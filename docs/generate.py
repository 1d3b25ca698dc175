#!/usr/bin/env python3
"""Refresh the ``--help`` blocks of the command reference in ``docs/commands/``.

Each page holds, for every command it documents, a block::

    <!-- help: remap -->
    ```
    ...the output of `ckptool remap --help`...
    ```
    <!-- /help -->

``python docs/generate.py`` rewrites every such block from the installed CLI; ``python docs/generate.py --check``
exits 1 when a block differs (``tests/test_docs.py`` runs the same check, so the pages never drift from ``--help``).

It also rewrites the ``<!-- matrix -->`` ... ``<!-- /matrix -->`` block of ``docs/formats.md`` from the support
table of ``ckptool/ops/matrix.py`` (format x operation: works, refused with its reason and route, or a known bug),
which is generated from the registry of formats (each entry's ``Format.support`` row, ``ckptool/readers``).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from click.testing import CliRunner

from ckptool.cli import COMMANDS, cli
from ckptool.ops.matrix import FORMAT_LABELS, FORMATS, MATRIX, OPERATIONS

DOCS = Path(__file__).resolve().parent / "commands"
FORMATS_PAGE = DOCS.parent / "formats.md"
MATRIX_BLOCK = re.compile(r"(<!-- matrix -->\n).*?(<!-- /matrix -->)", re.S)
_SYMBOL = {"works": "✓", "refused": "✗", "bug": "⚠"}
BLOCK = re.compile(r"(<!-- help: ([\w-]+) -->\n)```\n(?:(?:(?!<!-- /help -->).)*?\n)?```\n(<!-- /help -->)", re.S)


def help_text(command: str) -> str:
    """``ckptool COMMAND --help`` as printed at 100 columns (the CLI's ``max_content_width``)."""
    args = [command, "--help"] if command != "ckptool" else ["--help"]
    res = CliRunner().invoke(cli, args, prog_name="ckptool", terminal_width=100)
    if res.exit_code != 0:
        raise SystemExit(f"ckptool {command} --help failed: {res.output}")
    return res.output.rstrip("\n")


def render(text: str) -> str:
    """``text`` with every help block refreshed."""
    return BLOCK.sub(lambda m: f"{m.group(1)}```\n{help_text(m.group(2))}\n```\n{m.group(3)}", text)


def matrix_markdown() -> str:
    """The support table of :mod:`ckptool.ops.matrix` as Markdown: one row per format, one column per operation,
    then every refusal (✗) and known bug (⚠) with the phrase it prints and the nearest route that works."""
    head = "| format | " + " | ".join(f"`{op}`" for op in OPERATIONS) + " |"
    lines = [head, "|---" * (len(OPERATIONS) + 1) + "|"]
    for fmt in FORMATS:
        cells = " | ".join(_SYMBOL[MATRIX[fmt, op].status] + (f" {MATRIX[fmt, op].reason}" if op == "scan" else "")
                           for op in OPERATIONS)
        lines.append(f"| `{fmt}`: {FORMAT_LABELS[fmt]} | {cells} |")
    bugs = any(cell.status == "bug" for cell in MATRIX.values())
    legend = ("✓ works, ✗ refused with one `Error:` line (exit 1 or 2)"
              + (", ⚠ a known bug (what it prints today). " if bugs else ". ")
              + f"{sum(c.status == 'works' for c in MATRIX.values())} of {len(MATRIX)} cells work. "
              "`prefix` stands for strip-dataparallel, strip-prefix, add-prefix and unwrap; `load_into` is "
              "`ckptool.load_into`; `scan` shows the verdict on the fixture (DeepSpeed's optimizer files call "
              "`fragment_address`, a function torch would run).")
    lines += ["", legend, ""]
    for fmt in FORMATS:
        groups: dict[tuple[str, str, str], list[str]] = {}
        for op in OPERATIONS:
            cell = MATRIX[fmt, op]
            if cell.status != "works":
                groups.setdefault((cell.status, cell.reason, cell.route), []).append(f"`{op}`")
        for (status, reason, route), ops in groups.items():
            lines.append(f"- `{fmt}` {', '.join(ops)}: {_SYMBOL[status]} \"{reason}\"; instead: {route}")
    return "\n".join(lines) + "\n"


def render_matrix(text: str) -> str:
    """``text`` (``docs/formats.md``) with its matrix block rewritten from :func:`matrix_markdown`."""
    return MATRIX_BLOCK.sub(lambda m: f"{m.group(1)}{matrix_markdown()}{m.group(2)}", text)


def documented() -> set[str]:
    """The commands that have a help block somewhere under ``docs/commands``."""
    return {m.group(2) for page in DOCS.glob("*.md") for m in BLOCK.finditer(page.read_text(encoding="utf-8"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if a page differs from --help (write nothing)")
    args = ap.parse_args()
    stale = []
    for page in sorted(DOCS.glob("*.md")):
        old = page.read_text(encoding="utf-8")
        new = render(old)
        if new != old:
            stale.append(page.name)
            if not args.check:
                page.write_text(new, encoding="utf-8")
    old = FORMATS_PAGE.read_text(encoding="utf-8")
    new = render_matrix(old)
    if not MATRIX_BLOCK.search(old):
        print(f"{FORMATS_PAGE.name} has no <!-- matrix --> block", file=sys.stderr)
        return 1
    elif new != old:
        stale.append(FORMATS_PAGE.name)
        if not args.check:
            FORMATS_PAGE.write_text(new, encoding="utf-8")
    missing = sorted(set(COMMANDS) - documented())
    if missing:
        print(f"commands without a help block in docs/commands: {', '.join(missing)}", file=sys.stderr)
    if args.check and stale:
        print(f"out of date (run python docs/generate.py): {', '.join(stale)}", file=sys.stderr)
    return 1 if (args.check and stale) or missing else 0


if __name__ == "__main__":
    sys.exit(main())
