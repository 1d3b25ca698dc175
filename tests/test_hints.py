"""The closing "Load it with: ..." line is true (issue 12, item 2): every hint the CLI prints, for every relevant
fixture, command and device option, is run as printed in a subprocess that sees no GPU (``CUDA_VISIBLE_DEVICES=``),
and what it loads must equal the source tensor for tensor (dtype, shape, bits).

The commands run in-process (fast); all hints are then loaded by ONE subprocess (:func:`run_loads`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_load_hints import MATCHING_MODEL

from ckptool.ops.hints import load_hint

REPO = Path(__file__).resolve().parent.parent

#: run by :func:`run_loads`: each case's ``code`` is evaluated as printed (``torch``, ``safetensors`` and a stand-in
#: ``model`` whose load_state_dict keeps its argument), and every tensor compared with ``ref`` (a Python expression
#: over ``src``, the source loaded with map_location='cpu', weights_only=False; default: ``src`` indexed as the hint
#: indexes the output). Prints the list of failures as JSON.
_RUNNER = MATCHING_MODEL + r'''
import json, re, sys
import torch, safetensors.torch
import safetensors
import ckptool
sys.path.insert(0, sys.argv[1])

def flat(o):
    if isinstance(o, torch.Tensor):
        yield o
    elif isinstance(o, torch.nn.Module):
        yield from flat(o.state_dict())
    elif isinstance(o, dict):
        for v in o.values():
            yield from flat(v)
    elif isinstance(o, (list, tuple)):
        for v in o:
            yield from flat(v)

def same(a, b, where):
    assert a.device.type == "cpu", f"{where}: on {a.device}"
    assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
    bits = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)
    assert torch.equal(bits(a), bits(b)), f"{where}: values differ"

class Model:
    sd = None
    def load_state_dict(self, sd, strict=True):
        self.sd = sd

failures = []
for c in json.load(sys.stdin):
    try:
        src = torch.load(c["src"], map_location="cpu", weights_only=False)
        # tied weights and views in safetensors load into a real module (test_load_hints.MATCHING_MODEL's build)
        real = re.match(r"(ckptool\.load_into|safetensors\.torch\.load_model)\(model, ", c["code"])
        model = build(eval(c.get("ref") or "src", {"src": src})) if real else Model()
        got = eval(c["code"], {"torch": torch, "safetensors": safetensors, "model": model, "ckptool": ckptool})
        wrapped = c["code"].startswith("model.load_state_dict(")
        if wrapped or real:
            got = model.state_dict() if real else model.sd
        ref_expr = c.get("ref")
        if ref_expr is None:
            m = re.search(r"\)((?:\[[^\]]+\])*)\)$", c["code"]) if wrapped else None
            ref_expr = "src" + (m.group(1) if m else "")
        ref = eval(ref_expr, {"src": src})
        if c.get("by_key"):
            ref = ref.state_dict() if isinstance(ref, torch.nn.Module) else ref
            assert got and set(got) <= set(ref), f"keys {sorted(set(got) - set(ref))} not in the source"
            for k in got:
                same(got[k], ref[k], k)
        else:
            a, b = list(flat(got)), list(flat(ref))
            assert len(a) == len(b) and a, f"{len(a)} tensors loaded, {len(b)} in the source"
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"tensor {i}")
    except BaseException as e:
        failures.append({"case": c, "error": f"{type(e).__name__}: {e}"})
print(json.dumps(failures))
'''


def run_loads(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Evaluate every case's ``code`` in ONE subprocess without a visible GPU; returns the failures."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(REPO / "fixtures")], input=json.dumps(cases),
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _lightning(net_seed: int = 0) -> dict[str, Any]:
    """A LightningModule checkpoint: state_dict keys under the attribute ``model.``, optimizer state, plain
    hyper-parameters (what ``Trainer.save_checkpoint`` writes for a module holding its net as ``self.model``)."""
    import fixture_models

    torch.manual_seed(net_seed)
    net = fixture_models.SmallConvNet()
    sd = net.state_dict()
    state = type(sd)((f"model.{k}", v) for k, v in sd.items())
    state._metadata = type(sd._metadata)(  # type: ignore[attr-defined]
        (f"model.{k}" if k else "model", v) for k, v in sd._metadata.items())  # type: ignore[attr-defined]
    state._metadata[""] = {"version": 1}  # type: ignore[attr-defined]
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(2, 3, 5, 5)).sum().backward()
    opt.step()
    return {"epoch": 2, "global_step": 40, "pytorch-lightning_version": "2.4.0", "state_dict": state,
            "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 2}}}}, "optimizer_states": [opt.state_dict()],
            "lr_schedulers": [], "hyper_parameters": {"lr": 1e-3, "device": "cuda:1"}}


@pytest.fixture(scope="session")
def extra(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GPU-tagged files the generated set lacks: a Lightning checkpoint (zip and legacy, cuda:1) and a training
    checkpoint holding numpy values and an ``argparse.Namespace`` (cuda:0)."""
    from make_fixtures import gpu_tag
    from tagging import save_tagged

    out = tmp_path_factory.mktemp("extra")
    files = {}
    ckpt = _lightning()
    for name, legacy in (("lightning_cuda1.ckpt", False), ("lightning_cuda1_legacy.ckpt", True)):
        save_tagged(ckpt, str(out / name), gpu_tag("cuda:1"), legacy=legacy)
        files[name] = out / name
    import fixture_models

    torch.manual_seed(1)
    args = {"model": fixture_models.SmallConvNet().state_dict(), "args": argparse.Namespace(lr=0.1, epochs=3),
            "best": np.float64(0.5), "mean": np.arange(4, dtype=np.float32)}
    save_tagged(args, str(out / "args_numpy_cuda0.pt"), gpu_tag("cuda:0"))
    files["args_numpy_cuda0.pt"] = out / "args_numpy_cuda0.pt"
    return files


