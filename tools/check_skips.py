"""Every skipped test of a pytest run, with its reason, checked against the allowed reasons of .ci/allowed-skips.txt.

    python tools/check_skips.py JUNIT_XML [--allowed FILE]

JUNIT_XML is pytest's ``--junitxml`` report. Prints one line per skipped test (``SKIP <test>: <reason>``, then the
allowed reason's label, or ``NOT ALLOWED``), then a count per allowed reason, and exits 1 when a test skipped for a
reason the file does not allow (or the report cannot be read: exit 2). A module skipped as a whole at collection
(``pytest.importorskip`` at the top of a file) counts as one skip named after the module.

The allowed-reasons file: blocks of ``#`` comment lines (why the reason is allowed) followed by one regular
expression (Python ``re.search`` on the skip message). A pattern line may start with a condition, ``[no-apt]``:
allowed only where .ci/run cannot install Debian packages (not root, or no ``apt-get``), the same test .ci/run makes
before it installs chromium and xfsprogs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ALLOWED = Path(__file__).resolve().parents[1] / ".ci" / "allowed-skips.txt"


@dataclass(frozen=True)
class Allowed:
    pattern: re.Pattern[str]
    why: str
    condition: str | None


def apt_available() -> bool:
    """True where .ci/run installs Debian packages: root and ``apt-get`` on PATH."""
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get") is not None


def read_allowed(path: Path) -> list[Allowed]:
    """The allowed reasons of ``path``; raises ValueError for a pattern without a comment or one that is no regex."""
    out: list[Allowed] = []
    why: list[str] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = line.strip()
        if not text:
            why = []
        elif text.startswith("#"):
            why.append(text.lstrip("#").strip())
        else:
            condition = None
            m = re.match(r"\[([a-z-]+)\]\s*", text)
            if m:
                condition, text = m.group(1), text[m.end():]
                if condition != "no-apt":
                    raise ValueError(f"{path}:{n}: unknown condition [{condition}]")
            if not why:
                raise ValueError(f"{path}:{n}: the pattern {text!r} has no comment saying why it is allowed")
            try:
                out.append(Allowed(re.compile(text), " ".join(why), condition))
            except re.error as e:
                raise ValueError(f"{path}:{n}: {text!r} is not a regular expression: {e}") from e
            why = []
    return out


def skipped(junit: Path) -> list[tuple[str, str]]:
    """(test id, skip message) of each skipped test case of a pytest junit XML report."""
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for skip in case.findall("skipped"):
            name = "::".join(p for p in (case.get("classname", ""), case.get("name", "")) if p)
            message = skip.get("message") or ""
            if message == "collection skipped":  # the reason is in the text: "(path, line, 'Skipped: reason')"
                text = (skip.text or "").strip()
                m = re.search(r"Skipped: (.*)[\"']\)$", text, re.S)
                message = m.group(1) if m else text
            out.append((name, message.strip()))
    return out


def check(skips: list[tuple[str, str]], allowed: list[Allowed], apt: bool) -> tuple[list[str], list[str]]:
    """The report's lines and the lines of the skips no allowed reason covers."""
    lines, bad = [], []
    counts: dict[str, int] = {}
    for name, message in skips:
        hit = next((a for a in allowed if a.pattern.search(message) and not (a.condition == "no-apt" and apt)),
                   None)
        if hit is None:
            bad.append(f"{name}: {message}")
            lines.append(f"SKIP {name}: {message}  -- NOT ALLOWED")
        else:
            counts[hit.pattern.pattern] = counts.get(hit.pattern.pattern, 0) + 1
            lines.append(f"SKIP {name}: {message}  -- allowed ({hit.pattern.pattern})")
    lines.append(f"{len(skips)} skipped: {len(skips) - len(bad)} for allowed reasons, {len(bad)} not allowed")
    lines += [f"  {n:4d}  {p}" for p, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    return lines, bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--allowed", type=Path, default=DEFAULT_ALLOWED)
    args = parser.parse_args(argv)
    try:
        allowed = read_allowed(args.allowed)
        skips = skipped(args.junit)
    except (OSError, ValueError, ET.ParseError) as e:
        print(f"check_skips: {e}", file=sys.stderr)
        return 2
    lines, bad = check(skips, allowed, apt_available())
    print("\n".join(lines))
    if bad:
        print(f"check_skips: {len(bad)} test(s) skipped for a reason .ci/allowed-skips.txt does not allow:",
              file=sys.stderr)
        print("\n".join(f"  {b}" for b in bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
