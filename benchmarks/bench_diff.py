#!/usr/bin/env python3
"""Benchmark of ``ckptool diff`` against the usual ``torch.load`` + loop (issue 15).

Usage::

    python benchmarks/bench.py diff [--workdir DIR] [--size-gib 2.0] [--repeat 3] [--json]
    python benchmarks/bench_diff.py --smoke      # small files, one run; exit 1 when the diff is wrong

Builds two zip-format state_dicts of ``--size-gib`` GiB each in child processes (192 float32 tensors
``layers.{i}.weight`` of ``rows x 1024``; tensor ``i`` filled with ``float(i)``): A, and B = A saved from
``DataParallel`` (every key ``module.``-prefixed) with one element of ``layers.7.weight`` changed by 1e-3: a
fine-tuned copy. Then runs, each as a child process (time ``perf_counter`` around ``Popen`` .. ``wait4``, peak RSS
``ru_maxrss`` from ``wait4``; the page cache warmed before each run):

=====================  ==========================================================================================
label                  command
=====================  ==========================================================================================
ckptool diff           ``python -m ckptool diff A B --json``: bit-exact, values streamed (exit 1: they differ)
ckptool diff --atol    ``python -m ckptool diff A B --atol 1e-6 --json``: max abs / rel difference per tensor
torch.load + loop      ``torch.load`` both (``map_location='cpu', weights_only=True``), strip ``module.``,
                       ``torch.equal`` per key: what people write today; holds both files in memory
torch mmap + loop      the same with ``torch.load(mmap=True)``: pages come and go with the page cache
=====================  ==========================================================================================

Every run must name exactly ``layers.7.weight`` as different (checked from its output); the figures are printed
as a table (or ``--json``). Only the standard library is used here; torch runs in the children.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from children import child_env, compile_checkout, run_child, warm_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT_ROOT = os.path.join(REPO, "benchmarks", "out")
N_TENSORS = 192
COLS = 1024
CHANGED = "layers.7.weight"

_BUILD = r"""
import sys, torch
path_a, path_b, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
sd = {f"layers.{i}.weight": torch.full((rows, 1024), float(i)) for i in range(192)}
torch.save(sd, path_a)
sd["layers.7.weight"][0, 0] += 1e-3
torch.save({"module." + k: v for k, v in sd.items()}, path_b)
"""

_TORCH_LOOP = r"""
import sys, torch
mmap = sys.argv[3] == "mmap"
a = torch.load(sys.argv[1], map_location="cpu", weights_only=True, mmap=mmap)
b = torch.load(sys.argv[2], map_location="cpu", weights_only=True, mmap=mmap)
b = {k.removeprefix("module."): v for k, v in b.items()}
print(",".join(k for k in a if k not in b or not torch.equal(a[k], b[k])))
"""


def _changed(label: str, rc: int, stdout: str) -> list[str] | None:
    """The keys the run reported as different (None when its output cannot be read)."""
    if label.startswith("ckptool"):
        if rc != 1:
            return None
        doc = json.loads(stdout)
        return [t["key"] for t in doc["tensors"] if t.get("values") not in (None, "equal", "close")]
    if rc != 0:
        return None
    return [k for k in stdout.strip().split(",") if k]


def commands(a: str, b: str) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "ckptool diff": [py, "-m", "ckptool", "diff", a, b, "--json"],
        "ckptool diff --atol": [py, "-m", "ckptool", "diff", a, b, "--atol", "1e-6", "--json"],
        "torch.load + loop": [py, "-c", _TORCH_LOOP, a, b, "full"],
        "torch mmap + loop": [py, "-c", _TORCH_LOOP, a, b, "mmap"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", help="where to build the files (default: a fresh folder under benchmarks/out/)")
    ap.add_argument("--size-gib", type=float, default=2.0, help="size of each file in GiB (default 2.0)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per command; median time, max RSS (default 3)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--smoke", action="store_true", help="--size-gib 0.05 --repeat 1; exit 1 when a diff is wrong")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size_gib, args.repeat = 0.05, 1
    rows = max(1, int(args.size_gib * (1 << 30) / (N_TENSORS * COLS * 4)))
    os.makedirs(DEFAULT_OUT_ROOT, exist_ok=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-diff-", dir=DEFAULT_OUT_ROOT)
    os.makedirs(workdir, exist_ok=True)
    a, b = os.path.join(workdir, "diff-a.pt"), os.path.join(workdir, "diff-b.pt")
    failed: list[str] = []
    results: dict[str, dict[str, object]] = {}
    try:
        compile_checkout()
        subprocess.run([sys.executable, "-c", _BUILD, a, b, str(rows)], check=True, env=child_env())
        cmds = commands(a, b)
        walls: dict[str, list[float]] = {k: [] for k in cmds}
        rss: dict[str, list[int]] = {k: [] for k in cmds}
        for _ in range(args.repeat):
            for label, cmd in cmds.items():
                warm_cache(a)
                warm_cache(b)
                rc, wall, kib, out, err = run_child(cmd, workdir, stdout=True)
                found = _changed(label, rc, out)
                if found != [CHANGED]:
                    last = (err.strip().splitlines() or [f"exit status {rc}"])[-1]
                    failed.append(f"{label}: reported {found} ({last})")
                    continue
                walls[label].append(wall)
                rss[label].append(kib)
        for label in cmds:
            ok = bool(walls[label])
            results[label] = {"median_wall_s": statistics.median(walls[label]) if ok else None,
                              "peak_rss_mib": max(rss[label]) / 1024 if ok else None}
        size_mib = os.path.getsize(a) / (1 << 20)
    finally:
        for p in (a, b):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps({"file_mib": size_mib, "repeat": args.repeat, "runs": results, "failed": failed}, indent=2))
    else:
        print(f"ckptool diff: two files of {size_mib:.0f} MiB, one tensor changed, B with `module.`; "
              f"median of {args.repeat}")
        print(f"{'command':<22} {'wall s':>8} {'peak RSS MiB':>13}")
        for label, r in results.items():
            w, m = r["median_wall_s"], r["peak_rss_mib"]
            print(f"{label:<22} {w if w is None else f'{w:.2f}':>8} {m if m is None else f'{m:.0f}':>13}")
        for line in failed:
            print(f"FAILED {line}", file=sys.stderr)
    return 1 if failed and (args.smoke or any(k.startswith("ckptool") for k in failed)) else 0


if __name__ == "__main__":
    sys.exit(main())
