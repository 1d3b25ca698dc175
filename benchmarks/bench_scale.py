"""Scanning a bucket and rewriting a many-shard set with ``--jobs`` (issue 38), measured.

Scan: one bucket of ``--files`` checkpoints of mixed formats whose sizes run log-uniformly from 2 KB to ``--max-mb``
MB (torch zip files 80 %, safetensors 15 %, small legacy torch files 5 %), served with ``--delay`` seconds (default
50 ms: a distant object store) added to every request by two servers on 127.0.0.1:

* ``http``: ``tests/remote_servers.py``'s HTTP server (``Range``, ETags, folder index pages: the one the remote
  tests use) with its connections kept open (HTTP/1.1, as object stores do) and its ETags computed before the
  runs (an object store keeps them; hashing a 50 MB file on each ``HEAD`` would be the server's cost, not the
  scanner's);
* ``s3``: moto's S3 server (werkzeug, as ``moto.server.ThreadedMotoServer`` runs it) behind a WSGI middleware that
  adds the delay and counts requests and body bytes; its listing carries each key's size and ETag.

``ckptool scan URL/ --jsonl`` runs in a subprocess with ``--jobs 1`` and ``--jobs 16``; then twice more with
``--jobs 16 --cache`` (a first run that fills it, and a second that should read no object), and once more with
``--jobs 1 --cache`` (the second run beside the first ``--jobs 1`` run). For each: wall time,
files per second, body bytes the server sent (range reads and listings) as a share of the bytes stored, and
requests (``HEAD``, ``GET`` of objects, listings). The closing ``targets`` list gives every figure of the issue
beside its target.

Rewrite: a set of ``--shards`` torch shards holding ``--set-gib`` GiB on local disk, ``ckptool remap --to cpu``
with ``--jobs 1`` and ``--jobs 2``: wall time and peak RSS (``VmHWM`` of the child: the process and its threads).

    python benchmarks/bench_scale.py                       # the figures of docs/performance.md
    python benchmarks/bench_scale.py --only scan           # the bucket alone, over HTTP and S3
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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from remote_servers import Files, RangeHandler, _etag, free_port  # noqa: E402

#: the issue's targets: (figure, key in the scan figures, comparison, target)
TARGETS = [("files/s --jobs 16 / --jobs 1", "speedup_16_vs_1", ">=", 6.0),
           ("bytes read / bytes stored, --jobs 16", "share_of_stored", "<", 0.02),
           ("--cache: first run / second run, both --jobs 16", "cache_speedup", ">=", 20.0),
           ("--cache: first run / second run, both --jobs 1", "cache_speedup_jobs1", ">=", 20.0),
           ("--cache: object bytes read in the second run", "cache_second_object_bytes", "==", 0)]


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


#: where the child processes keep their compiled modules when this environment turns bytecode files off
#: (``PYTHONDONTWRITEBYTECODE``): an installed ckptool and its dependencies have theirs, so a start-up that
#: compiles aiohttp or botocore from source each time would be this machine's cost, not a user's
PYCACHE = Path(tempfile.gettempdir()) / "ckptool-bench-scale-pycache"


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Wall seconds, exit status and stdout of ``cmd``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CKPTOOL_NO_PROGRESS": "1", **(env or {})}
    if env.pop("PYTHONDONTWRITEBYTECODE", None):
        env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return time.perf_counter() - t0, p.returncode, p.stdout


class Counts:
    """Requests and body bytes a server answered: (kind, bytes) per request, kind ``head``, ``object`` (a GET of an
    object) or ``list`` (an index page, a listing)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, int]] = []

    def add(self, kind: str, n: int) -> None:
        with self.lock:
            self.seen.append((kind, n))

    def since(self, mark: int) -> dict[str, int]:
        with self.lock:
            seen = self.seen[mark:]
        out = {"requests": len(seen), "bytes_sent": sum(n for _k, n in seen)}
        for kind in ("head", "object", "list"):
            out[f"{kind}_requests"] = sum(1 for k, _n in seen if k == kind)
            out[f"{kind}_bytes"] = sum(n for k, n in seen if k == kind)
        return out


class CountingHandler(RangeHandler):
    """:class:`RangeHandler` counting each answer's kind and body bytes in its server's ``counts``, keeping its
    connections open (HTTP/1.1, with ``TCP_NODELAY`` so that a body written after its headers is not held back by
    Nagle's algorithm), as an object store does: ``http.server``'s HTTP/1.0 closes each one, and a new TCP
    connection per request costs the client CPU that no object store makes it spend."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        super().do_HEAD()
        self.server.counts.add("head", 0)  # type: ignore[attr-defined]

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.body_bytes, self.listed = 0, False
        super().do_GET()
        self.server.counts.add("list" if self.listed else "object", self.body_bytes)  # type: ignore[attr-defined]

    def _index(self) -> bool:
        self.listed = super()._index()
        return self.listed


def http_bucket(work: Path, delay: float, counts: Counts) -> Iterator[tuple[str, dict[str, str]]]:
    """The bucket on :class:`CountingHandler`'s server: its URL and the environment a scan needs (none)."""
    for p in (work / "bucket").rglob("*"):
        if p.is_file():
            _etag(p)  # the server's ETag cache, filled before the runs (an object store keeps its ETags)
    server = Files(("127.0.0.1", 0), CountingHandler)
    server.root = work
    server.delay = delay
    server.counts = counts  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/bucket/", {}
    finally:
        server.shutdown()


