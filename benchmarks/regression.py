"""Regression check: this checkout's ckptool against another commit's, in the same run (issue 26).

``python benchmarks/bench.py --against [REF]`` (REF: any git ref, default ``HEAD~1``) runs this instead of the other
figures. It

1. exports REF's ``ckptool/`` package with ``git archive REF ckptool | tar -x -C DIR`` into a temporary folder under
   the work dir (no network, no install) and compiles it to bytecode as the checkout is
   (:func:`children.compile_checkout`). Each side runs in the same interpreter with its own folder first on
   ``PYTHONPATH``; a probe child checks that ``import ckptool`` really resolves to that folder on each side;
2. measures, for the checkout ("current": the working tree, uncommitted changes included) and REF, interleaved round
   by round (the side that goes first alternates, and both sides of a figure run back to back, so a change in the
   machine's load hits them alike), from a warm page cache after ``os.sync`` (as bench.py's other figures do):

   * ``python -m ckptool inspect --json FILE`` of checkpoint (2), the ``--many`` (50,000) tensors;
   * ``python -m ckptool remap FILE --to cpu -o OUT`` of checkpoint (1), ``--size-gib`` (2) GiB;
   * ``python -m ckptool scan FILE`` of checkpoint (1) and of checkpoint (2) (issues 46 and 49: scan's speed on the
     2 GiB zip and on the 50,000 tensors);
   * ``ckptool.load_into(model, FILE)`` of checkpoint (1) in a ``python -c`` child that builds a model of the file's
     layout (``layers.{i}.weight``, uninitialised); its time is the load alone (``time.perf_counter`` around the
     call, the import of torch and ckptool excluded), its values are checked afterwards;

   wall time (whole process, ``Popen`` .. ``wait4``) and peak RSS (``ru_maxrss`` of ``wait4``) of every run;
3. prints one row per figure and unit: the median wall seconds (min-max) and the max peak RSS per side, the ratio
   current / REF and a verdict: ``no regression`` when the ratio is at most the tolerance (``--time-tolerance``,
   default 1.10; ``--rss-tolerance``, default 1.05), else ``REGRESSION``; ``n/a`` with the reason where a side
   failed. ``--json`` prints the same figures as JSON. The exit status is 1 on a regression (or a failure of the
   current side) only with ``--fail-on-regression``: a shared machine's noise is reported, it does not fail CI.

Where REF does not resolve (a shallow clone without ``HEAD~1``, a copy without ``.git`` as in ``.ci/run``), a line
says the comparison was skipped and why; the exit status is then 0 for the default ``HEAD~1`` and 2 for a REF that
was named. ``--smoke`` (without ``--against``) runs the comparison against ``HEAD~1`` on its small files after the
other smoke figures, with the same skip rule.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from children import REPO, child_env, compile_checkout, failure_summary, remove, run_child, settle, warm_cache

DEFAULT_REF = "HEAD~1"
TIME_TOLERANCE = 1.10
RSS_TOLERANCE = 1.05
FIGURES = ("inspect", "scan", "scan_many", "remap", "load_into")
SIDES = ("current", "ref")

LOAD_INTO_CHILD = r"""
import json, sys, time
import torch
from torch import nn
import ckptool
try:
    import ckptool.torch_ops.load  # the import is not the load (where the module exists)
except ImportError:
    pass
