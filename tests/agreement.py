"""What ``inspect --json``, ``scan --json``, ``report --json``, ``diff --json X X`` and ``sanitize`` say about one
checkpoint (:func:`answers`), and where they disagree on format, kind, tensor count or verdict
(:func:`disagreements`): the oracle of :mod:`tests.test_agreement` (issue 46). Every command runs in-process
(Click's runner; sanitize through its API into a temporary folder)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from ckptool.cli import cli
from ckptool.errors import CkptError
from ckptool.model.verdict import EXIT_CODES, Verdict

#: the formats whose pickles ``sanitize`` rewrites (the others it refuses with advice)
SANITIZED = {"torch-zip", "torch-legacy", "pickle"}
#: scan's exit statuses from worst to best (a folder: the worst file decides)
_WORST_FIRST = (1, 2, 4, 5, 0)


@dataclass
class Answer:
    """One command's answer: ``ok`` (it read the checkpoint), and what it said (None: not said)."""

    ok: bool
    format: str | None = None
    kind: str | None = None
    tensors: int | None = None
    verdict: str | None = None
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _run(*args: object) -> tuple[int, Any]:
    r = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    try:
        return r.exit_code, json.loads(r.stdout)
    except ValueError:
        return r.exit_code, r.output.strip()[-400:]


def _worst(verdicts: list[str]) -> str:
    codes = {EXIT_CODES[Verdict(v)]: v for v in verdicts}
    return next(codes[c] for c in _WORST_FIRST if c in codes)


def answers(path: Path, tmp: Path) -> dict[str, Answer]:
    """Each command's :class:`Answer` about ``path`` (``tmp``: a folder for report's page and sanitize's output)."""
    out: dict[str, Answer] = {}
    code, d = _run("inspect", "--json", path)
    out["inspect"] = (Answer(True, d["format"], d["kind"], len(d["tensors"]), d["security"]["verdict"])
                      if code == 0 and isinstance(d, dict) else Answer(False, error=str(d)))
    code, d = _run("scan", "--json", path)
    if isinstance(d, dict) and d.get("files"):
        files = d["files"]
        fmt = files[0]["format"] if len(files) == 1 else None
        out["scan"] = Answer(True, fmt, verdict=_worst([f["verdict"] for f in files]), extra={"exit": code})
    else:
        out["scan"] = Answer(False, error=str(d), extra={"exit": code})
    page = tmp / f"{path.name}.report.html"
    code, d = _run("report", "--json", path, "-o", page, "--force")
    out["report"] = (Answer(True, d["a"]["format"], d["a"]["kind"], d["a"]["tensors"], d["a"]["verdict"])
                     if code == 0 and isinstance(d, dict) else Answer(False, error=str(d)))
    if code == 0:
        import re

        shown = re.search(r'data-verdict="([^"]+)"', page.read_text(encoding="utf-8"))
        out["report"].extra["page"] = shown.group(1) if shown else None
    code, d = _run("diff", "--json", "--keys-only", path, path)
    out["diff"] = (Answer(True, d["format_a"], extra={"identical": d["identical"], "exit": code})
                   if code in (0, 1) and isinstance(d, dict) else Answer(False, error=str(d)))
    if out["inspect"].ok and out["inspect"].format in SANITIZED:
        from ckptool.ops.sanitize import sanitize

        try:
            res = sanitize(path, tmp / f"{path.name}.sanitized.pt", drop_unknown=True)
            out["sanitize"] = Answer(True, res.format_in)
        except CkptError as e:
            out["sanitize"] = Answer(False, error=str(e))
    return out


def disagreements(path: Path, tmp: Path) -> list[str]:
    """Where the commands disagree about ``path`` (empty: they agree):

    * a checkpoint ``inspect`` reads, ``report`` reads with the same format, kind, tensor count and verdict (its
      JSON and its page); ``diff X X`` gives the same format and finds it identical; ``scan`` gives the same
      verdict (a folder: its worst file's) and, for one file, the same format; ``sanitize`` the same format;
    * one ``inspect`` refuses, ``report`` and ``diff`` refuse too, and ``scan`` never calls it safe unless it
      is no torch checkpoint at all (a plain zip, a pickle of protocol 0 or 1, a file of another type).
    """
    a = answers(path, tmp)
    ins, sc, rep, dif = a["inspect"], a["scan"], a["report"], a["diff"]
    bad: list[str] = []
    if ins.ok:
        want = (ins.format, ins.kind, ins.tensors, ins.verdict)
        if not rep.ok or (rep.format, rep.kind, rep.tensors, rep.verdict) != want:
            bad.append(f"report {rep} vs inspect {want}")
        elif rep.extra.get("page") != ins.verdict:
            bad.append(f"report page says {rep.extra.get('page')}, inspect {ins.verdict}")
        if dif.ok and dif.format != ins.format:
            bad.append(f"diff format {dif.format} vs inspect {ins.format}")
        if dif.ok and not dif.extra["identical"]:
            bad.append("diff X X finds a difference")
        if not sc.ok or sc.verdict != ins.verdict:
            bad.append(f"scan verdict {sc.verdict} ({sc.error[:200]}) vs inspect {ins.verdict}")
        if sc.format is not None and sc.format != ins.format and path.is_file():
            bad.append(f"scan format {sc.format} vs inspect {ins.format}")
        san = a.get("sanitize")
        if san is not None and san.ok and san.format != ins.format:
            bad.append(f"sanitize format {san.format} vs inspect {ins.format}")
    else:
        if rep.ok:
            bad.append(f"report reads what inspect refuses ({ins.error[:200]})")
        if dif.ok:
            bad.append(f"diff reads what inspect refuses ({ins.error[:200]})")
        if sc.ok and sc.verdict == "safe" and sc.format not in (None, "zip", "unknown"):
            bad.append(f"scan says safe ({sc.format}) what inspect refuses ({ins.error[:200]})")
    return bad
