#!/usr/bin/env python3
"""Pickles at the speed of their opcodes (issue 52): scan and inspect of plain and legacy pickles against
picklescan and torch, as alternating pairs, with ckptool's peak RSS beside its bound.

Usage::

    python benchmarks/bench_pickles.py [--pairs 11] [--scale 1.0] [--size-gb 2] [--workdir DIR] [--keep]
    python benchmarks/bench_pickles.py --smoke     # tiny inputs, one pair each: a few seconds (nothing to claim)

The four inputs of the issue, written by a child process with torch (``--scale`` multiplies their sizes):

1. ``blobs.pkl``: ``pickle.dump`` of an OrderedDict of 2,000 ``bytes`` blobs of 100 kB (200 MB);
2. ``tensors.pkl``: ``pickle.dump`` of a dict of 500 float32 tensors of 1 MiB (524 MB; each pickled by torch
   through ``torch.storage._load_from_bytes``, a torch.save zip inside a ``bytes``);
3. ``legacy.pt``: the same dict, ``torch.save(..., _use_new_zipfile_serialization=False)`` (legacy format);
4. ``small/``: a folder of 500 small pickles (``pickle.dump`` of a few small tensors each).

Pairs (:mod:`pairs`: one warm-up, then ``--pairs`` alternating A B runs, medians, the 1-minute load average read
around every pair; a comparison during which it passed :data:`pairs.QUIET_LOAD` is marked not valid for claims):
``ckptool scan`` / ``picklescan -p`` on each input; ``ckptool inspect --json tensors.pkl`` / a throwaway process
that loads it (``torch.load(map_location="meta", weights_only=False)`` where torch reads the file; torch.load refuses
a plain pickle, so there ``pickle.load``, the only loader, is the baseline); ``ckptool scan --jobs 2`` /
``--jobs 1`` of the folder. Peak RSS of one ``scan`` (and ``inspect``) run of each input (``wait4``'s ru_maxrss),
beside the issue's bound of 64 MiB + 2 KiB per tensor. ``--size-gb G`` also writes (1), (2) and (3) at about ``G``
GB each (under ``WORKDIR/big``: the same 2,000 blobs and 500 tensors, larger, so the same structure) and adds the
peak RSS of ``scan`` of each and of ``inspect`` of (2) and (3) beside the smaller ones (the issue: "a 2 GB version
of each shows the same RSS"); no pairs are timed on them, and they are deleted after the run unless ``--keep``
(about ``3 * G`` GB of disk, and ``G`` GB of memory while they are written). ckptool and picklescan run as in
:mod:`pairs` (their own virtual environments; ``--smoke`` uses this interpreter's, no pip). Targets (issue 52, quiet
machine, 11 pairs): scan of (1) and (2) <= 0.5x picklescan, inspect of (2) <= 0.5x the load, scan of (3) <= 1.0x,
scan of (4) <= 1.0x, ``--jobs 2`` <= ``--jobs 1``. Figures from a loaded machine are not claims.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import pairs
from children import REPO, run_child, warm_cache

BUILD = """
import collections, os, pickle, sys, torch
out, scale = sys.argv[1], float(sys.argv[2])
size = int(sys.argv[3])  # bytes of (1) and of (2); 0: the issue's sizes, and the folder of small pickles
n_blobs, n_tensors = max(2, int(2000 * scale)), max(2, int(500 * scale))
blob, numel = (size // n_blobs, size // (4 * n_tensors)) if size else (100_000, 1 << 18)
n_small = 0 if size else max(2, int(500 * scale))
rnd = os.urandom(blob)
with open(os.path.join(out, "blobs.pkl"), "wb") as f:
    pickle.dump(collections.OrderedDict((f"blob{i}", rnd[i % 97:] + rnd[:i % 97]) for i in range(n_blobs)), f)
torch.manual_seed(0)
sd = {f"layer{i}.weight": torch.randn(numel) for i in range(n_tensors)}
with open(os.path.join(out, "tensors.pkl"), "wb") as f:
    pickle.dump(sd, f)
torch.save(sd, os.path.join(out, "legacy.pt"), _use_new_zipfile_serialization=False)
for i in range(n_small):
    os.makedirs(os.path.join(out, "small"), exist_ok=True)
    with open(os.path.join(out, "small", f"part{i:04d}.pkl"), "wb") as f:
        pickle.dump({"step": i, "w": torch.randn(8), "b": torch.zeros(2)}, f)
print(n_tensors)
"""

#: what loads each input in the baseline of ``inspect`` (a throwaway process; weights_only=False for it only)
LOAD = """
import pickle, sys, torch
try:
    torch.load(sys.argv[1], map_location="meta", weights_only=False)
except RuntimeError:  # "Invalid magic number": torch.load refuses a plain pickle; pickle.load is its loader
    with open(sys.argv[1], "rb") as f:
        pickle.load(f)
"""


def build(workdir: str, scale: float, size_gb: float = 0.0) -> int:
    """Write the four inputs under ``workdir`` (a child with torch), or with ``size_gb`` (1), (2) and (3) only, each
    about ``size_gb`` GB (as many blobs and tensors as without it, larger); returns the tensor count of (2) and
    (3)."""
    proc = subprocess.run([sys.executable, "-c", BUILD, workdir, str(scale), str(int(size_gb * 1e9))], check=True,
                          capture_output=True, text=True)
    return int(proc.stdout.split()[-1])


def run_verdict(cmd: list[str], env: dict[str, str]) -> float:
    """Wall seconds of one run of ``cmd`` (:func:`pairs.run_once`, in its folder), where exit 1 and 4 are verdicts
    (``dangerous``: the tensors' ``_load_from_bytes``; ``needs-trust``), not failures; raises ``RuntimeError`` on
    any other non-zero exit."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, env=env, cwd=pairs.OUT_ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1, 4):
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.decode()[-300:]}")
    return wall


def warm(path: str) -> None:
    """The page cache warmed for a file or every file of a folder."""
    if os.path.isdir(path):
        for name in os.listdir(path):
            warm_cache(os.path.join(path, name))
    else:
        warm_cache(path)


#: the targets of issue 52, in the order of :func:`figures`' comparisons (A / B at most this)
TARGETS = (0.5, 0.5, 1.0, 1.0, 0.5, 1.0)


def figures(workdir: str, scale: float, n_pairs: int, smoke: bool, log: Callable[[str], None],
            size_gb: float = 0.0, keep: bool = False) -> tuple[list[pairs.Pair], list[str], list[list[str]]]:
    """Build the inputs under ``workdir`` and run the comparisons (see the module docstring): ``(pairs, notes on
    the environments, peak RSS rows [run, MiB, bound MiB])``. ``smoke``: the tools of this interpreter, no pip.
    ``size_gb``: the peak RSS rows of the inputs at that size too (:func:`big_rss`; deleted after unless ``keep``)."""
    n_tensors = build(workdir, scale)
    paths = {name: os.path.join(workdir, name) for name in ("blobs.pkl", "tensors.pkl", "legacy.pt", "small")}
    os.makedirs(pairs.OUT_ROOT, exist_ok=True)  # where pairs.run_once runs its children
    if smoke:  # no pip: this interpreter's ckptool (the checkout) and picklescan, if installed
        ck = pairs.Env("ckptool", sys.executable, [sys.executable, "-m", "ckptool"], "ckptool: the checkout (smoke)")
        exe = shutil.which("picklescan", path=os.path.dirname(sys.executable)) or shutil.which("picklescan")
        ps = pairs.Env("picklescan", None, [exe] if exe else None, exe or "skipped: picklescan not installed")
    else:
        ck, ps = pairs.ckptool_env(), pairs.picklescan_env()
    ck_env = pairs.clean_env(checkout=ck.python == sys.executable)
    env = pairs.clean_env()
    assert ck.entry is not None

    def timed(cmd: list[str], path: str, e: dict[str, str]) -> Callable[[], float]:
        def go() -> float:
            warm(path)
            return run_verdict(cmd, e)
        return go

    rows: list[pairs.Pair] = []
    for name, path in paths.items():
        p = pairs.Pair(f"ckptool scan / picklescan -p: {name}", "ckptool scan", "picklescan")
        if ps.entry is None:
            p.error = ps.note
        else:
            pairs.alternate(p, timed([*ck.entry, "scan", path], path, ck_env),
                            timed([*ps.entry, "-p", path], path, env), n_pairs, log)
        rows.append(p)
    src = paths["tensors.pkl"]
    p = pairs.Pair("ckptool inspect --json / load (torch.load meta, else pickle.load): tensors.pkl",
                   "ckptool inspect", "load")
    pairs.alternate(p, timed([*ck.entry, "inspect", "--json", src], src, ck_env),
                    timed([sys.executable, "-c", LOAD, src], src, env), n_pairs, log)
    rows.append(p)
    folder = paths["small"]
    p = pairs.Pair("ckptool scan --jobs 2 / --jobs 1: small/", "--jobs 2", "--jobs 1")
    pairs.alternate(p, timed([*ck.entry, "scan", "--jobs", "2", folder], folder, ck_env),
                    timed([*ck.entry, "scan", "--jobs", "1", folder], folder, ck_env), n_pairs, log)
    rows.append(p)
    runs = [("scan", n) for n in paths] + [("inspect", "tensors.pkl")]
    rss = peak_rss(ck.entry, paths, runs, n_tensors, workdir, ck_env, "")
    if size_gb:
        rss += big_rss(ck.entry, os.path.join(workdir, "big"), scale, size_gb, ck_env, keep, log)
    return rows, [ck.note, ps.note, f"load baseline: {sys.executable}"], rss


def peak_rss(entry: list[str], paths: dict[str, str], runs: list[tuple[str, str]], n_tensors: int, workdir: str,
             env: dict[str, str], tag: str) -> list[list[str]]:
    """The peak RSS rows ``[run, MiB, bound MiB]`` of one ``ckptool COMMAND PATH`` run each of ``runs`` (command,
    input name), ``tag`` after the input's name; the bound is 64 MiB + 2 KiB per tensor (64 MiB without tensors)."""
    bound = 64 + 2 * n_tensors / 1024
    rows = []
    for command, name in runs:
        rc, wall, kib, _out, _err = run_child([*entry, command, paths[name]], workdir, env=env)
        size = os.path.getsize(paths[name]) / 1e9 if os.path.isfile(paths[name]) else 0.0
        rows.append([f"ckptool {command} {name}{tag} ({size:.2f} GB; {wall:.2f} s, exit {rc})", f"{kib / 1024:.0f}",
                     f"{bound:.1f}" if name in ("tensors.pkl", "legacy.pt") else "64 (no tensors)"])
    return rows


def big_rss(entry: list[str], folder: str, scale: float, size_gb: float, env: dict[str, str], keep: bool,
            log: Callable[[str], None]) -> list[list[str]]:
    """Write (1), (2) and (3) at ``size_gb`` GB each under ``folder`` (:func:`build`) and return the peak RSS rows of
    ``scan`` of each and ``inspect`` of (2) and (3) (:func:`peak_rss`); the files are deleted after unless
    ``keep``."""
    os.makedirs(folder, exist_ok=True)
    try:
        log(f"writing the {size_gb:g} GB inputs under {folder}")
        n_tensors = build(folder, scale, size_gb)
        paths = {name: os.path.join(folder, name) for name in ("blobs.pkl", "tensors.pkl", "legacy.pt")}
        for path in paths.values():
            warm(path)
        runs = [("scan", n) for n in paths] + [("inspect", "tensors.pkl"), ("inspect", "legacy.pt")]
        return peak_rss(entry, paths, runs, n_tensors, folder, env, f" at {size_gb:g} GB")
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=11, help="counted A B pairs per comparison (default 11)")
    ap.add_argument("--scale", type=float, default=1.0, help="size factor of the inputs (default 1.0: the issue's)")
    ap.add_argument("--workdir", default=None, help="where to write the inputs (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the inputs")
    ap.add_argument("--size-gb", type=float, default=0.0, metavar="G",
                    help="also write the blob, tensor and legacy inputs at about G GB each (same structure) and report "
                         "the peak RSS of scan and inspect on them (no pairs; about 3*G GB of disk)")
    ap.add_argument("--smoke", action="store_true", help="--scale 0.02 --pairs 1, tools from this interpreter")
    args = ap.parse_args(argv)
    if args.smoke:
        args.scale, args.pairs = 0.02, 1
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-pickles-")
    os.makedirs(workdir, exist_ok=True)
    try:
        rows, notes, rss = figures(workdir, args.scale, args.pairs, args.smoke,
                                   lambda msg: print(msg, file=sys.stderr, flush=True), args.size_gb, args.keep)
        print(f"pickles at the speed of their opcodes (issue 52): {args.pairs} pairs after a warm-up, wall s, "
              f"scale {args.scale}{' (smoke: nothing to claim)' if args.smoke else ''}")
        print("\n".join("  " + n for n in notes))
        for p, limit in zip(rows, TARGETS):
            print("  " + " | ".join(p.row()) + f" | target <= {limit}x")
        print("peak RSS (one run each; ru_maxrss of the child), MiB | bound MiB:")
        print("\n".join("  " + " | ".join(r) for r in rss))
        failed = [p.name for p in rows if p.error and not p.error.startswith("skipped")]
        return 1 if failed else 0
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.chdir(REPO)
    sys.exit(main())