path, n, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))
model = nn.Module()
model.layers = nn.ModuleList(Layer() for _ in range(n))
t0 = time.perf_counter()
ckptool.load_into(model, path)
dt = time.perf_counter() - t0
for i in sorted({0, n // 2, n - 1}):
    w = model.layers[i].weight
    assert float(w[0, 0]) == float(i) and float(w[-1, -1]) == float(i), f"wrong values in layers.{i}.weight"
print(json.dumps({"load_s": dt, "ckptool": ckptool.__file__}))
"""

_PROBE = "import ckptool; print(ckptool.__file__)"


class Skipped(Exception):
    """The comparison cannot run (no git, no such ref, no ``ckptool/`` in it); the message says why."""


class RunFailed(Exception):
    """One measured run failed; the message is its one-line reason."""


def _git(repo: str, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=False)
    except FileNotFoundError as e:
        raise Skipped("git is not installed") from e


def resolve_ref(ref: str, repo: str = REPO) -> str:
    """The full commit id ``ref`` names in the git repository ``repo`` (``git rev-parse --verify REF^{commit}``).

    Raises :class:`Skipped` with the reason: ``repo`` is not the top of a git checkout (e.g. ``.ci/run``'s copy, even
    inside another repository), the ref does not
    resolve (saying so when the clone is shallow, where ``HEAD~1`` is often missing), or git is not installed."""
    top = _git(repo, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise Skipped(f"{repo} is not a git checkout (no .git)")
    if os.path.realpath(top.stdout.strip()) != os.path.realpath(repo):  # e.g. a copy inside another repository
        raise Skipped(f"{repo} is not a git checkout (no .git; the enclosing one is {top.stdout.strip()})")
    p = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if p.returncode == 0:
        return p.stdout.strip()
    shallow = _git(repo, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    raise Skipped(f"{ref!r} names no commit in {repo}" + (" (a shallow clone: fetch more history)" if shallow else ""))


def describe_current(repo: str = REPO) -> str:
    """What the current side is: ``working tree (HEAD <short id>)``, with ``+ uncommitted changes to ckptool/``
    when ``git status`` lists any there; ``working tree`` alone outside git."""
    head = _git(repo, "rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return "working tree"
    dirty = _git(repo, "status", "--porcelain", "--", "ckptool").stdout.strip()
    return f"working tree (HEAD {head.stdout.strip()}" + (" + uncommitted changes to ckptool/)" if dirty else ")")


def export_ref(commit: str, dest: str, repo: str = REPO) -> str:
    """Extract ``commit``'s ``ckptool/`` package into ``dest`` (``git archive COMMIT ckptool | tar -x -C DEST``) and
    compile it to bytecode; returns ``dest``, the folder to put first on ``PYTHONPATH``.

    Raises :class:`Skipped` when ``commit`` has no ``ckptool/`` or git/tar fail (their stderr's first line)."""
    with tempfile.TemporaryFile() as tar_file:
        p = subprocess.run(["git", "-C", repo, "archive", "--format=tar", commit, "ckptool"], stdout=tar_file,
                           stderr=subprocess.PIPE, text=False, check=False)
        if p.returncode != 0:
            why = failure_summary(p.stderr.decode(), p.returncode)
            raise Skipped(f"git archive {commit[:12]} ckptool failed: {why}")
        tar_file.seek(0)
        t = subprocess.run(["tar", "-x", "-C", dest], stdin=tar_file, stderr=subprocess.PIPE, check=False)
        if t.returncode != 0:
            why = failure_summary(t.stderr.decode(), t.returncode)
            raise Skipped(f"tar -x of {commit[:12]}'s ckptool failed: {why}")
    if not os.path.isfile(os.path.join(dest, "ckptool", "__init__.py")):
        raise Skipped(f"{commit[:12]} has no ckptool/__init__.py")
    compile_checkout(dest)
    return dest


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(root)]) == os.path.realpath(root)


def probe(root: str, workdir: str) -> str:
    """Where ``import ckptool`` resolves in a child run with ``root`` first on ``PYTHONPATH`` (the environment the
    measured runs get); raises :class:`Skipped` unless that is inside ``root`` (e.g. an installed copy won)."""
    rc, _wall, _kib, out, err = run_child([sys.executable, "-c", _PROBE], workdir, stdout=True, env=child_env(root))
    where = out.strip()
    if rc != 0 or not _under(where, root):
        why = failure_summary(err, rc) if rc else f"it imported {where}"
        raise Skipped(f"ckptool does not import from {root}: {why}")
    return where


@dataclass
class Series:
    """The runs of one figure on one side: wall seconds, peak RSS in KiB, or why it failed."""

    wall_s: list[float] = field(default_factory=list)
    maxrss_kib: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.wall_s) if self.wall_s and not self.error else None

    @property
    def peak_mib(self) -> float | None:
        return max(self.maxrss_kib) / 1024 if self.maxrss_kib and not self.error else None


def figure_command(key: str, files: dict[str, dict[str, object]], out: str) -> tuple[str, list[str]]:
    """``(input file, argv)`` of figure ``key`` (one of :data:`FIGURES`) on bench.py's ``files``."""
    py = sys.executable
    big, many = files["1"], files["2"]
    if key == "inspect":
        return str(many["path"]), [py, "-m", "ckptool", "inspect", "--json", str(many["path"])]
    if key in ("scan", "scan_many"):
        one = big if key == "scan" else many
        return str(one["path"]), [py, "-m", "ckptool", "scan", str(one["path"])]
    if key == "remap":
        return str(big["path"]), [py, "-m", "ckptool", "remap", str(big["path"]), "--to", "cpu", "-o", out]
    if key == "load_into":
        shape = [str(big["tensors"]), str(big["rows"]), str(big.get("cols", 1024))]
        return str(big["path"]), [py, "-c", LOAD_INTO_CHILD, str(big["path"]), *shape]
    raise ValueError(f"unknown figure {key!r}")


