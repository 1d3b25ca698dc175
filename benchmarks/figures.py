"""The figures of ``benchmarks/bench.py`` beyond inspect/remap/strip: loading, the scale table, DCP consolidation.

Imported by bench.py only (not a ``bench_*.py`` module: the hook in bench.py runs those on their own). Like bench.py,
this process never imports torch; every measured thing runs in a child process.

* **load** (``--only load``): on checkpoint (1), a child builds a model of the file's layout (uninitialised
  parameters, so the model's pages count only once written) and loads it three ways, timing the load alone and
  reporting ``ru_maxrss`` before (after ``import torch``: the baseline) and after:
  ``ckptool.load_into(model, FILE)``, ``model.load_state_dict(torch.load(FILE, mmap=True, map_location="cpu",
  weights_only=True))`` and the same without ``mmap``. Targets: load_into time <= 1.0x the mmap load, and peak RSS
  <= baseline + model bytes + 64 MiB.
* **scale** (``--only scale``): inspect and remap of 10k, 100k and 1M float32[16] tensors, and of 100 MB, 2 GB and
  8 GB files of 192 tensors (the 8 GB one is written as zeros and turned into holes with ``fallocate --dig-holes``
  where that exists: a sparse file that reads like a full one; remap still writes all 8 GB). Time and peak RSS per
  file, with time per item / per GiB to show the growth is linear. One run each (``--repeat`` applies to the
  other figures).
* **dcp** (``--only dcp``): a ``torch.distributed.checkpoint`` folder (64 float32 tensors, 4 GiB in all) converted
  to one torch file by ``ckptool convert DIR -o OUT`` and by torch's ``format_utils.dcp_to_torch_save``. Target:
  ckptool's peak RSS <= 256 MiB. ckptool copies such a folder (every tensor stored whole) by range without torch;
  its peak is the ``import torch`` of the closing check, whatever the folder's size.

``--smoke`` uses small sizes (2 tensor counts, 2 file sizes, a 0.05 GiB DCP folder) and skips the slowest torch
baselines, so that every code path still runs in CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

LOAD_CHILD = r"""
import json, resource, sys, time
import torch
from torch import nn
mode, path, n, rows, cols = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
if mode == "ckptool":
    import ckptool, ckptool.torch_ops.load  # the import is not the load
base = rss()
class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))
model = nn.Module()
model.layers = nn.ModuleList(Layer() for _ in range(n))
model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
t0 = time.perf_counter()
if mode == "ckptool":
    ckptool.load_into(model, path)
elif mode == "torch mmap":
    model.load_state_dict(torch.load(path, mmap=True, map_location="cpu", weights_only=True))
