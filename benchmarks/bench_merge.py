#!/usr/bin/env python3
"""Peak memory and time of ``ckptool merge-lora`` (issue 39: peak RSS under 1.2 x the largest tensor + 64 MiB)
beside PEFT's ``merge_and_unload()`` + ``save_pretrained``, and of ``ckptool average --method ties`` beside
``mergekit-yaml`` on the same inputs.

Usage::

    python benchmarks/bench_merge.py [--size-mib 1024] [--ties-mib 256] [--workdir DIR] [--only lora|ties] [--json]
    python benchmarks/bench_merge.py --only key [--key-elements 16777216]   # one key's merge, per method and dtype
    python benchmarks/bench_merge.py --smoke          # a 300 MiB base, 3 x 300 MiB ties inputs

With ``--workdir`` the inputs are kept there and reused by the next run with the same sizes (a ``built.json``
beside each says what it was built from).

merge-lora: a Llama-shaped model folder (``config.json`` + ``model.safetensors``, float32, about ``--size-mib``:
hidden 1024, vocabulary 32000, as many layers as fit) and a rank-64 PEFT adapter over every linear layer
(q/k/v/o/gate/up/down), both written directly in a child (no training). Commands, each a child process (wall clock
and peak RSS from ``wait4``, page cache warmed first):

- ``ckptool merge-lora BASE ADAPTER -o OUT``
- PEFT: ``AutoModelForCausalLM.from_pretrained(BASE)``, ``PeftModel.from_pretrained(ADAPTER)``,
  ``merge_and_unload()``, ``save_pretrained(OUT)`` (needs ``peft``; skipped without it)

ties: three Llama-shaped folders of ``--ties-mib`` (the base and two others) merged with ``--density 0.5``, by
``ckptool average --method ties`` and by ``mergekit-yaml --lazy-unpickle --no-copy-tokenizer`` (``$CKPTOOL_MERGEKIT``
or ``PATH``; skipped without it), the YAML naming the folders by absolute path; the two outputs are compared tensor
by tensor. mergekit needs ``architectures`` in ``config.json`` (it picks its tensor layout from it: without it,
``TypeError: object of type 'NoneType' has no len()``), does not need a tokenizer with ``--no-copy-tokenizer``
(else it tries to load one and logs an error), and treats a relative model path without a folder of that name as
a Hugging Face repository (network). Each figure is printed with its ratio to the other tool's (ckptool / PEFT,
ckptool / mergekit). Only the standard library is used here; torch runs in the children.

key (``--only key``): one key of ``--key-elements`` elements, a base and two inputs (normal, std 0.02) made in a
child, merged by ``ckptool.torch_ops.merge_methods.merge_elements`` for ties, dare-ties and task-arithmetic in
float32 and bfloat16; the figure is how much the child's peak RSS grew during the merge, over the peak with the
three tensors in memory, as a multiple of one tensor's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from children import child_env, compile_checkout, run_child, warm_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT_ROOT = os.path.join(REPO, "benchmarks", "out")

_BUILD = r"""
import json, os, sys, torch, transformers
from safetensors.torch import save_file
folder, mib, seed, adapter = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
h, inter, vocab = 1024, 2816, 32000
per_layer = (4 * h * h + 3 * h * inter + 2 * h) * 4
layers = max(1, int((mib * 2**20 - 2 * vocab * h * 4) / per_layer))
cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                               num_attention_heads=16, num_key_value_heads=16, vocab_size=vocab)
cfg.architectures = ["LlamaForCausalLM"]  # what from_pretrained's save_pretrained writes; mergekit requires it
g = torch.Generator().manual_seed(seed)
with torch.device("meta"):
    shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(cfg).state_dict().items()}
os.makedirs(folder, exist_ok=True)
save_file({k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}, os.path.join(folder, "model.safetensors"),
          metadata={"format": "pt"})
cfg.save_pretrained(folder)
if adapter != "-":
    r = 64
    lora = {}
    for k, s in shapes.items():
        if k.endswith("proj.weight"):
            m = "base_model.model." + k[:-len(".weight")]
            lora[m + ".lora_A.weight"] = torch.randn(r, s[1], generator=g) * 0.01
            lora[m + ".lora_B.weight"] = torch.randn(s[0], r, generator=g) * 0.01
    os.makedirs(adapter, exist_ok=True)
    save_file(lora, os.path.join(adapter, "adapter_model.safetensors"))
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 128, "task_type": "CAUSAL_LM",
               "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
              open(os.path.join(adapter, "adapter_config.json"), "w"))
print(layers, max(s.numel() * 4 for s in shapes.values()))
"""

_PEFT = r"""
import sys, torch, transformers, peft
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
peft.PeftModel.from_pretrained(m, sys.argv[2]).merge_and_unload().save_pretrained(sys.argv[3])
"""

_SAME = r"""
import glob, os, sys, torch
from safetensors.torch import load_file
def load(p):
    files = sorted(glob.glob(os.path.join(p, "*.safetensors"))) if os.path.isdir(p) else [p]
    return {k: v for f in files for k, v in load_file(f).items()}
