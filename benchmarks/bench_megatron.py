"""Consolidating a Megatron-Core ``torch_dist`` folder: ``ckptool convert`` against torch's ``dcp_to_torch_save``,
wall time and peak RSS side by side.

    python benchmarks/bench_megatron.py FOLDER       # a torch_dist folder, e.g. made by
    MEGATRON_BIG=10,2048 /work/venv-megatron/bin/python fixtures/make_megatron.py FOLDER big   # ~1 GiB, bf16

Each tool runs in its own process under ``/usr/bin/time -v`` (its peak RSS is the child's maximum resident set):
``ckptool convert FOLDER -o out.safetensors`` (with its verification, and with ``--no-verify``, which imports no
torch), ``ckptool convert FOLDER -o out.pt``, and ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save
(FOLDER, out.pt)``. The outputs are compared tensor by tensor (ckptool's safetensors against torch's file). One
more ``convert --no-verify`` run counts ckptool's reads of the source files (``FileRanges.readinto`` calls and their
bytes: a chunk split on a later dimension is one range per row, read with one read per run of adjacent rows since
issue 40). ``--tree DIR`` runs the ckptool package of another checkout (e.g. ``git worktree add /tmp/before
00a0d5a``: the figures before a change), this checkout by default. Results are printed as JSON and written to
``benchmarks/out/megatron.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_READS = ("import json, sys\nfrom ckptool.readers import data\nn = [0, 0]\nreal = data.FileRanges.readinto\n"
          "def counting(self, path, offset, buf):\n    n[0] += 1\n    n[1] += len(buf)\n"
          "    return real(self, path, offset, buf)\n"
          "data.FileRanges.readinto = counting\nfrom ckptool.ops.convert import convert\n"
          "convert(sys.argv[1], sys.argv[2], verify=False)\nprint(json.dumps({'reads': n[0], 'bytes': n[1]}))")
_DCP_TO_TORCH = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; "
                 "f(sys.argv[1], sys.argv[2])")


def _timed(cmd: list[str], tree: Path = ROOT) -> dict[str, float]:
    """Run ``cmd`` under ``/usr/bin/time -v`` (the ckptool package of ``tree``): wall seconds, CPU seconds (user +
    system: less bound to a shared machine's load than the wall time) and peak RSS in MiB."""
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, check=False,
                       env={**os.environ, "PYTHONPATH": str(tree)})
    if p.returncode != 0:
        raise SystemExit(f"{cmd} failed: {p.stderr[-2000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", p.stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    cpu = [float(x) for x in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", p.stderr)]
    assert wall is not None and rss is not None and len(cpu) == 2, p.stderr
    h, m, s = wall.groups()
    return {"wall_s": round(int(h or 0) * 3600 + int(m) * 60 + float(s), 2), "cpu_s": round(sum(cpu), 2),
            "peak_rss_mib": int(rss.group(1)) // 1024}


def _equal(st_path: Path, pt_path: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    a = load_file(str(st_path))
    b = torch.load(pt_path, weights_only=True, mmap=True)
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose ckptool runs (default: this one)")
    a = ap.parse_args(argv)
    size = sum(f.stat().st_size for f in a.folder.iterdir() if f.is_file())
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, object] = {"folder_bytes": size, "tree": str(a.tree),
                              "loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}
    with tempfile.TemporaryDirectory(dir=a.folder.parent) as tmp:
        t = Path(tmp)
        ck = [sys.executable, "-m", "ckptool", "convert", str(a.folder)]
        res["ckptool convert -o .safetensors --no-verify"] = _timed([*ck, "-o", str(t / "nv.safetensors"),
                                                                     "--no-verify"], a.tree)
        res["ckptool convert -o .safetensors"] = _timed([*ck, "-o", str(t / "out.safetensors")], a.tree)
        res["ckptool convert -o .pt"] = _timed([*ck, "-o", str(t / "ck.pt")], a.tree)
        (t / "nv.safetensors").unlink()
        p = subprocess.run([sys.executable, "-c", _READS, str(a.folder), str(t / "nv.safetensors")],
                           capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(a.tree)})
        res["source reads (convert --no-verify)"] = json.loads(p.stdout.strip().splitlines()[-1])
        res["dcp_to_torch_save"] = _timed([sys.executable, "-c", _DCP_TO_TORCH, str(a.folder), str(t / "ref.pt")])
        res["equal"] = _equal(t / "out.safetensors", t / "ref.pt")
    res["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    (out / "megatron.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0 if res["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
