#!/usr/bin/env python3
"""Peak memory and time of ``ckptool convert FOLDER -o OUT/ --dtype bfloat16`` dequantizing a fine-grained FP8 model
folder (issue 48: peak RSS under 1.5 x the largest tensor's bfloat16 size + 256 MiB, time under the reference's),
beside transformers' ``from_pretrained(FOLDER, quantization_config=FineGrainedFP8Config(dequantize=True))`` +
``save_pretrained(OUT)`` on the same input.

Usage::

    python benchmarks/bench_dequant.py [--size-mib 1024] [--workdir DIR] [--repeat 3] [--json]
    python benchmarks/bench_dequant.py --smoke       # a 64 MiB folder of a narrower model, one run each

The input: a Llama-shaped folder (hidden 2048, intermediate 5632, vocabulary 32000; 512, 1408, 8000 with
``--smoke``; as many layers as fit in ``--size-mib`` of FP8 weights), its linear weights quantized to
``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per 128 x 128 block by transformers' own ``Fp8Quantize``
(embeddings and norms in bfloat16), ``quant_method: fp8`` in ``config.json``; written in a child, kept in
``--workdir`` for the next run with the same size (``built.json`` says what it was built from). Each command runs in
a child process (wall clock and peak RSS from ``wait4``, the input's pages warmed first); the two outputs are
compared tensor by tensor (bit for bit). Only the standard library is used here; torch runs in the children.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from children import compile_checkout, run_child, warm_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT_ROOT = os.path.join(REPO, "benchmarks", "out")

_BUILD = r"""
import json, os, sys, types, torch
from safetensors.torch import save_file
from transformers import FineGrainedFP8Config, LlamaConfig
from transformers.integrations.finegrained_fp8 import Fp8Quantize
folder, mib, small = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "small"
h, inter, vocab = (512, 1408, 8000) if small else (2048, 5632, 32000)
per_layer = 4 * h * h + 3 * h * inter  # FP8 bytes of one layer's linear weights
layers = max(1, int(mib * 2**20 / per_layer))
cfg = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=vocab, torch_dtype="bfloat16")
q = Fp8Quantize(types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128])))
g = torch.Generator().manual_seed(0)
sd = {"model.embed_tokens.weight": (torch.randn(vocab, h, generator=g) * 0.02).to(torch.bfloat16),
      "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
      "lm_head.weight": (torch.randn(vocab, h, generator=g) * 0.02).to(torch.bfloat16)}
shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, h), "self_attn.v_proj": (h, h),
          "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
          "mlp.down_proj": (h, inter)}
for i in range(layers):
    p = f"model.layers.{i}."
    sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for name, shape in shapes.items():
        w = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
        sd.update(q._quantize_one(p + name + ".weight", w))
os.makedirs(folder, exist_ok=True)
save_file(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
conf = cfg.to_dict()
conf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(conf, f, indent=2, sort_keys=True)
biggest = max(v.numel() for v in sd.values())
print(json.dumps({"layers": layers, "bytes": os.path.getsize(os.path.join(folder, "model.safetensors")),
                  "largest_bf16_bytes": 2 * biggest}))
"""

_REFERENCE = r"""
import sys, torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config
src, out = sys.argv[1], sys.argv[2]
m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16,
                                         quantization_config=FineGrainedFP8Config(dequantize=True))
m.save_pretrained(out)
"""

_COMPARE = r"""
import glob, os, sys, torch
from safetensors.torch import load_file
def read(folder):
    sd = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        sd.update(load_file(f))
    return sd
a, b = read(sys.argv[1]), read(sys.argv[2])
tied = {"lm_head.weight"} - set(b)  # save_pretrained may drop a tied head
diff = [k for k in a if k not in tied and (k not in b or not torch.equal(a[k].view(torch.uint8),
                                                                          b[k].view(torch.uint8)))]
