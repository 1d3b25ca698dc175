"""Copy-free remap on a filesystem with reflinks: ``ckptool remap`` (records cloned with ``FICLONERANGE``)
against ``cp --reflink=never SRC DST && sync DST`` (a durable copy) and ``cp --reflink=always`` (a clone of the
whole file, with and without ``sync``), median wall time of several runs, all on the same filesystem.

    python benchmarks/bench_reflink.py                      # 1 GiB, on a loop-mounted XFS image made here (root)
    python benchmarks/bench_reflink.py --dir /mnt/xfs       # on a reflink filesystem you mounted yourself
    python benchmarks/bench_reflink.py --smoke              # 64 MiB, one run (skips where nothing can be mounted)

Without ``--dir`` an XFS image (``mkfs.xfs -m reflink=1``, sparse, in the system temporary folder) is
loop-mounted for the run and removed afterwards; this needs root and mkfs.xfs, else the benchmark says so and
exits 0. A loop device's writes land in its image file's page cache, so ``sync`` figures there are lower than
on a disk. Results go to ``benchmarks/out/reflink.json``.
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
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def xfs_mount(size_gib: float) -> Iterator[Path | None]:
    """A folder on a fresh loop-mounted XFS image with reflinks (None where one cannot be made)."""
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None:
        yield None
        return
    base = Path(tempfile.mkdtemp(prefix="ckptool-reflink-"))
    img, mnt = base / "xfs.img", base / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(max(int(size_gib * 3.2 * (1 << 30)), 300 << 20))
    ok = (subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(img)], capture_output=True, check=False)
          .returncode == 0 and subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True,
                                              check=False).returncode == 0)
    try:
        yield mnt if ok else None
    finally:
        if ok:
            subprocess.run(["umount", str(mnt)], check=False)
        shutil.rmtree(base, ignore_errors=True)


def timed(cmd: str, repeat: int, cleanup: Path) -> list[float]:
    """Wall seconds of ``sh -c cmd``, ``repeat`` times, removing ``cleanup`` and dropping nothing between runs."""
    out = []
    for _ in range(repeat):
        with contextlib.suppress(OSError):
            cleanup.unlink()
        os.sync()
        t0 = time.perf_counter()
        subprocess.run(["sh", "-c", cmd], check=True, stdout=subprocess.DEVNULL, env={**os.environ,
                       "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
        out.append(time.perf_counter() - t0)
    with contextlib.suppress(OSError):
        cleanup.unlink()
    return out


#: runs the CLI with :func:`ckptool._fileio.clone_block` answering 0: the copy path, for comparison
_NO_CLONE = ("import sys; from ckptool.formats import torchzip; torchzip.clone_block = lambda s, d: 0; "
             "from ckptool.cli import main; sys.argv[0] = 'ckptool'; main()")


def run(folder: Path, size_gib: float, repeat: int) -> dict[str, object]:
    import torch

    src, dst = folder / "model.pt", folder / "out.pt"
    n = 16
    rows = max(1, int(size_gib * (1 << 30) / n / 4 / 4096))
    torch.save({f"layer{i}.weight": torch.randn(rows, 4096) for i in range(n)}, src)
    q = f"'{src}' '{dst}'"
    cmds = {
        "ckptool remap --to cuda:0 (clones, fsync)": f"{sys.executable} -m ckptool remap {q.split()[0]} "
                                                     f"--to cuda:0 -o '{dst}'",
        "ckptool remap, cloning switched off (copies)": f"{sys.executable} -c \"{_NO_CLONE}\" remap "
                                                        f"'{src}' --to cuda:0 -o '{dst}'",
        "ckptool inspect (reads the pickle only)": f"{sys.executable} -m ckptool inspect '{src}'",
        "python -m ckptool --version (start-up alone)": f"{sys.executable} -m ckptool --version",
        "cp --reflink=never && sync": f"cp --reflink=never {q} && sync '{dst}'",
        "cp --reflink=always": f"cp --reflink=always {q}",
        "cp --reflink=always && sync": f"cp --reflink=always {q} && sync '{dst}'",
    }
    res: dict[str, object] = {"file_bytes": src.stat().st_size, "folder": str(folder), "repeat": repeat}
    print(f"reflink: {src.stat().st_size / (1 << 20):.0f} MiB on {folder} (median of {repeat})", file=sys.stderr)
    for label, cmd in cmds.items():
        t = timed(cmd, repeat, dst)
        res[label] = {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}
        print(f"  {label:45s} {statistics.median(t):7.3f} s  (spread {min(t):.3f}-{max(t):.3f})", file=sys.stderr)
    src.unlink()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, help="a folder on a reflink filesystem (default: a loop-mounted XFS image)")
    ap.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size in GiB (default 1.0)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per command (default 5)")
    ap.add_argument("--smoke", action="store_true", help="64 MiB, one run")
    args = ap.parse_args(argv)
    size, repeat = (1 / 16, 1) if args.smoke else (args.size_gib, args.repeat)
    with contextlib.ExitStack() as stack:
        folder = args.dir if args.dir is not None else stack.enter_context(xfs_mount(size))
        if folder is None:
            print("reflink: skipped (no --dir, and no XFS image could be loop-mounted: needs root and mkfs.xfs)",
                  file=sys.stderr)
            return 0
        res = run(folder, size, repeat)
    out = REPO / "benchmarks" / "out"
    out.mkdir(exist_ok=True)
    (out / "reflink.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
