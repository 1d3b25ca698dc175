"""What ``inspect --json``, ``scan --json``, ``report --json``, ``diff --json X X`` and ``sanitize --dry-run --json``
say about one checkpoint (:func:`answers`), and where they disagree on format, kind, tensor count or verdict
(:func:`disagreements`): the oracle of :mod:`tests.test_agreement` (issue 46). Every command runs in-process
(Click's runner)."""

from __future__ import annotations

import io
import json
import pickle
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from ckptool.cli import cli

#: the formats of a PyTorch checkpoint (the registry's, and torch's legacy tar), spelled out here so that the oracle
#: does not take them from the code it checks: a file inspect refuses may be scanned as safe only when scan names
#: it something else (a plain zip, a gzip or 7z wrapper whose content is safe, a NumPy array, a config): both then
#: say what the file is; a checkpoint inspect cannot read is never vouched for
CHECKPOINT_FORMATS = frozenset({
    "torch-zip", "torch-legacy", "torchscript", "torch-package", "safetensors", "sharded-safetensors", "sharded-bin",
    "dcp", "torch-export", "deepspeed", "megatron-legacy", "megatron-dist", "pickle", "legacy-tar"})
#: scan's verdicts from worst to best (a folder: the worst file decides; the order of its exit statuses 1, 2, 4, 5,
#: 0), spelled out here so that the oracle does not take them from the code it checks
_WORST_FIRST = ("dangerous", "error", "needs-trust", "incomplete", "safe")


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
    return next((v for v in _WORST_FIRST if v in verdicts), verdicts[0])


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
    # sanitize rewrites one file; its dry run says what the path is (a set or a folder: refused) and writes nothing
    code, d = _run("sanitize", "--dry-run", "--json", "--drop-unknown", path, "-o", tmp / "sanitized.pt",
                   "--force")
    out["sanitize"] = (Answer(True, d["format"], d["kind"], d["tensors"], d["verdict"],
                              extra={"exit": code, "exit_code": d["exit_code"], "error": d["error"]})
                       if isinstance(d, dict) else Answer(False, error=str(d), extra={"exit": code}))
    return out


def disagreements(path: Path, tmp: Path) -> list[str]:
    """Where the commands disagree about ``path`` (empty: they agree):

    * a checkpoint ``inspect`` reads, ``report`` reads with the same format, kind, tensor count and verdict (its
      JSON and its page); ``diff X X`` gives the same format and finds it identical; ``scan`` gives the same
      verdict (a folder: its worst file's) and, for one file, the same format; ``sanitize --dry-run`` the same
      format and verdict, and the same kind and tensor count where it reads the pickle (the formats it rewrites),
      and exits with the status its JSON gives (what a run would exit with);
    * one ``inspect`` refuses, ``report`` and ``diff`` refuse too, and ``scan`` never calls it safe unless it
      is no torch checkpoint at all (:data:`CHECKPOINT_FORMATS`).
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
        if san is not None and not san.ok:
            bad.append(f"sanitize --dry-run says nothing of what inspect reads ({san.error[:200]})")
        elif san is not None:
            said = (san.format, san.verdict, *(x for x in (san.kind, san.tensors) if x is not None))
            want_s = (ins.format, ins.verdict, *(w for x, w in ((san.kind, ins.kind), (san.tensors, ins.tensors))
                                                  if x is not None))
            if said != want_s:
                bad.append(f"sanitize --dry-run {said} vs inspect {want_s}")
            if san.extra["exit"] != san.extra["exit_code"]:
                bad.append(f"sanitize --dry-run exits {san.extra['exit']}, its JSON says {san.extra['exit_code']}")
    else:
        if rep.ok:
            bad.append(f"report reads what inspect refuses ({ins.error[:200]})")
        if dif.ok:
            bad.append(f"diff reads what inspect refuses ({ins.error[:200]})")
        san = a.get("sanitize")
        if san is not None and san.ok and san.extra["error"] is None:
            bad.append(f"sanitize --dry-run would write what inspect refuses ({ins.error[:200]})")
        if sc.ok and sc.verdict == "safe" and sc.format in CHECKPOINT_FORMATS:
            bad.append(f"scan says safe ({sc.format}) what inspect refuses ({ins.error[:200]})")
    return bad


# ------------------------------------------------------------------------------------------------ variants
def _members(data: bytes) -> list[zipfile.ZipInfo]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return z.infolist()


def rezip(data: bytes, *, add: dict[str, bytes] | None = None, drop: frozenset[str] = frozenset(),
          rename: dict[str, str] | None = None) -> bytes:
    """The zip ``data`` with the members ``drop`` left out, ``rename`` applied and ``add`` appended (stored)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst, \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Duplicate name")  # a duplicate is a variant made on purpose
        for info in src.infolist():
            if info.filename in drop:
                continue
            body = src.read(info)  # (the member itself: a duplicate name's own bytes)
            info.filename = (rename or {}).get(info.filename, info.filename)
            dst.writestr(info, body)
        for name, body in (add or {}).items():
            dst.writestr(name, body)
    return out.getvalue()