print("equal" if not diff and set(b) <= set(a) else f"differ: {diff[:5]}")
"""


def build(folder: str, mib: float, workdir: str, small: bool) -> dict[str, object]:
    """The input folder of ``mib`` MiB of FP8 weights (``small``: hidden 512, vocabulary 8000), built in a child
    unless ``built.json`` says it is there."""
    stamp = os.path.join(folder, "built.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            built = json.load(f)
        if (built.get("mib"), built.get("small")) == (mib, small):
            return dict(built)
    shutil.rmtree(folder, ignore_errors=True)
    cmd = [sys.executable, "-c", _BUILD, folder, str(mib), "small" if small else "full"]
    rc, _wall, _kib, out, err = run_child(cmd, workdir, stdout=True)
    if rc != 0:
        raise SystemExit(f"building the input failed: {err.strip()[-500:]}")
    built = {"mib": mib, "small": small, **json.loads(out.strip().splitlines()[-1])}
    with open(stamp, "w") as f:
        json.dump(built, f)
    return built


def measure(cmd: list[str], src: str, out: str, workdir: str, repeat: int) -> dict[str, object]:
    """Median wall seconds and the largest peak RSS (MiB) of ``repeat`` runs of ``cmd`` (``out`` removed before
    each), or the failure."""
    walls, peaks = [], []
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        warm_cache(os.path.join(src, "model.safetensors"))
        rc, wall, kib, _o, err = run_child(cmd, workdir)
        if rc != 0:
            return {"error": err.strip().splitlines()[-1] if err.strip() else f"exit status {rc}"}
        walls.append(wall)
        peaks.append(kib / 1024)
    return {"wall_s": statistics.median(walls), "peak_rss_mib": max(peaks)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir")
    ap.add_argument("--smoke", action="store_true", help="a 64 MiB folder, one run each")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    mib, repeat = (64.0, 1) if args.smoke else (args.size_mib, args.repeat)
    os.makedirs(DEFAULT_OUT_ROOT, exist_ok=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-dequant-", dir=DEFAULT_OUT_ROOT)
    os.makedirs(workdir, exist_ok=True)
    compile_checkout()
    src = os.path.join(workdir, f"fp8-{int(mib)}mib")
    built = build(src, mib, workdir, args.smoke)
    ours_out, ref_out = os.path.join(workdir, "ours"), os.path.join(workdir, "reference")
    ours = measure([sys.executable, "-m", "ckptool", "convert", src, "-o", ours_out + "/", "--dtype", "bfloat16",
                    "--max-shard-size", "5GB", "--force"], src, ours_out, workdir, repeat)
    ref = measure([sys.executable, "-c", _REFERENCE, src, ref_out], src, ref_out, workdir, repeat)
    same = "n/a"
    if "error" not in ours and "error" not in ref:
        rc, _w, _k, out, err = run_child([sys.executable, "-c", _COMPARE, ours_out, ref_out], workdir, stdout=True)
        same = out.strip() if rc == 0 else f"compare failed: {err.strip()[-200:]}"
    goal_mib = 1.5 * int(str(built["largest_bf16_bytes"])) / 2**20 + 256
    result = {"input": built, "ckptool": ours, "transformers": ref, "outputs": same, "rss_goal_mib": goal_mib,
              "machine_note": "figures from a shared machine are not claims; the lead measures on a quiet one"}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"input: {built['layers']} layers, {int(str(built['bytes'])) / 2**20:.0f} MiB FP8; "
              f"RSS goal {goal_mib:.0f} MiB")
        for name, m in (("ckptool convert --dtype bfloat16", ours), ("transformers dequantize + save", ref)):
            if "error" in m:
                print(f"  {name}: n/a ({m['error']})")
            else:
                print(f"  {name}: {m['wall_s']:.2f} s, peak RSS {m['peak_rss_mib']:.0f} MiB")
        print(f"  outputs: {same}")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if "error" not in ours and same in ("equal", "n/a") else 1


if __name__ == "__main__":
    sys.exit(main())