#: fixture -> key renamings that apply to it
_RENAMES: dict[str, list[list[str]]] = {
    "sd_dp_cuda0.pt": [["strip-dataparallel"], ["unwrap"], ["strip-prefix", "module."]],
    "sd_dp_cuda0_legacy.pt": [["strip-dataparallel"]],
    "sd_mixed.pt": [["add-prefix", "module."]],
    "train_cuda1.pt": [["add-prefix", "module.", "--key", "model_state_dict"], ["strip-prefix", "conv."]],
    "train_cuda1_legacy.pt": [["strip-prefix", "fc."]],
    "train_cuda1_cpustep.pt": [["add-prefix", "_orig_mod."]],
    "shared_cuda0.pt": [["strip-prefix", "tied."]],
    "model_dp_full_cuda0.pt": [["strip-dataparallel"], ["unwrap"]],
    "lightning_cuda1.ckpt": [["unwrap"], ["strip-prefix", "model."], ["add-prefix", "net.", "--key", "state_dict"]],
    "lightning_cuda1_legacy.ckpt": [["unwrap"]],
    "args_numpy_cuda0.pt": [["add-prefix", "module.", "--key", "model"]],
}
#: fixture -> the state_dict convert finds (a Python index of the loaded source)
_CONVERT: dict[str, str] = {
    "sd_dp_cuda0.pt": "", "sd_mixed.pt": "", "train_cuda1.pt": "['model_state_dict']",
    "train_cuda1_cpustep.pt": "['model_state_dict']", "shared_cuda0.pt": "", "sd_cpu.pt": "",
    "lightning_cuda1.ckpt": "['state_dict']", "sd_dp_cuda0_legacy.pt": "",
}
_EXTRACT: dict[str, list[str]] = {"model_full_cuda0.pt": [], "model_full_cuda0_legacy.pt": [],
                                  "model_dp_full_cuda0.pt": ["--unwrap"]}


def _devices(name: str, manifest: dict[str, Any]) -> list[list[str]]:
    tags = manifest[name].tags if name in manifest else {"cuda:1" if "cuda1" in name else "cuda:0"}
    out = [[], ["--to", "cpu"], ["--to", "cuda:0"]]
    if "cuda:1" in tags:
        out.append(["--map", "cuda:1=cuda:0"])
    return out


def _hint_of(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.startswith("Load it with: ")]
    assert len(lines) == 1, output
    return lines[0][len("Load it with: "):]


