#!/usr/bin/env python3
"""End-to-end benchmark of the ckptool CLI against torch and ``cp`` baselines.

Usage::

    python benchmarks/bench.py [--workdir DIR] [--size-gib 2.0] [--many 50000] [--dcp-gib 4.0]
                               [--only inspect|remap|strip|convert|scan|load|scale|dcp|pairs|imports] [--repeat 3]
                               [--keep]
                               [--json] [--extras] [--pairs 15] [--startup-rounds 7]

    # the reproducible comparisons (benchmarks/pairs.py): scan vs picklescan and inspect (2) vs torch's meta load,
    # each tool in its own clean virtual environment under benchmarks/out/, 1 warm-up then alternating A B pairs;
    # and start-up per command beside `python -c pass`
    python benchmarks/bench.py --only pairs --keep --pairs 15

    # quick smoke run (CI): --size-gib 0.05 --many 500 --repeat 1, exit 1 if a ckptool command fails; ends with the
    # --against HEAD~1 check on those files (skipped, with the reason, where HEAD~1 does not resolve)
    python benchmarks/bench.py --smoke

    # no regression against another commit (benchmarks/regression.py): inspect --json of checkpoint (2), remap of
    # checkpoint (1) and load_into of (1), for this checkout and REF's ckptool/ (git archive), same run, interleaved;
    # a table of both sides, ratio current/REF and a verdict per row (exit 1 only with --fail-on-regression)
    python benchmarks/bench.py --against [REF] [--time-tolerance 1.10] [--rss-tolerance 1.05] [--fail-on-regression]

    # ckptool diff of two files against torch.load + loop (benchmarks/bench_diff.py; its smoke run is in --smoke)
    python benchmarks/bench.py diff [--size-gib 2.0] [--repeat 3] [--json]

What it does
------------
1. Builds two checkpoints in the work dir, every storage tagged ``cuda:1`` (written on a CPU-only
   machine with ``fixtures/tagging.py``), each in a child process so this process stays small:

   * case (1) "big":  a zip-format state_dict of 192 float32 tensors ``layers.{i}.weight`` of equal
     size (``rows x 1024``), ~``--size-gib`` GiB in all; tensor ``i`` is filled with ``float(i)``.
   * case (2) "many": a state_dict of ``--many`` float32 tensors of 16 elements, ``blocks.{i}.w``,
     tensor ``i`` filled with ``float(i)``.

   With ``--keep`` an existing file of the same name (names encode the sizes) is reused, and the
   files are left behind at the end; otherwise they are deleted.

2. Runs each command below as a separate process, ``--repeat`` times per file, interleaved (round ``i``
   runs every command once, so a change in the machine's load hits a command and its baselines alike).
   Before every run the previous output is deleted, ``os.sync()`` flushes pending writeback (and, after a
   big output was deleted, the run waits until 4 s have passed: ``children.SETTLE_S``), and the input file is read
   once (warm page cache), so every run starts from the same cache state.  A run is timed with
   ``time.perf_counter`` around ``Popen`` .. ``os.wait4``, and its peak RSS is ``ru_maxrss`` from the
   ``os.wait4`` rusage (KiB on Linux; it includes any children the command waited for).  The checkout's
   ``ckptool`` package is compiled to bytecode first (``children.compile_checkout``), as ``pip install`` does
   for a wheel, so that start-up is measured as an installed ckptool pays it (torch is installed, compiled).

   =====================  ==============================================================================
   label                  command
   =====================  ==============================================================================
   ckptool inspect        ``python -m ckptool inspect --json FILE``   (stdout to /dev/null)
   ckptool remap          ``python -m ckptool remap FILE --to cpu -o OUT``
   ckptool strip          ``python -m ckptool strip-dataparallel FILE -o OUT --allow-missing``
   ckptool convert        ``python -m ckptool convert FILE -o OUT --format safetensors --no-verify``
                          (checkpoint (1) only; ``ckptool convert+verify``: the same with the default
                          verification, which re-reads the output and compares CRC-32 checksums)
   torch meta load        ``python -c "import torch; torch.load(FILE, map_location='meta')"``
                          (weights_only default): what reading the structure costs with torch
   torch mmap load+save   ``python -c "...; sd = torch.load(FILE, mmap=True, map_location='cpu');
                          torch.save(sd, OUT)"``: the usual torch way to re-tag a checkpoint
   torch mmap load+       ``safetensors.torch.save_file(torch.load(FILE, mmap=True, map_location='cpu'),
   save_file              OUT)``: the usual way to convert to safetensors (checkpoint (1) only)
   cp                     ``cp FILE OUT``: the I/O floor for rewriting the file (no fsync)
   cp + fsync             ``sh -c 'cp FILE OUT && sync OUT'`` (GNU ``sync FILE`` fsyncs that file): the
                          floor for a durable rewrite (ckptool fsyncs its outputs)
   =====================  ==============================================================================

   ``--only inspect`` runs inspect + torch meta load; ``--only remap`` runs remap + torch mmap
   load+save + cp + cp+fsync; ``--only strip`` runs strip + cp + cp+fsync; ``--only convert`` runs
   convert, convert+verify, torch mmap load+save_file, cp and cp+fsync (the baselines each figure needs).

   The ckptool commands run from this checkout (the repo root is put first on ``PYTHONPATH``).  A
   command that fails (e.g. not written yet) is shown as ``n/a (failed: <message>)``; the message is
   the ``Error:`` line of stderr if there is one, the last line of a Python traceback, or else the
   first line of stderr.

   After the remap runs, a child process checks that the output loads with
   ``torch.load(OUT, mmap=True)`` and *no* ``map_location`` (the tags must now be ``cpu``), that
   every tensor is on cpu, that the tensor count matches, and spot-checks the fill values.

3. Prints machine info, a table of median wall seconds / max peak RSS (MiB) per command and case, and
   the target figures with PASS/FAIL (``--json`` prints all of it as one JSON object instead):

   * inspect (1) / torch meta load (1) wall time          <= 0.15
   * inspect (1) peak RSS                                 <= 64 MiB
   * inspect (2) / torch meta load (2) wall time          <= 0.12
   * scan (1) / inspect (1) wall time                     <= 1.25  (scan reads no tensor bytes either)
   * scan (1) / picklescan (1) wall time                  (informational; ``picklescan -p FILE``)
   * remap (1) / cp + fsync (1) wall time                 <= 1.1   (a rewrite's floor is a durable copy)
   * remap (1) peak RSS                                   <= 64 MiB
   * remap (1) / cp (1) wall time                         (informational)
   * remap (2) / torch mmap load+save (2) wall time       <= 0.3
   * strip (1) / cp + fsync (1) wall time                 <= 1.1
   * strip (1) peak RSS                                   <= 64 MiB
   * convert (1) -> safetensors / cp + fsync (1)          <= 1.1
   * convert (1) peak RSS                                 <= 64 MiB
   * convert+verify (1) / cp + fsync (1)                  (informational)
   * convert (1) / torch mmap load+save_file (1)          (informational)
   * ``--only pairs`` (:mod:`pairs`): scan (1) / picklescan (1) <= 1.0 and inspect (2) / torch meta load (2)
     <= 0.12 as medians of alternating pairs, each tool in its own clean virtual environment; then the four inputs
     of issue 52 (:mod:`bench_pickles`: a 200 MB pickle of bytes blobs, a 524 MB plain pickle of tensors, the same
     in the legacy format, a folder of 500 small pickles) against picklescan, inspect against the load, ``--jobs 2``
     against ``--jobs 1``, and ckptool's peak RSS beside 64 MiB + 2 KiB per tensor (the load average beside each)

4. Then the figures of ``benchmarks/figures.py`` (see its docstring), each with its own table: ``load``
   (``load_into`` vs ``torch.load(mmap=True)`` + ``load_state_dict`` and plain ``torch.load`` + ``load_state_dict``
   on checkpoint (1): time <= 1.0x the mmap load, peak RSS <= import baseline + model + 64 MiB), ``scale`` (inspect
   and remap of 10k / 100k / 1M tensors and 100 MB / 2 GB / 8 GB files, one run each) and ``dcp`` (DCP folder of
   ``--dcp-gib`` GiB -> one torch file: peak RSS <= 256 MiB) and ``imports`` (``python -X importtime`` of ``ckptool
   scan`` and ``ckptool inspect --json`` of checkpoint (1): the start-up's import time, ``ckptool.cli``'s, and how
   many ckptool modules and modules in all each command imports; counts exact, times indicative).

5. ``--against [REF]`` (default ``HEAD~1``) runs, instead of all of the above, the regression check of
   ``benchmarks/regression.py`` (see its docstring): ``inspect --json`` of checkpoint (2), ``remap --to cpu`` of (1)
   and ``ckptool.load_into`` of (1), each for this checkout and for REF's ``ckptool/`` (exported with ``git archive``
   to a temporary folder), same run, interleaved; it prints both sides' median time and peak RSS, the ratio
   current / REF and ``no regression`` or ``REGRESSION`` per row (tolerances ``--time-tolerance`` 1.10 and
   ``--rss-tolerance`` 1.05). ``--smoke`` runs the same check against ``HEAD~1`` on its small files; where the ref
   does not resolve (a shallow clone, a copy without ``.git``) one line says it was skipped and why.

6. ``--extras`` then runs every ``benchmarks/bench_*.py`` (other figures kept in their own modules, such as
   ``bench_walk.py``) as a child process, with ``--smoke`` under ``--smoke``, and prints its output; a failing
   one is reported (and fails a smoke run).

Note on peak RSS: on Linux a child's ``ru_maxrss`` is never below the peak RSS its parent had when it
forked/exec'd it (``exec`` keeps the high-water mark of the address space it replaces).  This script
therefore never imports torch and never holds a checkpoint in memory itself; everything heavy runs in
child processes.  The "RSS floor" printed with the machine info is what any child inherits.

Only the standard library is needed here; ``tabulate`` is used for the tables when installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import bench_diff  # benchmarks/ is on sys.path when this file runs as a script
import bench_pickles
import figures
import pairs
import regression
from children import child_env, compile_checkout, remove, run_child, settle, warm_cache
from children import failure_summary as _failure_summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "fixtures")
DEFAULT_OUT_ROOT = os.path.join(REPO, "benchmarks", "out")  # git-ignored

N_BIG_TENSORS = 192
BIG_COLS = 1024
MANY_NUMEL = 16
TAG = "cuda:1"

CASES = ("1", "2")
CASE_NAMES = {"1": "big", "2": "many"}

# label -> which --only groups include it
COMMAND_GROUPS = {
    "ckptool inspect": {"inspect", "scan"},
    "ckptool scan": {"scan"},
    "picklescan": {"scan"},
    "ckptool remap": {"remap"},
    "ckptool strip": {"strip"},
    "torch meta load": {"inspect"},
    "torch mmap load+save": {"remap"},
    "ckptool convert": {"convert"},
    "ckptool convert+verify": {"convert"},
    "torch mmap load+save_file": {"convert"},
    "cp": {"remap", "strip", "convert"},
    "cp + fsync": {"remap", "strip", "convert"},
}
#: commands run on checkpoint (1) only (a torch -> safetensors rewrite of 50,000 tiny tensors says nothing more)
CASE_ONLY = {"ckptool convert": "1", "ckptool convert+verify": "1", "torch mmap load+save_file": "1"}

# ----------------------------------------------------------------------------------------------------
# Child-process helpers (these are the only places torch is imported)
# ----------------------------------------------------------------------------------------------------

_TORCH_META_LOAD = "import sys, torch; torch.load(sys.argv[1], map_location='meta')"
_TORCH_MMAP_LOAD_SAVE = (
    "import sys, torch; sd = torch.load(sys.argv[1], mmap=True, map_location='cpu'); torch.save(sd, sys.argv[2])"
)
_TORCH_MMAP_SAVE_FILE = (
    "import sys, torch; from safetensors.torch import save_file; "
    "save_file(torch.load(sys.argv[1], mmap=True, map_location='cpu'), sys.argv[2])"
)
_CP_SYNC = 'cp "$1" "$2" && sync "$2"'  # run as: sh -c _CP_SYNC sh SRC DST


def _child_build(kind: str, path: str, count: int, rows: int) -> None:
    """Runs in a child process: write one tagged checkpoint to ``path`` (atomically)."""
    sys.path.insert(0, FIXTURES)
    from collections import OrderedDict

    import torch
    from tagging import save_tagged

    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    if kind == "big":
        for i in range(count):
            sd[f"layers.{i}.weight"] = torch.empty(rows, BIG_COLS, dtype=torch.float32).fill_(float(i))
    elif kind == "sparse":  # never-written memory reads as zeros: the file is zeros, made sparse afterwards
        for i in range(count):
            sd[f"layers.{i}.weight"] = torch.empty(rows, BIG_COLS, dtype=torch.float32)
    elif kind == "many":
        for i in range(count):
            sd[f"blocks.{i}.w"] = torch.full((MANY_NUMEL,), float(i), dtype=torch.float32)
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    tmp = path + ".partial"
    save_tagged(sd, tmp, TAG)
    os.replace(tmp, path)


def _child_check(path: str, count: int, kind: str) -> None:
    """Runs in a child process: ``torch.load(path, mmap=True)`` with no map_location, then checks it."""
    import torch

    obj = torch.load(path, mmap=True)
    tensors: dict[str, torch.Tensor] = {}

    def walk(o: object, prefix: str) -> None:
        if isinstance(o, torch.Tensor):
            tensors[prefix] = o
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(o, (list, tuple)):
            for k, v in enumerate(o):
                walk(v, f"{prefix}.{k}" if prefix else str(k))

    walk(obj, "")
    problems = []
    if len(tensors) != count:
        problems.append(f"{len(tensors)} tensors, expected {count}")
    not_cpu = sorted({str(t.device) for t in tensors.values() if t.device.type != "cpu"})
    if not_cpu:
        problems.append(f"tensors on {not_cpu}")
    key_fmt = "layers.{}.weight" if kind == "big" else "blocks.{}.w"
    for i in sorted({0, count // 2, count - 1}):
        key = key_fmt.format(i)
        t = tensors.get(key)
        if t is None:
            problems.append(f"missing {key}")
        elif t.numel() and not bool((t.reshape(-1)[[0, -1]] == float(i)).all()):
            problems.append(f"{key} has wrong values")
    if problems:
        print("; ".join(problems), file=sys.stderr)
        raise SystemExit(1)


# ----------------------------------------------------------------------------------------------------
# Running and measuring processes
# ----------------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    ok: bool
    wall_s: float
    maxrss_kib: int
    error: str = ""


@dataclass
class Measurement:
    case: str
    label: str
    command: list[str]
    wall_s: list[float] = field(default_factory=list)
    maxrss_kib: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.wall_s)

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.wall_s) if self.ok else None

    @property
    def peak_mib(self) -> float | None:
        return max(self.maxrss_kib) / 1024 if self.ok else None


def run_measured(cmd: list[str], workdir: str) -> RunResult:
    """Run ``cmd`` as a child (:func:`children.run_child`): wall clock and peak RSS, or why it failed."""
    rc, wall, kib, _out, err = run_child(cmd, workdir)
    if rc != 0:
        return RunResult(False, wall, kib, _failure_summary(err, rc))
    return RunResult(True, wall, kib)


def run_plain(cmd: list[str], workdir: str) -> tuple[int, str, str]:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=child_env(), cwd=workdir)
    return proc.returncode, proc.stdout, proc.stderr


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# Machine info
# ----------------------------------------------------------------------------------------------------


def machine_info(workdir: str) -> dict[str, object]:
    info: dict[str, object] = {}
    try:
        info["nproc"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["nproc"] = os.cpu_count()
    info["cpu"] = ""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    info["cpu"] = ln.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for ln in f:
                if ln.startswith("MemTotal:"):
                    info["mem_gib"] = round(int(ln.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    info["kernel"] = platform.release()
    info["python"] = platform.python_version()
    rc, out, err = run_plain([sys.executable, "-c", "import torch; print(torch.__version__)"], workdir)
    info["torch"] = out.strip() if rc == 0 else f"n/a ({_failure_summary(err, rc)})"
    version = "import ckptool, sys; print(getattr(ckptool, '__version__', '?'))"
    rc, out, err = run_plain([sys.executable, "-c", version], workdir)
    info["ckptool"] = out.strip() if rc == 0 else f"n/a ({_failure_summary(err, rc)})"
    info["workdir"] = workdir
    if shutil.which("df"):
        rc, out, _ = run_plain(["df", "-T", workdir], workdir)
        lines = out.strip().splitlines()
        if rc == 0 and len(lines) >= 2:
            parts = lines[-1].split()
            info["filesystem"] = f"{parts[0]} ({parts[1]})" if len(parts) > 1 else lines[-1]
            info["df"] = lines[-1]
    # What every child inherits as a ru_maxrss floor (see module docstring).
    info["rss_floor_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return info


# ----------------------------------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------------------------------


def build_files(workdir: str, size_gib: float, many: int, keep: bool) -> dict[str, dict[str, object]]:
    elems = int(size_gib * 2**30 / 4 / N_BIG_TENSORS)
    rows = max(1, round(elems / BIG_COLS))
    size_tag = f"{size_gib:g}".replace(".", "p")
    files = {
        "1": {
            "kind": "big",
            "path": os.path.join(workdir, f"big-{size_tag}gib-{N_BIG_TENSORS}x{rows}x{BIG_COLS}.pt"),
            "tensors": N_BIG_TENSORS,
            "rows": rows,
            "cols": BIG_COLS,
            "desc": f"{N_BIG_TENSORS} x float32[{rows},{BIG_COLS}], tagged {TAG}",
        },
        "2": {
            "kind": "many",
            "path": os.path.join(workdir, f"many-{many}x{MANY_NUMEL}.pt"),
            "tensors": many,
            "rows": 0,
            "desc": f"{many} x float32[{MANY_NUMEL}], tagged {TAG}",
        },
    }
    for case, f in files.items():
        path = str(f["path"])
        if keep and os.path.exists(path):
            log(f"reusing {path}")
        else:
            remove(path)
            log(f"building ({case}) {path} ...")
            t0 = time.perf_counter()
            cmd = [sys.executable, os.path.abspath(__file__), "_build", str(f["kind"]), path, str(f["tensors"]),
                   str(f["rows"])]
            rc, _, err = run_plain(cmd, workdir)
            if rc != 0:
                remove(path + ".partial")
                raise SystemExit(f"building {path} failed:\n{err}")
            log(f"  built in {time.perf_counter() - t0:.1f} s")
        f["bytes"] = os.path.getsize(path)
    return files


def commands_for(label: str, src: str, out: str) -> list[str]:
    py = sys.executable
    return {
        "ckptool inspect": [py, "-m", "ckptool", "inspect", "--json", src],
        "ckptool remap": [py, "-m", "ckptool", "remap", src, "--to", "cpu", "-o", out],
        "ckptool strip": [py, "-m", "ckptool", "strip-dataparallel", src, "-o", out, "--allow-missing"],
        "ckptool scan": [py, "-m", "ckptool", "scan", src],
        "ckptool convert": [py, "-m", "ckptool", "convert", src, "-o", out, "--format", "safetensors", "--no-verify"],
        "ckptool convert+verify": [py, "-m", "ckptool", "convert", src, "-o", out, "--format", "safetensors"],
        "torch mmap load+save_file": [py, "-c", _TORCH_MMAP_SAVE_FILE, src, out],
        "picklescan": [shutil.which("picklescan") or "picklescan", "-p", src],
        "torch meta load": [py, "-c", _TORCH_META_LOAD, src],
        "torch mmap load+save": [py, "-c", _TORCH_MMAP_LOAD_SAVE, src, out],
        "cp": ["cp", src, out],
        "cp + fsync": ["sh", "-c", _CP_SYNC, "sh", src, out],
    }[label]


def measure_once(m: Measurement, src: str, out: str, workdir: str, i: int) -> bool:
    """Run ``m``'s command once more (run ``i``, counted from 0) from a clean state and record it; False when it
    failed (then ``m`` holds the error and no figures) or had failed before."""
    if m.error:
        return False
    remove(out)
    settle()
    warm_cache(src)
    r = run_measured(m.command, workdir)
    if not r.ok:
        m.error = r.error
        m.wall_s.clear()
        m.maxrss_kib.clear()
        log(f"  ({m.case}) {m.label:<22} run {i + 1}: FAILED ({r.error})")
        return False
    m.wall_s.append(r.wall_s)
    m.maxrss_kib.append(r.maxrss_kib)
    log(f"  ({m.case}) {m.label:<22} run {i + 1}: {r.wall_s:8.3f} s  {r.maxrss_kib / 1024:8.1f} MiB")
    return True


def check_remap_output(out: str, f: dict[str, object], workdir: str) -> dict[str, object]:
    cmd = [sys.executable, os.path.abspath(__file__), "_check", out, str(f["tensors"]), str(f["kind"])]
    rc, _, err = run_plain(cmd, workdir)
    if rc == 0:
        return {"ok": True, "message": "remap output OK"}
    return {"ok": False, "message": f"remap output BAD: {_failure_summary(err, rc)}"}


def ratio(num: Measurement | None, den: Measurement | None) -> float | None:
    if num is None or den is None or num.median_s is None or den.median_s is None or den.median_s <= 0:
        return None
    return num.median_s / den.median_s


def targets(ms: dict[tuple[str, str], Measurement]) -> list[dict[str, object]]:
    g = ms.get
    rows: list[dict[str, object]] = []

    def add(name: str, value: float | None, unit: str, limit: float | None, needs: list[tuple[str, str]]) -> None:
        if not all(k in ms for k in needs):
            return  # excluded by --only
        if value is None:
            failed = [f"{ms[k].label} ({k[0]})" for k in needs if not ms[k].ok]
            status = "n/a" + (f" ({', '.join(failed)} failed)" if failed else "")
        elif limit is None:
            status = "info"
        else:
            status = "PASS" if value <= limit else "FAIL"
        rows.append({"figure": name, "value": value, "unit": unit, "target": limit, "status": status})

    ins1, meta1 = ("1", "ckptool inspect"), ("1", "torch meta load")
    ins2, meta2 = ("2", "ckptool inspect"), ("2", "torch meta load")
    rem1, cp1, cpf1 = ("1", "ckptool remap"), ("1", "cp"), ("1", "cp + fsync")
    rem2, tsave2 = ("2", "ckptool remap"), ("2", "torch mmap load+save")
    str1 = ("1", "ckptool strip")
    conv1, convv1, tsf1 = ("1", "ckptool convert"), ("1", "ckptool convert+verify"), ("1", "torch mmap load+save_file")

    add("inspect (1) / torch meta load (1)", ratio(g(ins1), g(meta1)), "x", 0.15, [ins1, meta1])
    add("inspect (1) peak RSS", g(ins1).peak_mib if ins1 in ms else None, "MiB", 64, [ins1])
    add("inspect (2) / torch meta load (2)", ratio(g(ins2), g(meta2)), "x", 0.12, [ins2, meta2])
    scan1, pscan1 = ("1", "ckptool scan"), ("1", "picklescan")
    add("scan (1) / inspect (1)", ratio(g(scan1), g(ins1)), "x", 1.25, [scan1, ins1])
    add("scan (1) / picklescan (1)", ratio(g(scan1), g(pscan1)), "x", None, [scan1, pscan1])
    add("remap (1) / cp + fsync (1)", ratio(g(rem1), g(cpf1)), "x", 1.1, [rem1, cpf1])
    add("remap (1) peak RSS", g(rem1).peak_mib if rem1 in ms else None, "MiB", 64, [rem1])
    add("remap (1) / cp (1)", ratio(g(rem1), g(cp1)), "x", None, [rem1, cp1])
    add("remap (2) / torch mmap load+save (2)", ratio(g(rem2), g(tsave2)), "x", 0.3, [rem2, tsave2])
    add("strip (1) / cp + fsync (1)", ratio(g(str1), g(cpf1)), "x", 1.1, [str1, cpf1])
    add("strip (1) peak RSS", g(str1).peak_mib if str1 in ms else None, "MiB", 64, [str1])
    add("convert (1) -> safetensors / cp + fsync (1)", ratio(g(conv1), g(cpf1)), "x", 1.1, [conv1, cpf1])
    add("convert (1) peak RSS", g(conv1).peak_mib if conv1 in ms else None, "MiB", 64, [conv1])
    add("convert+verify (1) / cp + fsync (1)", ratio(g(convv1), g(cpf1)), "x", None, [convv1, cpf1])
    add("convert (1) / torch mmap load+save_file (1)", ratio(g(conv1), g(tsf1)), "x", None, [conv1, tsf1])
    return rows


def _table(rows: list[list[object]], headers: list[str], colalign: tuple[str, ...] | None = None) -> str:
    try:
        from tabulate import tabulate
    except ImportError:
        tabulate = None
    if tabulate is not None:
        return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True, colalign=colalign)
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def header_lines(info: dict[str, object], files: dict[str, dict[str, object]]) -> list[str]:
    """The machine and files part of the printed report, each followed by an empty line."""
    out = ["machine"]
    keys = ("nproc", "cpu", "mem_gib", "kernel", "python", "torch", "ckptool", "workdir", "filesystem", "rss_floor_mib")
    out.extend(f"  {k:<14} {info[k]}" for k in keys if k in info)
    out.append("")
    out.append("files")
    for case, f in files.items():
        out.append(f"  ({case}) {CASE_NAMES[case]:<5} {f['bytes'] / 2**20:10.1f} MiB  {f['desc']}  {f['path']}")
    out.append("")
    return out


def report_text(info: dict[str, object], files: dict[str, dict[str, object]], ms: dict[tuple[str, str], Measurement],
                checks: dict[str, dict[str, object]], tgt: list[dict[str, object]], repeat: int,
                sections: list[dict[str, Any]]) -> str:
    out = header_lines(info, files)
    rows = []
    for (case, label), m in ms.items():  # (none under --only pairs: that group has tables of its own)
        if m.ok:
            spread = f"{min(m.wall_s):.3f}-{max(m.wall_s):.3f}"
            rows.append([f"({case}) {CASE_NAMES[case]}", label, f"{m.median_s:.3f}", spread, f"{m.peak_mib:.1f}"])
        else:
            rows.append([f"({case}) {CASE_NAMES[case]}", label, f"n/a (failed: {m.error})", "n/a", "n/a"])
    if rows:
        out.append(f"runs (median of {repeat} wall seconds [min-max], max peak RSS)")
        out.append(_table(rows, ["case", "command", "median wall s", "spread s", "peak RSS MiB"],
                          ("left", "left", "right", "right", "right")))
        out.append("")
    for sec in sections:
        out.append(sec["title"])
        out.append(_table(sec["rows"], sec["headers"]) if sec["rows"] else "  (nothing)")
        out.append("")
    for case, c in checks.items():
        out.append(f"({case}) {c['message']}")
    if checks:
        out.append("")
    trows = []
    for t in tgt:
        v = t["value"]
        val = "n/a" if v is None else (f"{v:.3f}" if t["unit"] == "x" else f"{v:.1f} MiB")
        lim = "-" if t["target"] is None else (f"<= {t['target']}" + (" MiB" if t["unit"] == "MiB" else ""))
        trows.append([t["figure"], val, lim, t["status"]])
    out.append("targets")
    out.append(_table(trows, ["figure", "value", "target", "result"], ("left", "right", "left", "left")))
    return "\n".join(out)


def build_one(workdir: str, kind: str, amount: float, keep: bool) -> str:
    """Path of a checkpoint for the scale table, built in a child when missing: ``many`` (``amount`` tensors of
    float32[16]), ``big`` / ``sparse`` (``amount`` GiB in 192 tensors; ``sparse``: zeros)."""
    if kind == "many":
        count, rows, name = int(amount), 0, f"many-{int(amount)}x{MANY_NUMEL}.pt"
    else:
        rows = max(1, round(amount * 2**30 / 4 / N_BIG_TENSORS / BIG_COLS))
        count, name = N_BIG_TENSORS, f"{kind}-{amount:g}gib-{N_BIG_TENSORS}x{rows}x{BIG_COLS}.pt".replace("0.", "0p")
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
        log(f"building {path} ...")
        rc, _, err = run_plain([sys.executable, os.path.abspath(__file__), "_build", kind, path, str(count),
                                str(rows)], workdir)
        if rc != 0:
            remove(path + ".partial")
            raise SystemExit(f"building {path} failed:\n{err}")
    if not keep:
        _BUILT.append(path)
    return path


_BUILT: list[str] = []


def import_figures(files: dict[str, dict[str, object]], workdir: str, rounds: int) -> dict[str, Any]:
    """The ``imports`` section: ``python -X importtime -m ckptool scan FILE`` and ``... inspect --json FILE`` of
    checkpoint (1) (one torch zip), ``rounds`` runs each: the median import time of the command's whole start-up
    (the sum of every module's own time), of ``ckptool.cli`` alone (its cumulative time: click and the CLI frame),
    the ckptool modules the command imported and all the modules imported (each a line of ``-X importtime``; the
    counts are exact, the times indicative on a shared machine). ``tests/test_startup_imports.py`` pins the ckptool
    module sets."""
    src = str(files["1"]["path"])
    rows = []
    for label, args in (("ckptool scan (1)", ["scan", src]),
                        ("ckptool inspect --json (1)", ["inspect", "--json", src])):
        totals, clis, counts = [], [], (0, 0)
        for _ in range(rounds):
            rc, _out, err = run_plain([sys.executable, "-X", "importtime", "-m", "ckptool", *args], workdir)
            if rc not in (0, 4):  # scan's own exit status of a file that needs trust is no failure here
                rows.append([label, f"n/a (failed: {_failure_summary(err, rc)})", "n/a", "n/a", "n/a"])
                break
            total, cli, counts = _importtime(err)
            totals.append(total)
            clis.append(cli)
        else:
            rows.append([label, f"{statistics.median(totals):.1f}", f"{statistics.median(clis):.1f}", counts[0],
                         counts[1]])
    runs = f"{rounds} run{'s' if rounds != 1 else ''}"
    return {"title": f"imports (python -X importtime, median of {runs}; ms indicative, counts exact)",
            "headers": ["command", "import ms", "ckptool.cli ms", "ckptool modules", "all modules"], "rows": rows}


def _importtime(stderr: str) -> tuple[float, float, tuple[int, int]]:
    """From ``-X importtime`` lines (``import time: self | cumulative | name``): the sum of every module's own
    time (ms), ``ckptool.cli``'s cumulative time (ms), and (ckptool modules, all modules) imported."""
    total, cli, ours, every = 0, 0, 0, 0
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        own, cumulative, name = (p.strip() for p in line[len("import time:"):].split("|"))
        if not own.isdigit():  # the header line
            continue
        total += int(own)
        every += 1
        ours += name == "ckptool" or name.startswith("ckptool.")
        if name == "ckptool.cli":
            cli = int(cumulative)
    return total / 1000, cli / 1000, (ours, every)


def extra_figures(args: argparse.Namespace, workdir: str, files: dict[str, dict[str, object]],
                  tgt: list[dict[str, object]]) -> list[dict[str, Any]]:
    """The load / scale / dcp sections (:mod:`figures`) and the ``--extras`` modules; their targets are appended to
    ``tgt``."""
    ctx = figures.Ctx(workdir, args.repeat, args.smoke, run_measured, child_env, log,
                      lambda kind, amount, _rows: build_one(workdir, kind, amount, args.keep), warm_cache)
    big = files["1"]
    sections: list[dict[str, Any]] = []
    if args.only in (None, "load"):
        rows, t = figures.load_figures(ctx, str(big["path"]), N_BIG_TENSORS, int(str(big["rows"])), BIG_COLS)
        sections.append({"title": f"load (1) into a model of its layout (median of {args.repeat})",
                         "headers": ["loader", "median load s", "spread s", "peak RSS MiB",
                                     "peak - (import + model) MiB"], "rows": rows})
        tgt.extend(t)
    if args.only in (None, "scale"):
        rows, t = figures.scale_figures(ctx, {args.size_gib: str(big["path"])})
        sections.append({"title": "scale (one run each)", "headers": [
            "checkpoint", "inspect s", "inspect MiB", "remap s", "remap MiB", "remap per unit"], "rows": rows})
        tgt.extend(t)
    if args.only in (None, "imports"):
        sections.append(import_figures(files, workdir, 1 if args.smoke else max(args.repeat, 5)))
    if args.only in (None, "dcp"):
        rows, t = figures.dcp_figures(ctx, args.dcp_gib)
        sections.append({"title": f"DCP folder -> one torch file (median of {args.repeat})",
                         "headers": ["command", "median wall s", "spread s", "peak RSS MiB"], "rows": rows})
        tgt.extend(t)
    if args.only == "pairs" or (args.only is None and not args.smoke):  # makes venvs with pip: not in CI's smoke run
        sections.extend(pair_sections(args, files, tgt))
        sections.extend(pickle_sections(args, workdir, tgt))
    if args.extras:
        here = os.path.dirname(os.path.abspath(__file__))
        rows = []
        for name in sorted(n for n in os.listdir(here) if n.startswith("bench_") and n.endswith(".py")):
            rc, out, err = run_plain([sys.executable, os.path.join(here, name), *(["--smoke"] if args.smoke else [])],
                                     workdir)
            log(out.rstrip())
            rows.append([name, "ok" if rc == 0 else f"n/a (failed: {_failure_summary(err, rc)})"])
        sections.append({"title": "extras (benchmarks/bench_*.py; their output is on stderr)",
                         "headers": ["module", "result"], "rows": rows})
    return sections


def pickle_sections(args: argparse.Namespace, workdir: str, tgt: list[dict[str, object]]) -> list[dict[str, Any]]:
    """The four inputs of issue 52 (:mod:`bench_pickles`: a pickle of bytes blobs, a plain pickle of tensors, the
    legacy format, a folder of small pickles) as alternating pairs against picklescan and the load, then ckptool's
    peak RSS beside its bound; the targets are appended to ``tgt``."""
    folder = os.path.join(workdir, "pickles")
    os.makedirs(folder, exist_ok=True)
    n = 1 if args.smoke else args.pairs
    try:
        comparisons, notes, rss = bench_pickles.figures(folder, 0.02 if args.smoke else 1.0, n, args.smoke, log)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    for p, limit in zip(comparisons, bench_pickles.TARGETS):
        value = p.ratio()
        status = "n/a" if value is None else "PASS" if value <= limit else "FAIL"
        if value is not None and not p.valid:
            status = f"{status}, NOT VALID (load > {pairs.QUIET_LOAD})"
        tgt.append({"figure": f"pickles: {p.name} (median A / median B)", "value": value, "unit": "x",
                    "target": limit, "status": status})
    return [
        {"title": f"plain and legacy pickles, alternating pairs A B (1 warm-up, then {n} pairs; wall s)\n  "
                  + "\n  ".join(notes),
         "headers": ["A / B", "A", "B", "median A / median B", "per-pair A/B", "load average (1 min)"],
         "rows": [p.row() for p in comparisons]},
        {"title": "plain and legacy pickles: ckptool's peak RSS (one run each) beside the bound of issue 52",
         "headers": ["run", "peak RSS MiB", "bound MiB"], "rows": rss},
    ]


def pair_sections(args: argparse.Namespace, files: dict[str, dict[str, object]],
                  tgt: list[dict[str, object]]) -> list[dict[str, Any]]:
    """The ``pairs`` group (:mod:`pairs`): scan vs picklescan, inspect (2) vs torch's meta load, each tool in its
    own clean virtual environment, as alternating pairs; then start-up per command beside ``python -c pass``. The
    targets (scan (1) <= 1.0x picklescan, inspect (2) <= 0.12x torch's meta load) are appended to ``tgt``."""
    n = 1 if args.smoke else args.pairs
    comparisons, notes = pairs.pair_figures({c: str(f["path"]) for c, f in files.items()}, n, log)
    for p, limit in zip(comparisons, (1.0, None, 0.12)):
        value = p.ratio()
        status = "n/a" if value is None else "info" if limit is None else "PASS" if value <= limit else "FAIL"
        if value is not None and not p.valid:  # other work shared the cores: not a figure to claim
            status = f"{status}, NOT VALID (load > {pairs.QUIET_LOAD})"
        tgt.append({"figure": f"pairs: {p.name} (median A / median B)", "value": value, "unit": "x",
                    "target": limit, "status": status})
    rows = [p.row() for p in comparisons]
    rc, out, _ = run_plain([sys.executable, "-c", "from ckptool.cli import COMMANDS; print(*COMMANDS)"], REPO)
    commands = [c for c in out.split() if c != "demo"] if rc == 0 else []
    srows, snote = pairs.startup_figures(commands, 1 if args.smoke else args.startup_rounds, log)
    return [
        {"title": f"alternating pairs A B (1 warm-up, then {n} pairs; wall s, median (min-max))\n  "
                  + "\n  ".join(notes),
         "headers": ["A / B", "A", "B", "median A / median B", "per-pair A/B", "load average (1 min)"], "rows": rows},
        {"title": f"start-up (median of {1 if args.smoke else args.startup_rounds} rounds after a warm-up; {snote})",
         "headers": ["command", "median s", "spread s", "over python -c pass"], "rows": srows},
    ]


def measure_commands(args: argparse.Namespace, files: dict[str, dict[str, object]], workdir: str,
                     outs: list[str]) -> tuple[dict[tuple[str, str], Measurement], dict[str, dict[str, object]]]:
    """Run the commands of ``--only``'s group (all by default) ``--repeat`` times per case, interleaved; returns the
    measurements by ``(case, label)`` and the remap output checks by case. Output paths are appended to ``outs``."""
    labels = [lb for lb, groups in COMMAND_GROUPS.items() if args.only is None or args.only in groups]
    if shutil.which("picklescan") is None:
        labels = [lb for lb in labels if lb != "picklescan"]
    ms: dict[tuple[str, str], Measurement] = {}
    checks: dict[str, dict[str, object]] = {}
    for case in CASES if labels else ():
        f = files[case]
        src = str(f["path"])
        out = os.path.join(workdir, f"out-{CASE_NAMES[case]}.pt")
        outs.append(out)
        case_labels = [lb for lb in labels if CASE_ONLY.get(lb, case) == case]
        for label in case_labels:
            ms[(case, label)] = Measurement(case=case, label=label, command=commands_for(label, src, out))
        for i in range(args.repeat):
            for label in case_labels:
                ok = measure_once(ms[(case, label)], src, out, workdir, i)
                if label == "ckptool remap" and ok and case not in checks:
                    checks[case] = check_remap_output(out, f, workdir)
                    log(f"  ({case}) {checks[case]['message']}")
                remove(out)
    return ms, checks


def smoke_failures(ms: dict[tuple[str, str], Measurement], sections: list[dict[str, Any]],
                   checks: dict[str, dict[str, object]], vs_ref: dict[str, Any] | None) -> list[str]:
    """What fails a ``--smoke`` run: a ckptool command that failed, an ``n/a`` row of a section, a bad remap output,
    a current-side figure of the regression check that failed (never a ratio: those are noise at smoke sizes)."""
    failed = [f"{m.label} ({m.case}): {m.error}" for m in ms.values() if m.label.startswith("ckptool") and not m.ok]
    failed += [f"{sec['title']}: {row[0]}: {row[1]}" for sec in sections for row in sec["rows"]
               if str(row[1]).startswith("n/a")]
    failed += [f"remap ({case}): {c['message']}" for case, c in checks.items() if not c["ok"]]
    failed += [f"against {vs_ref['ref']}: {r['figure']}: {r['verdict']}" for r in (vs_ref or {}).get("rows", [])
               if r["current_failed"]]
    return failed


def against(args: argparse.Namespace, ref: str, files: dict[str, dict[str, object]], workdir: str) -> dict[str, Any]:
    """The regression check against ``ref`` (:func:`regression.run`) with this run's sizes and tolerances."""
    return regression.run(ref, files, workdir, args.repeat, args.time_tolerance, args.rss_tolerance, log)


def against_mode(args: argparse.Namespace, info: dict[str, object], files: dict[str, dict[str, object]],
                 workdir: str) -> int:
    """``--against REF``: only the regression check; prints it (text or ``--json``), returns the exit status
    (:func:`regression.exit_status`)."""
    doc = against(args, args.against, files, workdir)
    if args.json:
        print(json.dumps({"machine": info, "files": {c: {"name": CASE_NAMES[c], **f} for c, f in files.items()},
                          "against": doc}, indent=2))
    else:
        print("\n".join([*header_lines(info, files), regression.report_text(doc, _table)]))
    return regression.exit_status(doc, args.fail_on_regression)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``), ``--smoke``'s sizes applied."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="See the module docstring for what each figure means.")
    ap.add_argument("--workdir", help="where to build the checkpoints and outputs (default: a fresh dir under "
                    "benchmarks/out/, or benchmarks/out/keep with --keep)")
    ap.add_argument("--size-gib", type=float, default=2.0, help="size of checkpoint (1) in GiB (default 2.0)")
    ap.add_argument("--many", type=int, default=50000, help="number of small tensors in checkpoint (2) (default 50000)")
    ap.add_argument("--only", choices=("inspect", "remap", "strip", "convert", "scan", "load", "scale", "dcp", "pairs",
                                       "imports"),
                    help="run only this figure (a ckptool command and its baselines)")
    ap.add_argument("--dcp-gib", type=float, default=4.0, help="size of the DCP checkpoint (default 4.0)")
    ap.add_argument("--extras", action="store_true", help="also run every benchmarks/bench_*.py module")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; median time, max RSS (default 3)")
    ap.add_argument("--pairs", type=int, default=15, help="counted A B pairs of the pairs group (default 15)")
    ap.add_argument("--startup-rounds", type=int, default=7, help="rounds of the start-up table (default 7)")
    ap.add_argument("--keep", action="store_true", help="reuse existing input files and leave them behind")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    ap.add_argument("--against", nargs="?", const=regression.DEFAULT_REF, metavar="REF",
                    help="run only the regression check against git ref REF's ckptool (default HEAD~1; "
                         "benchmarks/regression.py)")
    ap.add_argument("--time-tolerance", type=float, default=regression.TIME_TOLERANCE,
                    help="--against: largest time ratio current/REF that is no regression (default 1.10)")
    ap.add_argument("--rss-tolerance", type=float, default=regression.RSS_TOLERANCE,
                    help="--against: largest peak RSS ratio current/REF that is no regression (default 1.05)")
    ap.add_argument("--fail-on-regression", action="store_true",
                    help="--against: exit 1 when a row says REGRESSION or the current side fails (default: report)")
    ap.add_argument("--smoke", action="store_true",
                    help="quick check for CI: --size-gib 0.05 --many 500 --repeat 1, and exit 1 when a ckptool "
                         "command fails or a remap output is wrong (timing targets are not enforced)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size_gib, args.many, args.repeat, args.dcp_gib = 0.05, 500, 1, 0.05
    if args.size_gib <= 0 or args.many < 1 or args.repeat < 1:
        ap.error("--size-gib, --many and --repeat must be positive")
    if args.time_tolerance <= 0 or args.rss_tolerance <= 0:
        ap.error("--time-tolerance and --rss-tolerance must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    created_dir = None
    if args.workdir:
        workdir = os.path.abspath(args.workdir)
        os.makedirs(workdir, exist_ok=True)
    elif args.keep:
        workdir = os.path.join(DEFAULT_OUT_ROOT, "keep")
        os.makedirs(workdir, exist_ok=True)
    else:
        os.makedirs(DEFAULT_OUT_ROOT, exist_ok=True)
        workdir = created_dir = tempfile.mkdtemp(prefix="bench-", dir=DEFAULT_OUT_ROOT)

    # Make Ctrl-C / SIGTERM go through the finally below (cleanup of multi-GB files).
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))

    files: dict[str, dict[str, object]] = {}
    outs: list[str] = []
    try:
        info = machine_info(workdir)
        compile_checkout()
        files = build_files(workdir, args.size_gib, args.many, args.keep)
        if args.against is not None:
            return against_mode(args, info, files, workdir)
        ms, checks = measure_commands(args, files, workdir, outs)
        tgt = targets(ms)
        sections = extra_figures(args, workdir, files, tgt)
        vs_ref = against(args, regression.DEFAULT_REF, files, workdir) if args.smoke else None
        if args.json:
            doc = {
                "machine": info,
                "repeat": args.repeat,
                "files": {c: {"name": CASE_NAMES[c], **f} for c, f in files.items()},
                "runs": [
                    {**dict(asdict(m).items()), "ok": m.ok, "median_wall_s": m.median_s,
                     "peak_rss_mib": m.peak_mib, "peak_rss_kib": max(m.maxrss_kib) if m.ok else None}
                    for m in ms.values()
                ],
                "remap_checks": checks,
                "sections": sections,
                "targets": tgt,
                "against": vs_ref,
            }
            print(json.dumps(doc, indent=2))
        else:
            print(report_text(info, files, ms, checks, tgt, args.repeat, sections))
            if vs_ref is not None:
                print("\n(smoke: tiny files, one round: the verdicts below are noise)\n"
                      + regression.report_text(vs_ref, _table))
        if args.smoke:
            failed = smoke_failures(ms, sections, checks, vs_ref)
            for line in failed:
                log(f"smoke run FAILED: {line}")
            if failed or bench_diff.main(["--smoke"]):  # ckptool diff against torch.load + loop (bench_diff.py)
                return 1
    finally:
        for out in outs:
            remove(out)
        if not args.keep:
            for f in files.values():
                remove(str(f["path"]))
        for f in files.values():
            remove(str(f["path"]) + ".partial")
        for path in _BUILT:
            remove(path)
        if created_dir:
            shutil.rmtree(created_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(DEFAULT_OUT_ROOT)  # only if empty
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_build":  # internal: run in a child process by build_files
        _child_build(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_check":  # internal: run in a child by check_remap_output
        _child_check(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif len(sys.argv) > 1 and sys.argv[1] == "diff":  # `bench.py diff [options]`: benchmarks/bench_diff.py
        sys.exit(bench_diff.main(sys.argv[2:]))
    else:
        sys.exit(main())
