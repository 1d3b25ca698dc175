#!/usr/bin/env python3
"""Does ``ckptool.inspect`` scale linearly with the number of tensors? A list-of-tensors checkpoint benchmark.

Usage::

    python benchmarks/bench_walk.py [--sizes 50000,100000,200000] [--repeat 3] [--workdir DIR] [--keep]
    python benchmarks/bench_walk.py --smoke      # sizes 2000,4000,8000, one run each: a few seconds

For each size N it writes ``torch.save([t_0, ..., t_{N-1}])`` (N float32 tensors of 4 elements, each with its
own storage: a state_dict held as a list, the shape that made the old recursive walkers slow) in a child process,
then times ``ckptool.inspect(path)`` in this process ``--repeat`` times (``time.perf_counter``) and reports the
median, the time per item and, for the largest and smallest sizes, ``t(N_max) / t(N_min)``: a linear walk gives
about ``N_max / N_min`` (4 for the default sizes), a quadratic one its square.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUILD = """
import sys, torch
n, path = int(sys.argv[1]), sys.argv[2]
torch.save([torch.full((4,), float(i)) for i in range(n)], path)
"""


def build(n: int, path: Path) -> None:
    """Write the N-tensor list checkpoint at ``path`` in a child process (this one never imports torch)."""
    subprocess.run([sys.executable, "-c", BUILD, str(n), str(path)], check=True)


def time_inspect(path: Path, repeat: int) -> float:
    """Median seconds of ``ckptool.inspect(path)`` over ``repeat`` runs."""
    import ckptool

    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        info = ckptool.inspect(path)
        times.append(time.perf_counter() - t)
    assert info.format == "torch-zip", info.format
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="50000,100000,200000", help="comma-separated tensor counts")
    ap.add_argument("--repeat", type=int, default=3, help="runs per size (the median is reported)")
    ap.add_argument("--workdir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep and reuse the checkpoints")
    ap.add_argument("--smoke", action="store_true", help="small sizes, one run each")
    args = ap.parse_args(argv)
    sizes = [2000, 4000, 8000] if args.smoke else [int(s) for s in args.sizes.split(",")]
    repeat = 1 if args.smoke else args.repeat
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results: dict[int, float] = {}
        print(f"{'items':>9}  {'median s':>9}  {'us/item':>8}")
        for n in sizes:
            path = workdir / f"list-{n}.pt"
            if not (args.keep and path.exists()):
                build(n, path)
            results[n] = time_inspect(path, repeat)
            print(f"{n:>9}  {results[n]:>9.3f}  {results[n] / n * 1e6:>8.2f}")
            if not args.keep:
                os.unlink(path)
    lo, hi = min(sizes), max(sizes)
    ratio = results[hi] / results[lo]
    print(f"t({hi})/t({lo}) = {ratio:.2f}  (linear: {hi / lo:.2f}, quadratic: {(hi / lo) ** 2:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