else:
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
dt = time.perf_counter() - t0
w = model.layers[n - 1].weight
assert float(w[0, 0]) == float(n - 1) and float(w[-1, -1]) == float(n - 1), "wrong values"
print(json.dumps({"load_s": dt, "base_mib": base, "model_mib": model_mib, "peak_mib": rss()}))
"""

DCP_BUILD = r"""
import sys, warnings, torch
import torch.distributed.checkpoint as dcp
folder, n, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sd = {"model": {f"layers.{i}.weight": torch.full((rows, 1024), float(i)) for i in range(n)}, "step": 7}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.save(sd, checkpoint_id=folder, no_dist=True)
"""

DCP_TORCH = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
             "dcp_to_torch_save(sys.argv[1], sys.argv[2])")

DCP_CHECK = r"""
import sys, torch
sd = torch.load(sys.argv[1], mmap=True, map_location="cpu", weights_only=True)
n = int(sys.argv[2])
w = sd["model"][f"layers.{n - 1}.weight"]
assert sd["step"] == 7 and len(sd["model"]) == n and float(w[0, 0]) == float(n - 1), "wrong DCP conversion"
"""

Row = list[object]


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    return ys[len(ys) // 2] if len(ys) % 2 else (ys[len(ys) // 2 - 1] + ys[len(ys) // 2]) / 2


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}"


class Ctx:
    """What the figures need from bench.py: its runner, child environment, logger and work folder."""

    def __init__(self, workdir: str, repeat: int, smoke: bool, run_measured: Callable[..., Any],
                 env: Callable[[], dict[str, str]], log: Callable[[str], None], build: Callable[..., str],
                 warm: Callable[[str], None]) -> None:
        self.workdir, self.repeat, self.smoke = workdir, repeat, smoke
        self.run_measured, self.env, self.log, self.build, self.warm = run_measured, env, log, build, warm

    def child(self, args: list[str]) -> tuple[int, str, str]:
        p = subprocess.run(args, capture_output=True, text=True, env=self.env(), cwd=self.workdir, check=False)
        return p.returncode, p.stdout, p.stderr


# ------------------------------------------------------------------------------------------------ load
def load_figures(ctx: Ctx, path: str, n: int, rows: int, cols: int) -> tuple[list[Row], list[dict[str, object]]]:
    """Rows of the load table and the load targets (see the module docstring)."""
    modes = ["ckptool", "torch mmap"] if ctx.smoke else ["ckptool", "torch mmap", "torch"]
    got: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    errors: dict[str, str] = {}
    for i in range(ctx.repeat):
        for m in modes:
            if m in errors:
                continue
            ctx.warm(path)  # every loader starts from a warm page cache, as the other figures do
            rc, out, err = ctx.child([sys.executable, "-c", LOAD_CHILD, m, path, str(n), str(rows), str(cols)])
            if rc != 0:
                errors[m] = (err.strip().splitlines() or [f"exit {rc}"])[-1]
                ctx.log(f"  load {m:<12} run {i + 1}: FAILED ({errors[m]})")
                continue
            r = json.loads(out.strip().splitlines()[-1])
            got[m].append(r)
            ctx.log(f"  load {m:<12} run {i + 1}: {r['load_s']:8.3f} s  peak {r['peak_mib']:8.1f} MiB "
                    f"(baseline {r['base_mib']:.1f}, model {r['model_mib']:.1f})")
    rows_out: list[Row] = []
    med: dict[str, float] = {}
    for m in modes:
        if m in errors or not got[m]:
            rows_out.append([m, f"n/a ({errors.get(m, 'no run')})", "", "", ""])
            continue
        ts = [r["load_s"] for r in got[m]]
        med[m] = _median(ts)
        peak = max(r["peak_mib"] for r in got[m])
        over = max(r["peak_mib"] - r["base_mib"] - r["model_mib"] for r in got[m])
        rows_out.append([m, f"{med[m]:.3f}", _spread(ts), f"{peak:.1f}", f"{over:+.1f}"])
    tgt: list[dict[str, object]] = []
    if "ckptool" in med and "torch mmap" in med:
        v = med["ckptool"] / med["torch mmap"]
        tgt.append(_target("load_into / torch.load(mmap)+load_state_dict (1)", v, "x", 1.0))
    if "ckptool" in med and "torch" in med:
        tgt.append(_target("load_into / torch.load+load_state_dict (1)", med["ckptool"] / med["torch"], "x", None))
    if got["ckptool"]:
        over = max(r["peak_mib"] - r["base_mib"] - r["model_mib"] for r in got["ckptool"])
        tgt.append(_target("load_into peak RSS - (import baseline + model)", over, "MiB", 64))
    return rows_out, tgt


def _target(name: str, value: float | None, unit: str, limit: float | None) -> dict[str, object]:
    status = "n/a" if value is None else "info" if limit is None else "PASS" if value <= limit else "FAIL"
    return {"figure": name, "value": value, "unit": unit, "target": limit, "status": status}


# ------------------------------------------------------------------------------------------------ scale
def _dig_holes(path: str) -> bool:
    if shutil.which("fallocate") is None:
        return False
    return subprocess.run(["fallocate", "--dig-holes", path], capture_output=True, check=False).returncode == 0


def scale_figures(ctx: Ctx, reuse: dict[float, str]) -> tuple[list[Row], list[dict[str, object]]]:
    """Rows of the scale table: inspect and remap of growing tensor counts and file sizes, one run each."""
    py = sys.executable
    counts = [500, 2000] if ctx.smoke else [10_000, 100_000, 1_000_000]
    sizes = [0.01, 0.04] if ctx.smoke else [0.1, 2.0, 8.0]
    # (label, path, units, unit name)
    cases: list[tuple[str, str, float, str]] = [(f"{c:,} tensors", ctx.build("many", c, 0), c, "tensor")
                                                 for c in counts]
    for s in sizes:
        path = reuse.get(s) or ctx.build("sparse" if s >= 4 else "big", s, 0)
        sparse = s >= 4 and _dig_holes(path)
        cases.append((f"{os.path.getsize(path) / 1e9:.2f} GB{' (sparse)' if sparse else ''}", path,
                      os.path.getsize(path) / 2**30, "GiB"))
    rows: list[Row] = []
    per: dict[str, list[tuple[float, float]]] = {"tensor": [], "GiB": []}
    out = os.path.join(ctx.workdir, "scale-out.pt")
    for label, path, units, unit in cases:
        os.sync()
        ins = ctx.run_measured([py, "-m", "ckptool", "inspect", "--json", path], ctx.workdir)
        rem = ctx.run_measured([py, "-m", "ckptool", "remap", path, "--to", "cpu", "-o", out], ctx.workdir)
        if os.path.exists(out):
            os.unlink(out)
        ctx.log(f"  scale {label:<22} inspect {ins.wall_s:7.2f} s {ins.maxrss_kib / 1024:7.1f} MiB   "
                f"remap {rem.wall_s:7.2f} s {rem.maxrss_kib / 1024:7.1f} MiB" + ("" if ins.ok and rem.ok else
                                                                                  f"  FAILED {ins.error or rem.error}"))
        if not (ins.ok and rem.ok):
            rows.append([label, f"n/a ({ins.error or rem.error})", "", "", "", ""])
            continue
        per[unit].append((units, rem.wall_s))
        scale = 1e6 if unit == "tensor" else 1.0
        per_unit = "us" if unit == "tensor" else "s"
        rows.append([label, f"{ins.wall_s:.2f}", f"{ins.maxrss_kib / 1024:.1f}", f"{rem.wall_s:.2f}",
                     f"{rem.maxrss_kib / 1024:.1f}", f"{rem.wall_s / units * scale:.3g} {per_unit}/{unit}"])
    tgt = []
    for unit, pts in per.items():
        if len(pts) >= 2:
            (u0, t0), (u1, t1) = pts[0], pts[-1]
            tgt.append(_target(f"scale: remap time growth / {unit} growth ({u0:.3g} -> {u1:.3g} {unit})",
                               (t1 / t0) / (u1 / u0), "x", None))
    return rows, tgt


# ------------------------------------------------------------------------------------------------ dcp
def dcp_figures(ctx: Ctx, size_gib: float) -> tuple[list[Row], list[dict[str, object]]]:
    """Rows of the DCP consolidation table and its RSS target."""
    py = sys.executable
    n = 64
    rows_per = max(1, int(size_gib * 2**30 / 4 / 1024 / n))
    folder = os.path.join(ctx.workdir, f"dcp-{n}x{rows_per}")
    out = os.path.join(ctx.workdir, "dcp-out.pt")
    if not os.path.isdir(folder):
        ctx.log(f"building DCP folder {folder} ...")
        rc, _, err = ctx.child([py, "-c", DCP_BUILD, folder, str(n), str(rows_per)])
        if rc != 0:
            shutil.rmtree(folder, ignore_errors=True)
            return [["build", f"n/a ({(err.strip().splitlines() or ['?'])[-1]})", "", ""]], []
    gib = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**30
    runs: dict[str, tuple[list[float], list[float], str]] = {}
    commands = {"ckptool convert": [py, "-m", "ckptool", "convert", folder, "-o", out]}
    if not ctx.smoke:
        commands["torch dcp_to_torch_save"] = [py, "-c", DCP_TORCH, folder, out]
    for label in commands:
        runs[label] = ([], [], "")
    for i in range(ctx.repeat):
        for label, cmd in commands.items():
            if runs[label][2]:
                continue
            if os.path.exists(out):
                os.unlink(out)
            os.sync()
            r = ctx.run_measured(cmd, ctx.workdir)
            if r.ok and label == "ckptool convert" and i == 0:
                rc, _, err = ctx.child([py, "-c", DCP_CHECK, out, str(n)])
                if rc != 0:
                    r.ok, r.error = False, (err.strip().splitlines() or ["check failed"])[-1]
            ctx.log(f"  dcp {label:<24} run {i + 1}: {r.wall_s:8.3f} s  {r.maxrss_kib / 1024:8.1f} MiB"
                    + ("" if r.ok else f"  FAILED ({r.error})"))
            if not r.ok:
                runs[label] = ([], [], r.error)
                continue
            runs[label][0].append(r.wall_s)
            runs[label][1].append(r.maxrss_kib / 1024)
    if os.path.exists(out):
        os.unlink(out)
    shutil.rmtree(folder, ignore_errors=True)
    rows: list[Row] = []
    for label, (ts, mem, err) in runs.items():
        if err or not ts:
            rows.append([f"{label} ({gib:.2f} GiB)", f"n/a ({err})", "", ""])
        else:
            rows.append([f"{label} ({gib:.2f} GiB)", f"{_median(ts):.3f}", _spread(ts), f"{max(mem):.1f}"])
    ck = runs["ckptool convert"]
    return rows, [_target(f"DCP -> torch file ({gib:.2f} GiB) peak RSS", max(ck[1]) if ck[1] else None, "MiB", 256)]
