"""Consolidating a Megatron-Core ``torch_dist`` folder: ``ckptool convert`` against torch's ``dcp_to_torch_save``,
wall time and peak RSS side by side.

    python benchmarks/bench_megatron.py FOLDER       # a torch_dist folder, e.g. made by
    MEGATRON_BIG=10,2048 /work/venv-megatron/bin/python fixtures/make_megatron.py FOLDER big   # ~1 GiB, bf16

Each tool runs in its own process under ``/usr/bin/time -v`` (its peak RSS is the child's maximum resident set):
``ckptool convert FOLDER -o out.safetensors`` (with its verification, and with ``--no-verify``, which imports no
torch), ``ckptool convert FOLDER -o out.pt``, and ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save
(FOLDER, out.pt)``. The outputs are compared tensor by tensor (ckptool's safetensors against torch's file). Results
are printed as JSON and written to ``benchmarks/out/megatron.json``.
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
_DCP_TO_TORCH = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; "
                 "f(sys.argv[1], sys.argv[2])")


def _timed(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd`` under ``/usr/bin/time -v``: wall seconds and peak RSS in MiB."""
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, check=False,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"{cmd} failed: {p.stderr[-2000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", p.stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    assert wall is not None and rss is not None, p.stderr
    h, m, s = wall.groups()
    return {"wall_s": round(int(h or 0) * 3600 + int(m) * 60 + float(s), 2), "peak_rss_mib": int(rss.group(1)) // 1024}


def _equal(st_path: Path, pt_path: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    a = load_file(str(st_path))
    b = torch.load(pt_path, weights_only=True, mmap=True)
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    a = ap.parse_args(argv)
    size = sum(f.stat().st_size for f in a.folder.iterdir() if f.is_file())
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, object] = {"folder_bytes": size, "loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}
    with tempfile.TemporaryDirectory(dir=a.folder.parent) as tmp:
        t = Path(tmp)
        ck = [sys.executable, "-m", "ckptool", "convert", str(a.folder)]
        res["ckptool convert -o .safetensors --no-verify"] = _timed([*ck, "-o", str(t / "nv.safetensors"),
                                                                     "--no-verify"])
        res["ckptool convert -o .safetensors"] = _timed([*ck, "-o", str(t / "out.safetensors")])
        res["ckptool convert -o .pt"] = _timed([*ck, "-o", str(t / "ck.pt")])
        res["dcp_to_torch_save"] = _timed([sys.executable, "-c", _DCP_TO_TORCH, str(a.folder), str(t / "ref.pt")])
        res["equal"] = _equal(t / "out.safetensors", t / "ref.pt")
    res["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    (out / "megatron.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0 if res["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