def run_once(key: str, root: str, files: dict[str, dict[str, object]], workdir: str) -> tuple[float, int]:
    """One measured run of figure ``key`` with the ckptool of ``root``: ``(seconds, peak RSS KiB)``. The seconds are
    the whole process's, except for ``load_into``: the load alone, as its child reports it.

    Raises :class:`RunFailed` when the child fails, remap writes no output, or the child's ckptool is not
    ``root``'s."""
    out = os.path.join(workdir, "regression-out.pt")
    src, cmd = figure_command(key, files, out)
    remove(out)
    settle()
    warm_cache(src)
    rc, wall, kib, stdout, err = run_child(cmd, workdir, stdout=key == "load_into", env=child_env(root))
    try:
        if rc != 0:
            raise RunFailed(failure_summary(err, rc))
        if key == "remap" and not (os.path.isfile(out) and os.path.getsize(out) > 0):
            raise RunFailed(f"remap exited 0 but wrote no {out}")
        if key == "load_into":
            doc = json.loads(stdout.strip().splitlines()[-1])
            if not _under(doc["ckptool"], root):
                raise RunFailed(f"the child imported {doc['ckptool']}, not the ckptool of {root}")
            wall = float(doc["load_s"])
    finally:
        remove(out)
    return wall, kib


def _measure(s: Series, key: str, side: str, root: str, files: dict[str, dict[str, object]], workdir: str,
             i: int, log: Callable[[str], None]) -> None:
    """Add run ``i`` of figure ``key`` on ``side`` to ``s``; a failure empties ``s`` and ends its runs."""
    if s.error:
        return
    try:
        wall, kib = run_once(key, root, files, workdir)
    except RunFailed as e:
        s.error = str(e)
        s.wall_s.clear()
        s.maxrss_kib.clear()
        log(f"  against {key:<9} {side:<7} run {i + 1}: FAILED ({e})")
        return
    s.wall_s.append(wall)
    s.maxrss_kib.append(kib)
    log(f"  against {key:<9} {side:<7} run {i + 1}: {wall:8.3f} s  {kib / 1024:8.1f} MiB")


@dataclass
class Comparison:
    """The figures of both sides: ``series[(figure, side)]``, side ``"current"`` or ``"ref"``."""

    ref: str
    commit: str
    current: str
    identical: bool
    repeat: int
    titles: dict[str, str]
    series: dict[tuple[str, str], Series]


def titles_for(files: dict[str, dict[str, object]]) -> dict[str, str]:
    """The row title of each figure, with the size of its input."""
    gib = int(str(files["1"]["bytes"])) / 2**30
    return {"inspect": f"inspect --json, {int(str(files['2']['tensors'])):,} tensors",
            "scan": f"scan, {gib:.2f} GiB",
            "scan_many": f"scan, {int(str(files['2']['tensors'])):,} tensors",
            "remap": f"remap --to cpu, {gib:.2f} GiB",
            "load_into": f"load_into, {gib:.2f} GiB (load alone)"}


def compare(ref: str, files: dict[str, dict[str, object]], workdir: str, repeat: int, log: Callable[[str], None],
            *, figures: tuple[str, ...] = FIGURES, repo: str = REPO, current_root: str = REPO) -> Comparison:
    """Measure ``figures`` on the ckptool of ``current_root`` and on the one of ``ref`` in ``repo``, ``repeat``
    rounds, interleaved (see the module docstring). Raises :class:`Skipped` when ``ref`` cannot be exported."""
    commit = resolve_ref(ref, repo)
    export = tempfile.mkdtemp(prefix="ref-", dir=workdir)
    try:
        roots = {"current": current_root, "ref": export_ref(commit, export, repo)}
        for side, root in roots.items():
            log(f"  against: {side} side imports {probe(root, workdir)}")
        identical = _git(repo, "diff", "--quiet", commit, "--", "ckptool").returncode == 0
        series = {(k, s): Series() for k in figures for s in SIDES}
        for i in range(repeat):
            order = SIDES if i % 2 == 0 else SIDES[::-1]  # who goes first alternates
            for key in figures:
                for side in order:
                    _measure(series[(key, side)], key, side, roots[side], files, workdir, i, log)
    finally:
        shutil.rmtree(export, ignore_errors=True)
    return Comparison(ref, commit, describe_current(repo), identical, repeat, titles_for(files), series)


def verdict(current: float | None, ref: float | None, tolerance: float) -> tuple[float | None, str]:
    """``(current / ref, verdict)``: ``"no regression"`` when the ratio is at most ``tolerance``, else
    ``"REGRESSION"``; ``(None, "n/a")`` when a figure is missing or ``ref`` is not positive."""
    if current is None or ref is None or ref <= 0:
        return None, "n/a"
    r = current / ref
    return r, "no regression" if r <= tolerance else "REGRESSION"