#: a small pickle that names only allowed globals
BENIGN = pickle.dumps({"step": 3, "lr": 0.5}, protocol=2)


def zip_variants(data: bytes) -> dict[str, bytes]:
    """Variants of the zip ``data`` (a torch zip or TorchScript archive): members added (a pickle, TorchScript
    source, a ``constants.pkl``, torch.package's ``extern_modules``, a second member of a name it holds), removed
    (``data.pkl``, a tensor record, ``version``, ``constants.pkl``), renamed (``data.pkl`` in capitals, to another
    name) and the whole cut short."""
    names = [m.filename for m in _members(data)]
    top = names[0].split("/")[0] + "/" if "/" in names[0] else ""
    data_pkl = next((n for n in names if n.lower() == f"{top}data.pkl".lower()), None)
    record = next((n for n in names if n.startswith(f"{top}data/")), None)
    added = {"add-pickle": (f"{top}extra.pkl", BENIGN),
             "add-code": (f"{top}code/__torch__/extra.py", b"def f(x):\n    return x\n"),
             "add-extern-modules": (f"{top}.data/extern_modules", b"")}
    out = {kind: rezip(data, add={name: body}) for kind, (name, body) in added.items() if name not in names}
    # a member added under a name the zip holds already (a zip-confusion: every command refuses it, scan's verdict
    # is error), data.pkl's and the last member's (a tensor record, or a TorchScript archive's)
    for kind, name in (("duplicate-data-pkl", data_pkl), ("duplicate-last", names[-1])):
        if name is not None:
            out[kind] = rezip(data, add={name: BENIGN})
    out["cut-half"] = data[: len(data) // 2]
    out["cut-tail"] = data[: len(data) - 30]
    if f"{top}constants.pkl" not in names:
        out["add-constants"] = rezip(data, add={f"{top}constants.pkl": BENIGN})
    if data_pkl:
        out["drop-data-pkl"] = rezip(data, drop=frozenset({data_pkl}))
        out["rename-data-pkl-upper"] = rezip(data, rename={data_pkl: f"{top}DATA.PKL"})
        out["rename-data-pkl-other"] = rezip(data, rename={data_pkl: f"{top}data2.pkl"})
    if record:
        out["drop-record"] = rezip(data, drop=frozenset({record}))
    for leaf in ("version", "constants.pkl"):
        if f"{top}{leaf}" in names:
            out[f"drop-{leaf}"] = rezip(data, drop=frozenset({f"{top}{leaf}"}))
    return out


def variants(path: Path) -> dict[str, bytes]:
    """Variants of the checkpoint file at ``path``: :func:`zip_variants` for a zip, else the file cut short."""
    data = path.read_bytes()
    if data[:4] == b"PK\x03\x04":
        try:
            return zip_variants(data)
        except (zipfile.BadZipFile, IndexError):
            pass
    return {"cut-half": data[: len(data) // 2], "cut-tail": data[: len(data) - 30]}
