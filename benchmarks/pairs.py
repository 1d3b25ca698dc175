"""Comparisons anyone can reproduce: each tool from its own entry point in its own clean virtual environment,
one warm-up run, then alternating A B A B pairs, medians and spread printed.

``python benchmarks/bench.py --only pairs [--pairs N] [--keep]`` runs them (see ``bench.py``):

* environments (made under ``benchmarks/out/``, git-ignored, reused by later runs):

  - ``venv-ckptool``: ``python -m venv``, then ``pip install <this checkout>`` (a normal, non-editable install:
    ckptool and its dependencies from PyPI, compiled to bytecode by pip), re-installed from the checkout on every
    run; ckptool runs as its console script ``venv-ckptool/bin/ckptool``.
  - ``venv-picklescan``: ``python -m venv`` + ``pip install picklescan``; it runs as ``venv-picklescan/bin/picklescan``.
  - torch: the interpreter running this script (``torch.load`` needs torch; that environment is torch's own).

  Where an environment cannot be made (no PyPI), the comparison is skipped with a note saying why; ckptool then
  runs from the checkout as ``python -m ckptool`` with the interpreter running this script.
* every child gets this process's environment without ``PYTHONPATH`` (the installed copy is the one measured);
* ``pair_figures`` runs A and B once each (warm-up, not counted), then ``pairs`` times A, B, and prints each
  side's median and min-max, the ratio of the medians and the median (min-max) of the per-pair ratios A/B, and the
  1-minute load average read before and after each pair (``os.getloadavg``): a comparison during which it went over
  :data:`QUIET_LOAD` is marked not valid for claims (other work shared the cores, so its ratio is not the tools');
* ``startup_figures`` runs ``ckptool COMMAND --help`` for every command (imports the command's module and what it
  imports, runs nothing) alternating with ``python -c pass`` of the same environment.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from children import REPO, warm_cache

OUT_ROOT = os.path.join(REPO, "benchmarks", "out")
#: the highest 1-minute load average, before and after every pair, of a comparison valid for claims (2-core machine)
QUIET_LOAD = 1.5


@dataclass
class Env:
    """A tool's interpreter and entry point; ``note`` says how it was made (or why it fell back / is missing)."""

    name: str
    python: str | None
    entry: list[str] | None
    note: str


def _pip(venv: str, *args: str) -> tuple[int, str]:
    """``pip install -q ARGS`` in ``venv`` (one retry, 20 s network timeout: without PyPI it fails soon):
    ``(exit status, last line of stderr)``."""
    cmd = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "20", *args]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=clean_env())
    return proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]


def _venv(name: str) -> tuple[str | None, str]:
    """``benchmarks/out/venv-NAME``, created with the base interpreter of this one when missing."""
    path = os.path.join(OUT_ROOT, f"venv-{name}")
    if os.path.exists(os.path.join(path, "bin", "python")):
        return path, "reused"
    base = getattr(sys, "_base_executable", sys.executable)
    proc = subprocess.run([base, "-m", "venv", "--clear", path], check=False, capture_output=True, text=True,
                          env=clean_env())
    if proc.returncode != 0:
        return None, f"python -m venv failed: {proc.stderr.strip()[-200:]}"
    return path, "created"


def version_of(venv: str, package: str) -> str:
    """``package``'s installed version in ``venv`` (``?`` when unknown)."""
    proc = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                           f"import importlib.metadata as m; print(m.version({package!r}))"],
                          check=False, capture_output=True, text=True, env=clean_env())
    return proc.stdout.strip() or "?"


def picklescan_env() -> Env:
    """picklescan in ``venv-picklescan`` (``pip install picklescan``), or a note why it is missing."""
    venv, how = _venv("picklescan")
    if venv is None:
        return Env("picklescan", None, None, f"skipped: {how}")
    exe = os.path.join(venv, "bin", "picklescan")
    if not os.path.exists(exe):
        rc, err = _pip(venv, "picklescan")
        if rc != 0 or not os.path.exists(exe):
            return Env("picklescan", None, None, f"skipped: pip install picklescan failed ({err})")
    py = os.path.join(venv, "bin", "python")
    return Env("picklescan", py, [exe], f"picklescan {version_of(venv, 'picklescan')} in {venv} ({how})")


def ckptool_env() -> Env:
    """This checkout installed (not editable) into ``venv-ckptool``; on failure ``python -m ckptool`` from the
    checkout with this interpreter, and the note says so."""
    venv, how = _venv("ckptool")
    fallback = Env("ckptool", sys.executable, [sys.executable, "-m", "ckptool"], "")
    if venv is None:
        fallback.note = f"FALLBACK to the checkout in this interpreter: {how}"
        return fallback
    rc, err = _pip(venv, "--force-reinstall", "--no-deps", REPO)  # the checkout as it is now
    if rc == 0:
        rc, err = _pip(venv, REPO)  # its dependencies (kept between runs)
    exe = os.path.join(venv, "bin", "ckptool")
    if rc != 0 or not os.path.exists(exe):
        fallback.note = f"FALLBACK to the checkout in this interpreter: pip install failed ({err})"
        return fallback
    return Env("ckptool", os.path.join(venv, "bin", "python"), [exe],
               f"ckptool installed from {REPO} into {venv} ({how})")


def clean_env(*, checkout: bool = False) -> dict[str, str]:
    """This process's environment without ``PYTHONPATH`` (with the checkout on it when ``checkout``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if checkout:
        env["PYTHONPATH"] = REPO
    return env


def run_once(cmd: list[str], env: dict[str, str]) -> float:
    """Wall seconds of one run of ``cmd`` (stdout to /dev/null); raises ``RuntimeError`` when it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, env=env, cwd=OUT_ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0,):
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.decode()[-300:]}")
    return wall


