"""Scanning a bucket and rewriting a many-shard set with ``--jobs`` (issue 38), measured.

Scan: ``tests/remote_servers.py``'s HTTP server (``Range``, ETags, folder index pages) with ``delay`` seconds added
to every request (default 50 ms: a distant object store), serving ``--files`` checkpoints of mixed formats whose
sizes run log-uniformly from 2 KB to ``--max-mb`` MB (torch zip files 80 %, safetensors 15 %, small legacy torch
files 5 %). ``ckptool scan URL/ --jsonl`` runs in a subprocess with ``--jobs 1`` and ``--jobs 16``; then twice more
with ``--cache`` (a first run that fills it, and a second that should read no object). For each: wall time, files
per second, body bytes the server sent (range reads and index pages) as a share of the bytes stored, and requests.

Rewrite: a set of ``--shards`` torch shards holding ``--set-gib`` GiB on local disk, ``ckptool remap --to cpu``
with ``--jobs 1`` and ``--jobs 2``: wall time and peak RSS (``ru_maxrss`` of the child: the process and its
threads).

    python benchmarks/bench_scale.py                       # the figures of docs/performance.md
    python benchmarks/bench_scale.py --files 60 --max-mb 4 --shards 8 --set-gib 0.125   # a quick look

Prints one JSON object, and the load average before and after (the machine is shared: timings are indicative).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from remote_servers import Files, RangeHandler  # noqa: E402


class CountingHandler(RangeHandler):
    """:class:`RangeHandler` counting requests (HEAD and GET) on its server."""

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        with self.server.lock:
            self.server.requests = getattr(self.server, "requests", 0) + 1
        super().do_HEAD()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        with self.server.lock:
            self.server.requests = getattr(self.server, "requests", 0) + 1
        super().do_GET()


def make_bucket(folder: Path, n: int, max_mb: float, seed: int = 38) -> int:
    """``n`` checkpoints in ``folder/bucket`` (sizes log-uniform 2 KB .. ``max_mb`` MB); their total bytes."""
    import torch
    from safetensors.torch import save_file

    rng = random.Random(seed)
    out = folder / "bucket"
    lo, hi = math.log(2e3), math.log(max_mb * 1e6)
    for i in range(n):
        size = int(math.exp(rng.uniform(lo, hi)))
        kind = rng.random()
        sub = out / f"team{i % 10}"
        sub.mkdir(parents=True, exist_ok=True)
        t = {"w": torch.zeros(max(1, size // 4)), "b": torch.arange(4.0)}
        if kind < 0.80:
            torch.save({"model": t, "step": i}, sub / f"ckpt{i:04d}.pt")
        elif kind < 0.95:
            save_file(t, str(sub / f"ckpt{i:04d}.safetensors"))
        else:  # legacy files are old and small: read whole (no index to range-read)
            torch.save({"w": torch.zeros(min(size, 50_000) // 4)}, sub / f"ckpt{i:04d}.pt",
                       _use_new_zipfile_serialization=False)
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def run(cmd: list[str]) -> tuple[float, int, str]:
    """Wall seconds, exit status and stdout of ``cmd``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CKPTOOL_NO_PROGRESS": "1"}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return time.perf_counter() - t0, p.returncode, p.stdout


def scan_figures(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    stored = make_bucket(work, args.files, args.max_mb)
    server = Files(("127.0.0.1", 0), CountingHandler)
    server.root = work
    server.delay = args.delay
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/bucket/"
    cache = work / "scans.sqlite"
    out: dict[str, Any] = {"files": args.files, "bytes_stored": stored, "delay_s": args.delay}
    for label, extra in [("jobs1", ["--jobs", "1"]), ("jobs16", ["--jobs", "16"]),
                         ("cache_first", ["--jobs", "16", "--cache", str(cache)]),
                         ("cache_second", ["--jobs", "16", "--cache", str(cache)])]:
        sent0, req0 = server.sent, getattr(server, "requests", 0)
        secs, code, stdout = run([sys.executable, "-m", "ckptool", "scan", url, "--jsonl", *extra])
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        sent = server.sent - sent0
        out[label] = {"seconds": round(secs, 2), "exit": code, "checkpoints": len(rows),
                      "files_per_s": round(len(rows) / secs, 1), "bytes_sent": sent,
                      "share_of_stored": round(sent / stored, 5), "requests": getattr(server, "requests", 0) - req0,
                      "bytes_read_reported": sum(r.get("bytes_read") or 0 for r in rows)}
        print(label, out[label], file=sys.stderr)
    server.shutdown()
    out["speedup_16_vs_1"] = round(out["jobs1"]["seconds"] / out["jobs16"]["seconds"], 2)
    out["cache_speedup"] = round(out["cache_first"]["seconds"] / out["cache_second"]["seconds"], 2)
    return out


def make_set(folder: Path, shards: int, gib: float) -> Path:
    """A set of ``shards`` torch shards of ``gib`` GiB in all (one tensor each, tagged cuda:0 by ckptool) in
    ``folder/set``; its index."""
    import torch

    out = folder / "set"
    out.mkdir()
    per = int(gib * (1 << 30)) // shards // 4
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({f"layers.{i}.weight": torch.zeros(per)}, out / name)
        weight_map[f"layers.{i}.weight"] = name
    index = out / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": per * 4 * shards}, "weight_map": weight_map}))
    return index


def remap_figures(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    index = make_set(work, args.shards, args.set_gib)
    out: dict[str, Any] = {"shards": args.shards, "gib": args.set_gib}
    for jobs in (1, 2, 1, 2):  # interleaved: a change in the machine's state hits both
        dst = work / f"out{jobs}"
        # VmHWM, not ru_maxrss: the child's ru_maxrss starts at this process's RSS (torch imported) at fork
        probe = ("import sys; sys.argv = ['ckptool'] + sys.argv[1:]; from ckptool.cli import main\n"
                 "try:\n    main()\nfinally:\n    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')]"
                 "\n    print('MAXRSS', hwm[0].split()[1], file=sys.stderr)")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CKPTOOL_NO_PROGRESS": "1"}
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", probe, "remap", str(index.parent), "--to", "cpu", "-o", str(dst),
                            "--jobs", str(jobs), "-q"], capture_output=True, text=True, env=env, check=False)
        secs = time.perf_counter() - t0
        rss = next(int(line.split()[1]) for line in p.stderr.splitlines() if line.startswith("MAXRSS"))
        out.setdefault(f"jobs{jobs}", []).append({"seconds": round(secs, 2), "exit": p.returncode,
                                                   "peak_rss_mib": round(rss / 1024, 1)})
        print(f"remap jobs {jobs}", out[f"jobs{jobs}"][-1], file=sys.stderr)
        shutil.rmtree(dst)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=500)
    ap.add_argument("--max-mb", type=float, default=50)
    ap.add_argument("--delay", type=float, default=0.05)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--set-gib", type=float, default=2.0)
    ap.add_argument("--only", choices=["scan", "remap"])
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.workdir))
    result: dict[str, Any] = {"loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}
    try:
        if args.only in (None, "scan"):
            result["scan"] = scan_figures(args, work)
        if args.only in (None, "remap"):
            result["remap"] = remap_figures(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    result["self_maxrss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