a, b = load(sys.argv[1]), load(sys.argv[2])
bad = [k for k in a if k not in b or not torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7)]
same = sum(torch.equal(a[k], b[k]) for k in a if k in b)
print(",".join(bad[:3]) + (f" (of {len(bad)})" if bad else "") + f";{same}/{len(a)}")
"""


_ONE_KEY = r"""
import resource, sys, torch
from ckptool.torch_ops.merge_methods import merge_elements, new_generator
method, dtype, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def tensor(seed):
    b = bytearray(n * torch.tensor([], dtype=getattr(torch, dtype)).element_size())
    torch.frombuffer(b, dtype=getattr(torch, dtype)).normal_(0, 0.02, generator=torch.Generator().manual_seed(seed))
    return b
base, xs = tensor(0), [tensor(1), tensor(2)]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
merge_elements(method, dtype, (n,), base, iter(xs), [1.0, 1.0], density=0.5, lam=1.0, t=0.5,
               generator=new_generator(0))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / len(base))
"""


def bench_key(elements: int) -> dict[str, float]:
    """One key's merge per method and dtype: the peak RSS growth as a multiple of the tensor's bytes."""
    out = {}
    for method in ("ties", "dare-ties", "task-arithmetic"):
        for dtype in ("float32", "bfloat16"):
            r = subprocess.run([sys.executable, "-c", _ONE_KEY, method, dtype, str(elements)], capture_output=True,
                               text=True, env=child_env(), check=True)
            out[f"{method} {dtype}"] = round(float(r.stdout.split()[-1]), 1)
    return out


def _run(label: str, cmd: list[str], workdir: str, inputs: list[str], results: dict[str, dict[str, object]]) -> bool:
    for p in inputs:
        warm_cache(p)
    rc, wall, kib, _out, err = run_child(cmd, workdir)
    results[label] = {"wall_s": round(wall, 2), "peak_rss_mib": round(kib / 1024), "exit": rc}
    if rc:
        results[label]["error"] = (err.strip().splitlines() or ["?"])[-1]
    return rc == 0


def _mergekit() -> str | None:
    exe = os.environ.get("CKPTOOL_MERGEKIT") or shutil.which("mergekit-yaml")
    return exe if exe and os.path.exists(exe) else None


def _build(folder: str, mib: float, seed: int, adapter: str = "-") -> list[str]:
    """Build (or reuse, when ``built.json`` says it was built from the same arguments) one model folder and, unless
    ``adapter`` is ``-``, its adapter; returns what ``_BUILD`` printed (layers, largest tensor's bytes)."""
    stamp = os.path.join(folder, "built.json")
    args = [str(mib), str(seed), adapter]
    if os.path.exists(stamp):
        with open(stamp, encoding="utf-8") as f:
            old = json.load(f)
        if old["args"] == args:
            return [str(x) for x in old["out"]]
    out = subprocess.run([sys.executable, "-c", _BUILD, folder, *args], check=True, capture_output=True,
                         text=True, env=child_env()).stdout.split()
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump({"args": args, "out": out}, f)
    return out


def _same(ours: str, theirs: str) -> str:
    """``none`` or the keys that differ (``allclose`` at ``rtol=1e-6``), then how many tensors are equal bit for bit."""
    out = subprocess.run([sys.executable, "-c", _SAME, ours, theirs], capture_output=True, text=True,
                         env=child_env(), check=False).stdout.strip()
    bad, _, equal = out.rpartition(";")
    return f"{bad or 'none'} differ; {equal} equal bit for bit"


def bench_lora(workdir: str, mib: float, results: dict[str, dict[str, object]]) -> dict[str, object]:
    """merge-lora and PEFT on a ``mib`` MiB base; returns the facts of the inputs."""
    py, base, adapter = sys.executable, os.path.join(workdir, "base"), os.path.join(workdir, "adapter")
    out = _build(base, mib, 0, adapter)
    facts: dict[str, object] = {"layers": int(out[0]), "largest_tensor_mib": int(out[1]) / 2**20,
                                "base_mib": os.path.getsize(os.path.join(base, "model.safetensors")) / 2**20}
    weights = [os.path.join(base, "model.safetensors"), os.path.join(adapter, "adapter_model.safetensors")]
    ours = os.path.join(workdir, "merged")
    shutil.rmtree(ours, ignore_errors=True)
    _run("ckptool merge-lora", [py, "-m", "ckptool", "merge-lora", base, adapter, "-o", ours], workdir, weights,
         results)
    theirs = os.path.join(workdir, "peft")
    shutil.rmtree(theirs, ignore_errors=True)
    if subprocess.run([py, "-c", "import peft"], env=child_env(), check=False).returncode == 0 and _run(
            "PEFT merge_and_unload + save_pretrained", [py, "-c", _PEFT, base, adapter, theirs], workdir, weights,
            results):
        facts["merge_lora_vs_peft"] = _same(ours, theirs)
    return facts


def bench_ties(workdir: str, mib: float, results: dict[str, dict[str, object]]) -> dict[str, object]:
    """average --method ties and mergekit on three ``mib`` MiB folders; returns the facts of the inputs."""
    py = sys.executable
    folders = [os.path.join(workdir, f"m{i}") for i in range(3)]
    out = [_build(f, mib, i + 1) for i, f in enumerate(folders)][0]  # noqa: RUF015  (every folder built)
    facts: dict[str, object] = {"ties_layers": int(out[0]), "ties_largest_tensor_mib": int(out[1]) / 2**20}
    files = [os.path.join(f, "model.safetensors") for f in folders]
    ours = os.path.join(workdir, "ties.safetensors")
    if os.path.exists(ours):  # a kept workdir: ckptool refuses to overwrite without --force
        os.remove(ours)
    _run("ckptool average --method ties", [py, "-m", "ckptool", "average", folders[1], folders[2], "--method",
                                           "ties", "--base", folders[0], "--density", "0.5", "-o", ours],
         workdir, files, results)
    exe = _mergekit()
    if exe:
        yml, theirs = os.path.join(workdir, "ties.yml"), os.path.join(workdir, "mk")
        shutil.rmtree(theirs, ignore_errors=True)
        with open(yml, "w", encoding="utf-8") as f:
            f.write(f"merge_method: ties\nbase_model: {folders[0]}\nmodels:\n" + "".join(
                f"  - model: {m}\n    parameters: {{weight: 1.0, density: 0.5}}\n" for m in folders[1:])
                + "dtype: float32\n")
        if _run("mergekit-yaml ties", [exe, yml, theirs, "--lazy-unpickle", "--no-copy-tokenizer"], workdir, files,
                results) and os.path.exists(ours):
            facts["ties_vs_mergekit"] = _same(ours, theirs)
    return facts


def _ratios(results: dict[str, dict[str, object]]) -> dict[str, dict[str, float]]:
    """ckptool's wall time and peak RSS over the other tool's, for each pair that both ran."""
    pairs = {"merge-lora / PEFT": ("ckptool merge-lora", "PEFT merge_and_unload + save_pretrained"),
             "average ties / mergekit": ("ckptool average --method ties", "mergekit-yaml ties")}
    out = {}
    for name, (a, b) in pairs.items():
        ra, rb = results.get(a), results.get(b)
        if ra and rb and not ra["exit"] and not rb["exit"]:
            out[name] = {k: round(float(ra[k]) / float(rb[k]), 3)  # type: ignore[arg-type]
                         for k in ("wall_s", "peak_rss_mib")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", help="where to build the files, kept and reused (default: a fresh folder under "
                    "benchmarks/out/, removed)")
    ap.add_argument("--size-mib", type=float, default=1024.0, help="merge-lora base size in MiB (default 1024)")
    ap.add_argument("--ties-mib", type=float, default=256.0, help="size of each ties input in MiB (default 256)")
    ap.add_argument("--only", choices=("lora", "ties", "key"), help="run one benchmark (key: only with --only)")
    ap.add_argument("--key-elements", type=int, default=1 << 24, help="elements of --only key's tensor")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--smoke", action="store_true", help="--size-mib 300 --ties-mib 300 (small layers)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size_mib = args.ties_mib = 300.0
    if args.only == "key":
        compile_checkout()
        key = bench_key(args.key_elements)
        print(json.dumps(key, indent=2) if args.json else "\n".join(
            f"{k:<28} peak RSS grew {v} x the tensor" for k, v in key.items()))
        print(f"load average: {[round(x, 2) for x in os.getloadavg()]}")
        return 0
    os.makedirs(DEFAULT_OUT_ROOT, exist_ok=True)
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="bench-merge-", dir=DEFAULT_OUT_ROOT))
    os.makedirs(workdir, exist_ok=True)
    results: dict[str, dict[str, object]] = {}
    facts: dict[str, object] = {}
    try:
        compile_checkout()
        if args.only != "ties":
            facts.update(bench_lora(workdir, args.size_mib, results))
        if args.only != "lora":
            facts.update(bench_ties(workdir, args.ties_mib, results))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report: dict[str, object] = {"inputs": facts, "runs": results, "ratios": _ratios(results),
                                 "loadavg": [round(x, 2) for x in os.getloadavg()]}
    if "largest_tensor_mib" in facts:
        report["merge_lora_target_mib"] = round(1.2 * float(facts["largest_tensor_mib"]) + 64)  # type: ignore[arg-type]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"inputs: {facts}")
        if "merge_lora_target_mib" in report:
            target = report["merge_lora_target_mib"]
            print(f"merge-lora target: peak RSS <= 1.2 x the largest tensor + 64 = {target} MiB")
        print(f"{'command':<42} {'wall s':>8} {'peak RSS MiB':>13}")
        for label, r in results.items():
            print(f"{label:<42} {r['wall_s']:>8} {r['peak_rss_mib']:>13}  {r.get('error', '')}")
        for name, r in report["ratios"].items():  # type: ignore[attr-defined]
            print(f"{'ratio ' + name:<42} {r['wall_s']:>7}x {r['peak_rss_mib']:>12}x")
        print(f"load average: {report['loadavg']}")
    return 1 if any(r["exit"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