def rows(cmp: Comparison, time_tolerance: float, rss_tolerance: float) -> list[dict[str, Any]]:
    """One row per figure and unit (wall seconds, peak RSS MiB): both sides' figures, ratio, tolerance, verdict."""
    out: list[dict[str, Any]] = []
    for key, title in ((k, t) for k, t in cmp.titles.items() if (k, "current") in cmp.series):
        cur, ref = cmp.series[(key, "current")], cmp.series[(key, "ref")]
        for unit, tol in (("s", time_tolerance), ("MiB", rss_tolerance)):
            a, b = (cur.median_s, ref.median_s) if unit == "s" else (cur.peak_mib, ref.peak_mib)
            r, v = verdict(a, b, tol)
            failed = [f"{side} failed: {s.error}" for side, s in (("current", cur), ("ref", ref)) if s.error]
            out.append({"figure": f"{title}: {'wall s' if unit == 's' else 'peak RSS MiB'}", "unit": unit,
                        "current": a, "ref": b, "ratio": r, "tolerance": tol,
                        "verdict": f"n/a ({'; '.join(failed)})" if failed else v,
                        "current_runs": cur.wall_s if unit == "s" else [k / 1024 for k in cur.maxrss_kib],
                        "ref_runs": ref.wall_s if unit == "s" else [k / 1024 for k in ref.maxrss_kib],
                        "current_failed": bool(cur.error)})
    return out


def run(ref: str, files: dict[str, dict[str, object]], workdir: str, repeat: int, time_tolerance: float,
        rss_tolerance: float, log: Callable[[str], None], **kw: Any) -> dict[str, Any]:
    """The comparison as a JSON-able dict: ``ref``, ``skipped`` (the reason, or None) and, when it ran,
    ``commit``, ``current``, ``identical`` (``ckptool/`` the same in both), ``repeat``, ``rows`` (see :func:`rows`),
    ``regression`` (a row says REGRESSION) and ``current_failed`` (a current-side figure failed)."""
    log(f"against {ref}: exporting its ckptool/ and measuring both sides ...")
    try:
        cmp = compare(ref, files, workdir, repeat, log, **kw)
    except Skipped as e:
        log(f"against {ref}: skipped ({e})")
        return {"ref": ref, "skipped": str(e)}
    rs = rows(cmp, time_tolerance, rss_tolerance)
    return {"ref": ref, "skipped": None, "commit": cmp.commit, "current": cmp.current, "identical": cmp.identical,
            "repeat": cmp.repeat, "rows": rs, "regression": any(r["verdict"] == "REGRESSION" for r in rs),
            "current_failed": any(r["current_failed"] for r in rs)}


def _cell(value: float | None, runs: list[float], unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "MiB":
        return f"{value:.1f}"
    return f"{value:.3f} ({min(runs):.3f}-{max(runs):.3f})" if len(runs) > 1 else f"{value:.3f}"


def report_text(doc: dict[str, Any], table: Callable[..., str]) -> str:
    """The printed form of :func:`run`'s dict; ``table(rows, headers, colalign)`` draws the table."""
    if doc["skipped"]:
        return f"regression check against {doc['ref']}: skipped ({doc['skipped']})"
    ref = f"{doc['ref']} ({doc['commit'][:7]})"
    rounds = f"{doc['repeat']} interleaved round" + ("s" if doc["repeat"] != 1 else "")
    title = f"regression check: {doc['current']} against {ref}, same run, {rounds}"
    head = [f"{title}; median wall s (min-max), max peak RSS MiB"]
    if doc["identical"]:
        head.append("  (ckptool/ is the same in both: the ratios show this machine's noise alone)")
    body = [[r["figure"], _cell(r["current"], r["current_runs"], r["unit"]), _cell(r["ref"], r["ref_runs"], r["unit"]),
             "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}", f"<= {r['tolerance']:.2f}", r["verdict"]]
            for r in doc["rows"]]
    tab = table(body, ["figure", "current", ref, "ratio", "tolerance", "verdict"],
                ("left", "right", "right", "right", "left", "left"))
    return "\n".join([*head, tab])


def exit_status(doc: dict[str, Any], fail_on_regression: bool) -> int:
    """0, or 1 with ``fail_on_regression`` when a row says REGRESSION or a current-side figure failed; a skipped
    comparison is 0 against the default :data:`DEFAULT_REF` and 2 against a ref that was named."""
    if doc["skipped"]:
        return 0 if doc["ref"] == DEFAULT_REF else 2
    return 1 if fail_on_regression and (doc["regression"] or doc["current_failed"]) else 0
