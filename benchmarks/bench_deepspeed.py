"""Consolidating a DeepSpeed ZeRO-3 checkpoint from 2 ranks: ``ckptool convert`` against DeepSpeed's
``zero_to_fp32``, wall time and peak RSS side by side.

    python benchmarks/bench_deepspeed.py                        # hidden 4,000,000: ~150 MiB of fp32 weights
    python benchmarks/bench_deepspeed.py --hidden 27000000      # ~1 GiB (about 8 GiB of RAM to train and save)
    python benchmarks/bench_deepspeed.py --smoke                # tiny, for CI (skips where deepspeed is missing)

The checkpoint is written by real DeepSpeed on the CPU (``fixtures/make_deepspeed.py``, 2 ranks under
``torch.distributed.run``; ``--keep DIR`` keeps it and reuses it next time). Each tool runs in its own process;
its peak RSS is the child's own ``VmHWM`` (not ``ru_maxrss``, which keeps the parent's peak across fork and exec).
ckptool runs where ``import deepspeed`` fails (a blocking package on ``PYTHONPATH``) and writes one torch file,
with and without its verification (which imports torch and re-reads the output); the reference is
``python -m deepspeed.utils.zero_to_fp32 DIR OUT`` (DeepSpeed's own script, torch output, default 5GB shards; its
``--safe_serialization`` fails on tied weights, which the model has). The bound checked for ckptool is the largest
tensor + 64 MiB over the same command's peak on a 1 KiB checkpoint (Python, click, and torch for the
verification). Both outputs are compared tensor by tensor. Results go to ``benchmarks/out/deepspeed.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "fixtures"))


#: runs ``python -m MODULE ARGS...`` and then writes this process's peak RSS (``VmHWM`` of /proc/self/status: the
#: high-water mark of the memory map made at exec, which ``ru_maxrss`` is not: it keeps the parent's peak across
#: fork and exec) to the file named by $BENCH_RSS_OUT
_MEASURE = """
import os, runpy, sys
mod, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_module(mod, run_name="__main__", alter_sys=True)
finally:
    hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    open(os.environ["BENCH_RSS_OUT"], "w").write(str(int(hwm.split()[1]) * 1024))
"""


def run(module: str, args: list[str], env: dict[str, str], rss_file: Path) -> tuple[float, int]:
    """(seconds, peak RSS in bytes) of ``python -m module args`` run to completion in a child process."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _MEASURE, module, *args], env={**env, "BENCH_RSS_OUT": str(rss_file)},
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{module} {' '.join(args)} failed:\n{p.stderr.decode(errors='replace')[-2000:]}")
    return dt, int(rss_file.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4_000_000, help="hidden size of the model (about 9 x hidden "
                    "fp32 parameters)")
    ap.add_argument("--smoke", action="store_true", help="tiny checkpoint, for CI")
    ap.add_argument("--keep", help="folder to keep the checkpoint in (default: a temporary folder); a checkpoint "
                    "already there is reused")
    a = ap.parse_args(argv)
    try:
        import deepspeed  # noqa: F401
    except Exception as e:
        print(f"skipped: deepspeed is not importable here ({type(e).__name__}: {e})")
        return 0
    import make_deepspeed
    import torch

    hidden = 37 if a.smoke else a.hidden
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="bench_ds_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        folder = work / "zero3-2ranks"
        if not (a.keep and (folder / "latest").is_file()):
            folder = make_deepspeed.make_case(work, "zero3-2ranks", hidden=hidden, oracle=False)
        made = time.perf_counter() - t0
        files = sorted((folder / make_deepspeed.TAG).iterdir())
        ckpt_bytes = sum(f.stat().st_size for f in files)
        block = work / "block"
        (block / "deepspeed").mkdir(parents=True, exist_ok=True)
        (block / "deepspeed" / "__init__.py").write_text("raise ModuleNotFoundError('deepspeed', name='deepspeed')\n")
        base = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CKPTOOL_NO_PROGRESS": "1"}
        ours_env = {**base, "PYTHONPATH": os.pathsep.join([str(block), str(REPO)])}
        ours_out = work / "ckptool.pt"
        ref_out = work / "zero_to_fp32"
        rss = work / "rss"
        ours = run("ckptool", ["convert", str(folder), "-o", str(ours_out), "--force", "-q"], ours_env, rss)
        unverified = run("ckptool", ["convert", str(folder), "-o", str(work / "nv.pt"), "--force", "-q", "--no-verify"],
                         ours_env, rss)
        tiny = REPO / "fixtures" / "deepspeed-zero" / "zero3-2ranks"  # the same command on a tiny checkpoint: imports
        baseline = run("ckptool", ["convert", str(tiny), "-o", str(work / "tiny.pt"), "--force", "-q"], ours_env, rss)
        ref = run("deepspeed.utils.zero_to_fp32", [str(folder), str(ref_out)], base, rss)
        got = torch.load(ours_out, weights_only=True, mmap=True)
        want: dict[str, torch.Tensor] = {}
        for f in sorted(ref_out.glob("*.bin")):
            want.update(torch.load(f, weights_only=True, mmap=True))
        same = list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in got)
        largest = max(v.numel() * v.element_size() for v in got.values())
        model_bytes = sum(v.numel() * v.element_size() for v in got.values())
        res = {
            "hidden": hidden, "checkpoint_bytes": ckpt_bytes, "model_bytes": model_bytes, "largest_tensor": largest,
            "make_seconds": round(made, 1), "ckptool_seconds": round(ours[0], 2), "ckptool_peak_rss": ours[1],
            "ckptool_no_verify_seconds": round(unverified[0], 2), "ckptool_no_verify_peak_rss": unverified[1],
            "python_baseline_rss": baseline[1], "zero_to_fp32_seconds": round(ref[0], 2),
            "zero_to_fp32_peak_rss": ref[1], "outputs_equal": same,
            "ckptool_within_bound": ours[1] <= largest + baseline[1] + (64 << 20),
        }
        mib = 1 << 20
        print(f"ZeRO-3, 2 ranks, {model_bytes / mib:.0f} MiB of fp32 weights (largest tensor {largest / mib:.0f} MiB),"
              f" checkpoint {ckpt_bytes / mib:.0f} MiB")
        print(f"{'tool':<28}{'seconds':>10}{'peak RSS MiB':>15}")
        print(f"{'ckptool convert':<28}{ours[0]:>10.2f}{ours[1] / mib:>15.0f}")
        print(f"{'ckptool convert --no-verify':<28}{unverified[0]:>10.2f}{unverified[1] / mib:>15.0f}")
        print(f"{'deepspeed zero_to_fp32':<28}{ref[0]:>10.2f}{ref[1] / mib:>15.0f}")
        print(f"{'(ckptool on a 1 KiB ckpt)':<28}{baseline[0]:>10.2f}{baseline[1] / mib:>15.0f}")
        print(f"outputs equal: {same}; ckptool peak <= largest tensor + tiny-checkpoint peak + 64 MiB: "
              f"{res['ckptool_within_bound']}")
        out = REPO / "benchmarks" / "out"
        out.mkdir(exist_ok=True)
        (out / ("deepspeed-smoke.json" if a.smoke else "deepspeed.json")).write_text(json.dumps(res, indent=1))
        return 0 if same and res["ckptool_within_bound"] else 1
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