def _delayed(app: Callable[..., Iterable[bytes]], delay: float, counts: Counts) -> Callable[..., Iterable[bytes]]:
    """The WSGI app ``app`` with ``delay`` seconds added to every request, each counted in ``counts``."""
    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        time.sleep(delay)
        method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
        keyed = environ.get("PATH_INFO", "/").strip("/").count("/") >= 1
        kind = "head" if method == "HEAD" else "object" if method == "GET" and keyed else "list"
        if "list-type" in query or "prefix=" in query:
            kind = "list"
        body = app(environ, start_response)
        n = 0
        for piece in body:
            n += len(piece)
            yield piece
        counts.add(kind, n if method == "GET" else 0)
    return wrapped


def s3_bucket(work: Path, delay: float, counts: Counts) -> Iterator[tuple[str, dict[str, str]]]:
    """The bucket on moto's S3 server (its own backend, filled in-process) behind :func:`_delayed`: its URL and the
    environment a scan needs (fake credentials, the endpoint)."""
    from moto.moto_server.threaded_moto_server import MotoRequestHandler
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from moto.s3.models import s3_backends
    from werkzeug.serving import make_server

    backend = s3_backends["123456789012"]["aws"]
    backend.create_bucket("bench", "us-east-1")
    for p in sorted((work / "bucket").rglob("*")):
        if p.is_file():
            backend.put_object("bench", str(p.relative_to(work / "bucket")), p.read_bytes())
    class Quiet(MotoRequestHandler):  # type: ignore[misc]
        def log_message(self, *args: Any) -> None:
            pass

    port = free_port()
    app = _delayed(DomainDispatcherApplication(create_backend_app), delay, counts)
    server = make_server("127.0.0.1", port, app, True, request_handler=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    try:
        yield "s3://bench/", env
    finally:
        server.shutdown()


def scan_figures(args: argparse.Namespace, work: Path, stored: int, protocol: str) -> dict[str, Any]:
    """The four runs over one protocol's server (see the module docstring)."""
    counts = Counts()
    serve = http_bucket if protocol == "http" else s3_bucket
    cache = work / f"scans-{protocol}.sqlite"
    out: dict[str, Any] = {"files": args.files, "bytes_stored": stored, "delay_s": args.delay}
    backend = "fsspec.implementations.http" if protocol == "http" else "s3fs"
    startup = [sys.executable, "-c", f"import ckptool.cli.scan, ckptool.cli._many, ckptool.scanning.entry, {backend}"]
    run(startup)  # compiled modules in place
    out["startup_s"] = sorted(run(startup)[0] for _ in range(3))[1]
    for url, env in serve(work, args.delay, counts):
        for label, extra in [("jobs1", ["--jobs", "1"]), ("jobs16", ["--jobs", "16"]),
                             ("cache_first", ["--jobs", "16", "--cache", str(cache)]),
                             ("cache_second", ["--jobs", "16", "--cache", str(cache)]),
                             ("cache_second_jobs1", ["--jobs", "1", "--cache", str(cache)])]:
            mark = len(counts.seen)
            secs, code, stdout = run([sys.executable, "-m", "ckptool", "scan", url, "--jsonl", *extra], env)
            rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            got = counts.since(mark)
            out[label] = {"seconds": round(secs, 2), "exit": code, "checkpoints": len(rows),
                          "files_per_s": round(len(rows) / secs, 1), **got,
                          "share_of_stored": round(got["object_bytes"] / stored, 5),
                          "requests_per_file": round(got["requests"] / max(1, len(rows)), 2),
                          "bytes_read_reported": sum(r.get("bytes_read") or 0 for r in rows),
                          "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
            print(protocol, label, out[label], file=sys.stderr)
    out["speedup_16_vs_1"] = round(out["jobs1"]["seconds"] / out["jobs16"]["seconds"], 2)
    out["share_of_stored"] = out["jobs16"]["share_of_stored"]
    out["cache_speedup"] = round(out["cache_first"]["seconds"] / out["cache_second"]["seconds"], 2)
    out["cache_speedup_jobs1"] = round(out["jobs1"]["seconds"] / out["cache_second_jobs1"]["seconds"], 2)
    out["cache_second_object_bytes"] = out["cache_second"]["object_bytes"] + out["cache_second_jobs1"]["object_bytes"]
    # what the cache changes, the process's start-up (the imports of ckptool and the fsspec backend) aside
    work_first = out["cache_first"]["seconds"] - out["startup_s"]
    work_second = max(0.01, out["cache_second"]["seconds"] - out["startup_s"])
    out["cache_speedup_after_startup"] = round(work_first / work_second, 1)
    out["targets"] = [f"{name}: {out[key]} (target {op} {target}): "
                      f"{'met' if _meets(out[key], op, target) else 'NOT met'}" for name, key, op, target in TARGETS]
    out["targets"].append(f"(not a target) --cache: first run / second run, start-up ({out['startup_s']:.2f} s) "
                          f"taken from both: {out['cache_speedup_after_startup']}")
    for line in out["targets"]:
        print(protocol, line, file=sys.stderr)
    return out


def _meets(value: float, op: str, target: float) -> bool:
    return value >= target if op == ">=" else value < target if op == "<" else value == target


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
    ap.add_argument("--protocols", default="http,s3", help="the bucket's servers, of http and s3")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.workdir))
    result: dict[str, Any] = {"loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}
    try:
        if args.only in (None, "scan"):
            stored = make_bucket(work, args.files, args.max_mb)
            for protocol in args.protocols.split(","):
                result[f"scan_{protocol}"] = scan_figures(args, work, stored, protocol)
        if args.only in (None, "remap"):
            result["remap"] = remap_figures(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    result["self_maxrss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(result, indent=2))
    for protocol in args.protocols.split(",") if args.only in (None, "scan") else ():
        for line in result[f"scan_{protocol}"]["targets"]:
            print(f"{protocol}: {line}")


if __name__ == "__main__":
    main()