@dataclass
class Pair:
    """One A/B comparison: each side's wall seconds, in run order."""

    name: str
    a_label: str
    b_label: str
    a: list[float] = field(default_factory=list)
    b: list[float] = field(default_factory=list)
    error: str = ""
    #: the 1-minute load average before and after each pair, in run order
    loads: list[float] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        """Valid for claims: measured, and the load average stayed at or under :data:`QUIET_LOAD` throughout."""
        return bool(self.loads) and max(self.loads) <= QUIET_LOAD

    def load_text(self) -> str:
        """``0.61-1.12 valid`` or ``0.90-2.40 NOT VALID for claims (load > 1.5)``; ``-`` when nothing was read."""
        if not self.loads:
            return "-"
        span = f"{min(self.loads):.2f}-{max(self.loads):.2f}"
        return f"{span} valid" if self.valid else f"{span} NOT VALID for claims (load > {QUIET_LOAD})"

    def ratio(self) -> float | None:
        """median A / median B (None when a side failed)."""
        return None if self.error or not self.a else statistics.median(self.a) / statistics.median(self.b)

    def row(self) -> list[str]:
        """``[figure, A median (min-max), B median (min-max), ratio of medians, median pair ratio (min-max), load]``."""
        if self.error or not self.a:
            return [self.name, f"n/a ({self.error})", "", "", "", self.load_text()]
        ratios = sorted(x / y for x, y in zip(self.a, self.b))
        return [self.name,
                f"{statistics.median(self.a):.3f} ({min(self.a):.3f}-{max(self.a):.3f})",
                f"{statistics.median(self.b):.3f} ({min(self.b):.3f}-{max(self.b):.3f})",
                f"{statistics.median(self.a) / statistics.median(self.b):.3f}x",
                f"{statistics.median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})", self.load_text()]


def load_average() -> float:
    """The 1-minute load average (``os.getloadavg``); 0.0 where the system has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def alternate(p: Pair, a: Callable[[], float], b: Callable[[], float], pairs: int,
              log: Callable[[str], None]) -> Pair:
    """One warm-up run of each side, then ``pairs`` times A then B (each already timed by ``a`` / ``b``)."""
    try:
        a()
        b()
        for i in range(pairs):
            p.loads.append(load_average())
            p.a.append(a())
            p.b.append(b())
            p.loads.append(load_average())
            load = f"load {p.loads[-2]:.2f} / {p.loads[-1]:.2f}"
            log(f"  {p.name} pair {i + 1}: {p.a[-1]:.3f} s / {p.b[-1]:.3f} s ({load})")
    except RuntimeError as e:
        p.error = str(e)
    return p


def pair_figures(files: dict[str, str], pairs: int, log: Callable[[str], None]) -> tuple[list[Pair], list[str]]:
    """scan vs picklescan on checkpoints (1) and (2), inspect --json of (2) vs ``torch.load(map_location='meta')``;
    ``files``: case -> path. Returns the comparisons and the notes on the environments."""
    ck, ps = ckptool_env(), picklescan_env()
    notes = [ck.note, ps.note, f"torch: {sys.executable}"]
    assert ck.entry is not None
    ck_env = clean_env(checkout=ck.python == sys.executable)
    env = clean_env()

    def timed(cmd: list[str], path: str, e: dict[str, str]) -> Callable[[], float]:
        def go() -> float:
            warm_cache(path)
            return run_once(cmd, e)
        return go

    rows: list[Pair] = []
    for case in ("1", "2"):
        src = files[case]
        p = Pair(f"({case}) ckptool scan / picklescan -p", "ckptool scan", "picklescan")
        if ps.entry is None:
            p.error = ps.note
        else:
            alternate(p, timed([*ck.entry, "scan", src], src, ck_env), timed([*ps.entry, "-p", src], src, env),
                      pairs, log)
        rows.append(p)
    src = files["2"]
    meta = [sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1], map_location='meta')", src]
    p = Pair("(2) ckptool inspect --json / torch meta load", "ckptool inspect", "torch meta load")
    alternate(p, timed([*ck.entry, "inspect", "--json", src], src, ck_env), timed(meta, src, env), pairs, log)
    rows.append(p)
    return rows, notes


def startup_figures(commands: list[str], rounds: int, log: Callable[[str], None]) -> tuple[list[list[str]], str]:
    """``ckptool COMMAND --help`` per command beside ``python -c pass`` of the same environment, ``rounds`` rounds
    (each runs every command once, after one warm-up round). Returns rows and the environment's note."""
    ck = ckptool_env()
    assert ck.entry is not None and ck.python is not None
    env = clean_env(checkout=ck.python == sys.executable)
    cmds = {"python -c pass": [ck.python, "-c", "pass"], "ckptool --version": [*ck.entry, "--version"]}
    cmds.update({f"ckptool {c} --help": [*ck.entry, c, "--help"] for c in commands})
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for r in range(rounds + 1):
        for k, cmd in cmds.items():
            t = run_once(cmd, env)
            if r:
                times[k].append(t)
    base = statistics.median(times["python -c pass"])
    rows = [[k, f"{statistics.median(v):.3f}", f"{min(v):.3f}-{max(v):.3f}",
             f"+{statistics.median(v) - base:.3f}"] for k, v in times.items()]
    log(f"  start-up: {rounds} rounds done")
    return rows, ck.note

