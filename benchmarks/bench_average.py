#!/usr/bin/env python3
"""Peak memory of ``ckptool average`` on three checkpoints of 256 MiB (issue 29: under 160 MiB), against the usual
``torch.load`` + float64 loop of timm's ``avg_checkpoints.py``.

Usage::

    python benchmarks/bench_average.py [--workdir DIR] [--size-mib 256] [--repeat 1] [--json]
    python benchmarks/bench_average.py --smoke      # 16 MiB files; exit 1 when an average is wrong
    python benchmarks/bench.py --extras             # runs this module too

Builds three zip-format state_dicts in a child process: 64 float32 tensors ``layers.{i}.weight`` of ``rows x
1024`` (``--size-mib`` in all) filled with ``i + k`` in input ``k``, and an int64 ``bn.num_batches_tracked`` of
``k``. Then runs, each as a child process (wall clock and peak RSS ``ru_maxrss`` from ``wait4``, page cache
warmed first):

======================  =========================================================================================
label                   command
======================  =========================================================================================
ckptool average .pth    ``python -m ckptool average A B C -o out.pth``
ckptool average .st     ``python -m ckptool average A B C -o out.safetensors``
torch.load + loop       ``torch.load`` each input (``mmap=False``), ``sum(v.double())``, ``/ 3``, ``.float()``,
                        ``torch.save``: the shape of timm's ``avg_checkpoints.py``
======================  =========================================================================================

Every output is checked in a child (tensor ``i`` equals ``i + 1``, the counter is the first input's 0 for ckptool).
Only the standard library is used here; torch runs in the children.
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
N_TENSORS = 64
COLS = 1024
#: issue 29's target for three inputs of 256 MiB
TARGET_MIB = 160

_BUILD = r"""
import sys, torch
rows = int(sys.argv[1])
for k, path in enumerate(sys.argv[2:]):
    sd = {f"layers.{i}.weight": torch.full((rows, 1024), float(i + k)) for i in range(64)}
    sd["bn.num_batches_tracked"] = torch.tensor(k)
    torch.save(sd, path)
"""

_TORCH_LOOP = r"""
import sys, torch
acc = {}
for p in sys.argv[1:4]:
    for k, v in torch.load(p, map_location="cpu", weights_only=True).items():
        acc[k] = acc[k] + v.double() if k in acc else v.double()
torch.save({k: (v / 3).float() for k, v in acc.items()}, sys.argv[4])
"""

_CHECK = r"""
import sys, torch
path, counter = sys.argv[1], int(sys.argv[2])
if path.endswith(".safetensors"):
    from safetensors.torch import load_file
    sd = load_file(path)
else:
    sd = torch.load(path, mmap=True, weights_only=True)
bad = [k for i in range(64) if not torch.all(sd[k := f"layers.{i}.weight"] == float(i + 1))]
bad += [] if int(sd["bn.num_batches_tracked"]) == counter else ["bn.num_batches_tracked"]
print(",".join(bad))
"""


def commands(inputs: list[str], workdir: str) -> dict[str, tuple[list[str], str, int]]:
    """label -> (command, output path, expected counter)."""
    py = sys.executable
    pth, st, ref = (os.path.join(workdir, n) for n in ("avg.pth", "avg.safetensors", "torch.pth"))
    return {
        "ckptool average .pth": ([py, "-m", "ckptool", "average", *inputs, "-o", pth, "--force"], pth, 0),
        "ckptool average .st": ([py, "-m", "ckptool", "average", *inputs, "-o", st, "--force"], st, 0),
        "torch.load + loop": ([py, "-c", _TORCH_LOOP, *inputs, ref], ref, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", help="where to build the files (default: a fresh folder under benchmarks/out/)")
    ap.add_argument("--size-mib", type=float, default=256.0, help="size of each input in MiB (default 256)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per command; median time, max RSS (default 1)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--smoke", action="store_true", help="--size-mib 16; exit 1 when an output is wrong")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size_mib = 16.0
    rows = max(1, int(args.size_mib * (1 << 20) / (N_TENSORS * COLS * 4)))
    os.makedirs(DEFAULT_OUT_ROOT, exist_ok=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-average-", dir=DEFAULT_OUT_ROOT)
    os.makedirs(workdir, exist_ok=True)
    inputs = [os.path.join(workdir, f"avg-in-{k}.pt") for k in range(3)]
    failed: list[str] = []
    results: dict[str, dict[str, object]] = {}
    try:
        compile_checkout()
        subprocess.run([sys.executable, "-c", _BUILD, str(rows), *inputs], check=True, env=child_env())
        cmds = commands(inputs, workdir)
        walls: dict[str, list[float]] = {k: [] for k in cmds}
        rss: dict[str, list[int]] = {k: [] for k in cmds}
        for _ in range(args.repeat):
            for label, (cmd, out, counter) in cmds.items():
                for p in inputs:
                    warm_cache(p)
                rc, wall, kib, _out, err = run_child(cmd, workdir)
                check = subprocess.run([sys.executable, "-c", _CHECK, out, str(counter)], capture_output=True,
                                       text=True, env=child_env(), check=False) if rc == 0 else None
                if check is None or check.returncode or check.stdout.strip():
                    why = (err.strip().splitlines() or [f"exit status {rc}"])[-1] if check is None else \
                        (check.stdout.strip() or check.stderr.strip())
                    failed.append(f"{label}: {why}")
                    continue
                walls[label].append(wall)
                rss[label].append(kib)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(out)
        for label in cmds:
            ok = bool(walls[label])
            results[label] = {"median_wall_s": statistics.median(walls[label]) if ok else None,
                              "peak_rss_mib": max(rss[label]) / 1024 if ok else None}
        size_mib = os.path.getsize(inputs[0]) / (1 << 20)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    worst = max((r["peak_rss_mib"] or 0.0 for k, r in results.items() if k.startswith("ckptool")), default=None)
    met = worst is not None and worst <= TARGET_MIB
    if args.json:
        print(json.dumps({"file_mib": size_mib, "repeat": args.repeat, "runs": results, "target_mib": TARGET_MIB,
                          "target_met": met, "failed": failed}, indent=2))
    else:
        print(f"ckptool average: three files of {size_mib:.0f} MiB; median of {args.repeat}; target: peak RSS <= "
              f"{TARGET_MIB} MiB ({'met' if met else 'NOT met'})")
        print(f"{'command':<22} {'wall s':>8} {'peak RSS MiB':>13}")
        for label, r in results.items():
            w, m = r["median_wall_s"], r["peak_rss_mib"]
            print(f"{label:<22} {w if w is None else f'{w:.2f}':>8} {m if m is None else f'{m:.0f}':>13}")
        for line in failed:
            print(f"FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