def test_every_hint_loads_on_a_machine_without_gpu(generated, manifest, extra, run_cli, tmp_path: Path) -> None:
    files = {**generated, **extra}
    runs: list[tuple[list[str], dict[str, Any]]] = []
    n = 0

    def out(suffix: str) -> Path:
        nonlocal n
        n += 1
        return tmp_path / f"o{n}{suffix}"

    for name, renames in _RENAMES.items():
        for dev in _devices(name, manifest):
            runs += [([args[0], str(files[name]), *args[1:], *dev, "-o", str(out(".pt"))], {}) for args in renames]
            if dev:
                runs.append((["remap", str(files[name]), *dev, "-o", str(out(".pt"))], {}))
    for name, index in _CONVERT.items():
        ref = {"ref": "src" + index}
        runs += [(["convert", str(files[name]), "-o", str(out(".pt")), *dev], ref)
                 for dev in _devices(name, manifest)]
        runs += [(["convert", str(files[name]), "-o", *target], {**ref, "by_key": True})
                 for target in ([str(out(".safetensors"))], [str(out(".safetensors")), "--max-shard-size", "256"])]
    for name, opts in _EXTRACT.items():
        runs += [(["extract-state-dict", str(files[name]), *opts, *dev, "-o", str(out(".pt"))], {})
                 for dev in _devices(name, manifest)]
        unwrapped = "{k.removeprefix('module.'): v for k, v in src.state_dict().items()}" if opts else None
        runs.append((["extract-state-dict", str(files[name]), *opts, "-o", str(out(".safetensors"))],
                     {"by_key": True, "ref": unwrapped}))
    cases = []
    for argv, extra_ref in runs:
        r = run_cli(*argv)
        assert r.exit_code == 0, (argv, r.output)
        cases.append({"code": _hint_of(r.output), "src": argv[1], "argv": argv, **extra_ref})
    assert len(cases) > 100
    failures = run_loads(cases)
    assert not failures, json.dumps(failures[:5], indent=1)


def test_hint_follows_what_the_output_holds(generated, extra, run_cli, tmp_path: Path) -> None:
    # cpu tags only: a plain torch.load, no note
    r = run_cli("strip-dataparallel", generated["sd_dp_cuda0.pt"], "--to", "cpu", "-o", tmp_path / "a.pt")
    assert _hint_of(r.output) == f"model.load_state_dict(torch.load({str(tmp_path / 'a.pt')!r}, weights_only=True))"
    assert "Note:" not in r.output
    # tags kept from the source: said so, with the map_location for cpu and for one GPU
    r = run_cli("convert", generated["train_cuda1.pt"], "-o", tmp_path / "b.pt")
    assert "map_location='cpu'" in _hint_of(r.output)
    assert "keeps the location tag(s) cuda:1" in r.output and "map_location={'cuda:1': 'cuda:0'}" in r.output
    # tags chosen by the user: no "kept" note
    r = run_cli("remap", generated["train_cuda1.pt"], "--map", "cuda:1=cuda:0", "-o", tmp_path / "c.pt")
    assert "keeps the location" not in r.output and "tagged cuda:0 as asked" in r.output
    # globals outside the allowlist: sanitize first, weights_only=False only when trusted
    r = run_cli("add-prefix", extra["args_numpy_cuda0.pt"], "module.", "--key", "model", "--to", "cpu",
                "-o", tmp_path / "d.pt")
    assert "ckptool sanitize" in r.output and "argparse.Namespace" in r.output
    assert "weights_only=False" in _hint_of(r.output)
    # the state_dict inside a bigger dict is indexed
    r = run_cli("unwrap", extra["lightning_cuda1.ckpt"], "--to", "cpu", "-o", tmp_path / "e.ckpt")
    assert _hint_of(r.output).endswith("weights_only=True)['state_dict'])")


def test_load_hint_of_each_format(generated, tmp_path: Path) -> None:
    from ckptool import convert

    res = convert(generated["sd_cpu.pt"], tmp_path / "m.safetensors")
    assert load_hint(res.dst).code == f"safetensors.torch.load_file({res.dst!r})"
    res = convert(generated["sd_cpu.pt"], tmp_path / "s.safetensors", max_shard_size=256)
    code = load_hint(res.files[-1]).code
    assert code == f"ckptool.load_into(model, {res.files[-1]!r})"  # the loader users use, not a list of shards
    hint = load_hint(generated["model_full_cuda0.pt"])
    assert "weights_only=False" in hint.code and any("ckptool sanitize" in n for n in hint.notes)
    assert load_hint(generated["sd_cuda1.pt"], state_dict="", chosen={"cuda:1"}).notes[0].startswith(
        "Storages are tagged cuda:1 as asked")


def test_a_set_tagged_as_asked_names_the_shards_not_the_index(generated, tmp_path: Path, run_cli) -> None:
    """The note for storages tagged as asked must not tell torch.load to open the set's JSON index."""
    (tmp_path / "set").mkdir()
    assert run_cli("convert", generated["sd_cpu.pt"], "-o", tmp_path / "set" / "pytorch_model.bin",
                   "--max-shard-size", "256").exit_code == 0
    res = run_cli("remap", tmp_path / "set", "--to", "cuda:0", "-o", tmp_path / "out")
    assert res.exit_code == 0, res.output
    index = str(next((tmp_path / "out").glob("*.index.json")))
    hint = load_hint(index, chosen={"cuda:0"})
    assert hint.notes and hint.notes[-1].startswith("Storages are tagged cuda:0 as asked")
    assert "index.json" not in hint.notes[-1] and "each shard" in hint.notes[-1]
