"""Every "Load it with: ..." line runs as printed, into a real model (issue 27, item 3).

tests/test_hints.py runs the hints of many fixtures with a stand-in ``model`` that keeps whatever it is given;
here each printed line is run against a real ``nn.Module`` built to match what the output should hold (its keys,
shapes, dtypes and tied weights; values NaN or zero until loaded), so a strict ``load_state_dict`` that misses a
tied key, a folder passed to ``load_file``, or a name the line needs but does not import, fails. Covered: one-shard
and multi-shard folders (safetensors and torch), tied weights, views of one storage, torch zip outputs of remap,
the prefix commands, convert and extract-state-dict, a DCP folder, and outputs written to a URL.

All lines run in ONE subprocess that sees no GPU (``CUDA_VISIBLE_DEVICES=``), with only the modules the line names
imported (or, for ``--json`` runs, exactly the ``imports`` the hint lists), and what they load must equal the
expected state_dict bit for bit, on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptool.ops.hints import load_hint

REPO = Path(__file__).resolve().parent.parent

#: ``build(ref)``: an ``nn.Module`` whose state_dict has the keys, shapes and dtypes of the state_dict ``ref``, tied
#: where ``ref``'s tensors are one tensor, every value NaN (floating) or zero until something is loaded into it
#: (Python source, for the subprocesses of this file and of tests/test_hints.py)
MATCHING_MODEL = r'''
import torch
from torch import nn

def build(ref):
    """A module whose state_dict has ref's keys, shapes and dtypes, NaN (floats) or zero, tied where ref is."""
    root, made = nn.Module(), {}
    for name, t in ref.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, nn.Module())
            m = m._modules[part]
        sig = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if sig not in made:
            blank = torch.full_like(t, float("nan")) if t.is_floating_point() else torch.zeros_like(t)
            made[sig] = nn.Parameter(blank, requires_grad=False) if t.is_floating_point() else blank
        v = made[sig]
        if isinstance(v, nn.Parameter):
            m.register_parameter(leaf, v)
        else:
            m.register_buffer(leaf, v)
    return root

'''

#: run in a subprocess; reads the cases as JSON on stdin, prints the failures as JSON. A case: ``code`` (the
#: printed line), ``imports`` (optional: the statements to run first; default: ``import X`` for each module the line
#: names), ``ref`` (a torch.save file of the state_dict the line must load) and ``sub`` (optional: a Python index
#: into the object the line returns, when that object holds the state_dict)
RUNNER = MATCHING_MODEL + r'''
import json, re, sys

MODULES = ("torch.distributed.checkpoint", "safetensors.torch", "fsspec", "ckptool", "transformers", "torch")

def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)

def check(got, ref, shared):
    assert isinstance(got, dict) or hasattr(got, "items"), f"loaded a {type(got).__name__}, not a state_dict"
    assert set(got) == set(ref), f"keys: missing {sorted(set(ref) - set(got))}, extra {sorted(set(got) - set(ref))}"
    for k, r in ref.items():
        g = got[k]
        assert g.device.type == "cpu", f"{k}: on {g.device}"
        assert g.dtype == r.dtype and g.shape == r.shape, f"{k}: {g.dtype}{tuple(g.shape)} != {r.dtype}{tuple(r.shape)}"
        assert torch.equal(bits(g), bits(r)), f"{k}: values differ ({g.reshape(-1)[:3].tolist()} ...)"
    if shared:  # tensors that share a storage in ref share one in what was loaded
        groups = {}
        for k, r in ref.items():
            groups.setdefault(r.untyped_storage().data_ptr(), []).append(k)
        for ks in groups.values():
            ptrs = {got[k].untyped_storage().data_ptr() for k in ks}
            assert len(ptrs) == 1, f"{ks} share a storage in the source, not in what was loaded"

failures = []
for c in json.load(sys.stdin):
    try:
        ref = torch.load(c["ref"], weights_only=True)
        bare = re.sub(r"'[^']*'", "''", c["code"])  # the line's names, outside its string literals (paths)
        imports = c.get("imports")
        if imports is None:
            imports = [f"import {m}" for m in MODULES if re.search(r"\b" + re.escape(m) + r"\.", bare)]
        ns = {}
        exec("\n".join(imports), ns)
        model = build(ref)
        uses_model = re.search(r"\b(model|state_dict)\b", bare) is not None
        if uses_model:
            ns["model"] = model
            ns["state_dict"] = model.state_dict()
        got = eval(c["code"], ns)
        if uses_model:
            check(model.state_dict(), ref, False)
        else:
            check(eval("got" + c.get("sub", ""), {"got": got}), ref, True)
    except BaseException as e:
        failures.append({"code": c["code"], "argv": c.get("argv"), "error": f"{type(e).__name__}: {e}"})
print(json.dumps(failures))
'''


def run_hints(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run every case's line in ONE subprocess without a visible GPU; returns the failures."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(cases), capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def hint_line(output: str) -> str:
    """The code of the one ``Load it with: `` line of a command's output."""
    lines = [ln for ln in output.splitlines() if ln.startswith("Load it with: ")]
    assert len(lines) == 1, output
    return lines[0][len("Load it with: "):]


class Sources:
    """The source files of the cases (saved with GPU location tags where a GPU machine would have saved them), and
    :meth:`ref`: a state_dict saved where the subprocess can load it."""

    def __init__(self, folder: Path) -> None:
        from make_fixtures import gpu_tag
        from tagging import save_tagged

        self.folder = folder
        torch.manual_seed(0)
        import fixture_models

        net = fixture_models.TinyNet()
        net.bn.running_mean.uniform_()
        self.plain = net.state_dict()
        save_tagged(self.plain, str(folder / "plain.pt"), gpu_tag("cuda:0"))
        self.dp = type(self.plain)((f"module.{k}", v) for k, v in self.plain.items())
        save_tagged(self.dp, str(folder / "dp.pt"), gpu_tag("cuda:1"))
        tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3), nn.Linear(4, 10, bias=False))
        tied[2].weight = tied[0].weight
        self.tied = tied.state_dict()
        save_tagged(self.tied, str(folder / "tied.pt"), gpu_tag("cuda:0"))
        torch.save(tied, folder / "tied_full.pt")  # torch.nn classes only: extract-state-dict reads it
        torch.save({"model_state_dict": self.tied, "epoch": 3}, folder / "train.pt")
        base = torch.randn(20)
        self.views = {"a": base, "b": base[2:5], "c": base.view(4, 5)}
        torch.save(self.views, folder / "views.pt")
        import ckptool

        for name in ("tied", "views"):  # safetensors inputs of the prefix commands: ties recorded in __metadata__
            ckptool.convert(folder / f"{name}.pt", folder / f"{name}.safetensors")
        self._n = 0

    def __getitem__(self, name: str) -> str:
        return str(self.folder / name)

    def ref(self, sd: dict[str, torch.Tensor]) -> str:
        self._n += 1
        p = self.folder / f"ref{self._n}.pt"
        torch.save(dict(sd), p)
        return str(p)


def _renamed(sd: dict[str, torch.Tensor], fn: Callable[[str], str]) -> dict[str, torch.Tensor]:
    return {fn(k): v for k, v in sd.items()}


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Sources:
    return Sources(tmp_path_factory.mktemp("load_hint_sources"))


def _cases(src: Sources, out: Path) -> list[tuple[list[str], dict[str, torch.Tensor], dict[str, Any]]]:
    """``(argv, expected state_dict, extra case fields)`` for every output kind."""
    url = (out / "remote").as_uri()
    os.makedirs(out / "remote")
    plain, tied, dp = src.plain, src.tied, src.dp
    unprefixed = _renamed(dp, lambda k: k.removeprefix("module."))
    return [
        # folders of shards: one shard (the single file, not the folder), several (the index's files)
        (["convert", src["plain.pt"], "-o", f"{out}/one/", "--max-shard-size", "2GB"], plain, {}),
        (["convert", src["plain.pt"], "-o", f"{out}/many/", "--max-shard-size", "200"], plain, {}),
        (["convert", src["plain.pt"], "-o", f"{out}/named.safetensors", "--max-shard-size", "200"], plain, {}),
        (["convert", src["plain.pt"], "-o", f"{out}/tone/", "--format", "torch", "--max-shard-size", "2GB"], plain,
         {}),
        (["convert", src["plain.pt"], "-o", f"{out}/tmany/", "--format", "torch", "--max-shard-size", "200"], plain,
         {}),
        # tied weights: one file, one shard, several shards; torch files keep the sharing
        (["convert", src["tied.pt"], "-o", f"{out}/tied.safetensors"], tied, {}),
        (["convert", src["tied.pt"], "-o", f"{out}/tone1/", "--max-shard-size", "2GB"], tied, {}),
        (["convert", src["tied.pt"], "-o", f"{out}/tmany2/", "--max-shard-size", "100"], tied, {}),
        (["convert", src["train.pt"], "-o", f"{out}/train.safetensors"], tied, {}),
        (["convert", src["tied.pt"], "-o", f"{out}/tied.pt"], tied, {}),
        (["convert", src["tied.pt"], "-o", f"{out}/tied_cpu.pt", "--to", "cpu"], tied, {}),
        (["extract-state-dict", src["tied_full.pt"], "-o", f"{out}/tied_ex.safetensors"], tied, {}),
        (["extract-state-dict", src["tied_full.pt"], "-o", f"{out}/tied_ex.pt"], tied, {}),
        # views of one storage that are not whole tensors: only ckptool rebuilds them
        (["convert", src["views.pt"], "-o", f"{out}/views.safetensors"], src.views, {}),
        (["convert", src["views.pt"], "-o", f"{out}/views.pt"], src.views, {}),
        # torch zip outputs of remap and the prefix commands
        (["remap", src["plain.pt"], "--to", "cpu", "-o", f"{out}/r1.pt"], plain, {}),
        (["remap", src["dp.pt"], "--map", "cuda:1=cuda:0", "-o", f"{out}/r2.pt"], dp, {}),
        (["remap", src["train.pt"], "--to", "cpu", "-o", f"{out}/r3.pt"], tied, {"sub": "['model_state_dict']"}),
        (["remap", src["dp.pt"], "--to", "cpu", "--strip-dataparallel", "-o", f"{out}/r4.pt"], unprefixed, {}),
        (["strip-dataparallel", src["dp.pt"], "-o", f"{out}/p1.pt"], unprefixed, {}),
        (["unwrap", src["dp.pt"], "--to", "cpu", "-o", f"{out}/p2.pt"], unprefixed, {}),
        (["strip-prefix", src["dp.pt"], "module.", "-o", f"{out}/p3.pt"], unprefixed, {}),
        (["add-prefix", src["plain.pt"], "net.", "-o", f"{out}/p4.pt"], _renamed(plain, lambda k: f"net.{k}"), {}),
        (["add-prefix", src["train.pt"], "net.", "--key", "model_state_dict", "-o", f"{out}/p5.pt"],
         _renamed(tied, lambda k: f"net.{k}"), {}),
        # safetensors outputs of the prefix commands: the tied names recorded in __metadata__ are renamed too
        (["add-prefix", src["tied.safetensors"], "net.", "-o", f"{out}/p6.safetensors"],
         _renamed(tied, lambda k: f"net.{k}"), {}),
        (["strip-prefix", src["tied.safetensors"], "0.", "-o", f"{out}/p7.safetensors"],
         _renamed(tied, lambda k: k.removeprefix("0.")), {}),
        (["add-prefix", src["views.safetensors"], "m.", "-o", f"{out}/p8.safetensors"],
         _renamed(src.views, lambda k: f"m.{k}"), {}),
        # a DCP folder: loads in place into the state_dict it is given
        (["convert", src["plain.pt"], "-o", f"{out}/dcp/", "--format", "dcp"], plain, {}),
        # outputs written to a URL: the line opens them through fsspec
        (["remap", src["plain.pt"], "--to", "cpu", "-o", f"{url}/r.pt"], plain, {}),
        (["strip-dataparallel", src["dp.pt"], "-o", f"{url}/s.pt"], unprefixed, {}),
        (["convert", src["plain.pt"], "-o", f"{url}/p.safetensors"], plain, {}),
        (["convert", src["tied.pt"], "-o", f"{url}/t.safetensors"], tied, {}),
        (["convert", src["views.pt"], "-o", f"{url}/v.safetensors"], src.views, {}),
    ]


def test_every_printed_hint_loads_into_a_matching_model(src: Sources, run_cli: Any, tmp_path: Path) -> None:
    cases = []
    for argv, ref, extra in _cases(src, tmp_path):
        r = run_cli(*argv)
        assert r.exit_code == 0, (argv, r.output)
        cases.append({"code": hint_line(r.output), "ref": src.ref(ref), "argv": argv, **extra})
    failures = run_hints(cases)
    assert not failures, json.dumps(failures, indent=1)


def test_set_hints_of_a_model_folder_run(run_cli: Any, tmp_path: Path) -> None:
    """A rewritten transformers model folder (issue 37): the printed line is ``from_pretrained(folder)`` and builds
    the model with the saved values, tied ``lm_head.weight`` included; with ``--json``, with exactly its imports;
    keys renamed, or no config.json: ``ckptool.load_into(model, folder)`` into the matching model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32,
                                                                 n_positions=16, bos_token_id=0, eos_token_id=1))
    model.save_pretrained(tmp_path / "hf", max_shard_size="2KB")
    ref = tmp_path / "ref.pt"
    torch.save(model.state_dict(), ref)
    bare = tmp_path / "bare"
    bare.mkdir()
    for p in (tmp_path / "hf").glob("model*"):
        p.rename(bare / p.name)
    (tmp_path / "hf" / "config.json").rename(bare / "config.json")
    cases = []
    argv = ["filter", bare, "--keep", "*", "-o", tmp_path / "kept"]
    r = run_cli(*argv)
    assert r.exit_code == 0, r.output
    assert hint_line(r.output) == f"transformers.GPT2LMHeadModel.from_pretrained({str(tmp_path / 'kept')!r})"
    cases.append({"code": hint_line(r.output), "ref": str(ref), "sub": ".state_dict()", "argv": argv[:1]})
    hint = json.loads(run_cli(*argv, "--force", "--json").output)["load_hint"]
    cases.append({"code": hint["code"], "imports": hint["imports"], "ref": str(ref), "sub": ".state_dict()"})
    # keys renamed: into the user's model (from_pretrained would start GPT2LMHeadModel from random weights here)
    r = run_cli("add-prefix", bare, "net.", "-o", tmp_path / "net")
    assert hint_line(r.output) == f"ckptool.load_into(model, {str(tmp_path / 'net')!r})"
    saved = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    cases.append({"code": hint_line(r.output), "ref": src_ref(tmp_path / "ref1.pt", {f"net.{k}": v
                                                                                      for k, v in saved.items()})})
    (bare / "config.json").unlink()
    r = run_cli("strip-prefix", bare, "transformer.", "-o", tmp_path / "noconfig")
    assert hint_line(r.output) == f"ckptool.load_into(model, {str(tmp_path / 'noconfig')!r})"
    stripped = {k.removeprefix("transformer."): v for k, v in saved.items()}
    cases.append({"code": hint_line(r.output), "ref": src_ref(tmp_path / "ref2.pt", stripped)})
    failures = run_hints(cases)
    assert not failures, json.dumps(failures, indent=1)


def src_ref(path: Path, sd: dict[str, torch.Tensor]) -> str:
    """``sd`` saved at ``path`` for the runner."""
    torch.save(dict(sd), path)
    return str(path)


def test_json_hints_run_with_exactly_their_imports(src: Sources, run_cli: Any, tmp_path: Path) -> None:
    """``--json`` gives the hint's ``imports``: they are all the line needs (nothing else is imported)."""
    cases = []
    for argv, ref, extra in _cases(src, tmp_path):
        if argv[0] != "convert" and "remote" not in argv[-1]:
            continue
        r = run_cli(*argv, "--json")
        assert r.exit_code == 0, (argv, r.output)
        hint = json.loads(r.output)["load_hint"]
        cases.append({"code": hint["code"], "imports": hint["imports"], "ref": src.ref(ref), "argv": argv, **extra})
    assert len(cases) > 15
    failures = run_hints(cases)
    assert not failures, json.dumps(failures, indent=1)


def test_hint_shapes(src: Sources, run_cli: Any, tmp_path: Path) -> None:
    """The line names the file written and the call that keeps tied weights (what issue 27 reported)."""
    r = run_cli("convert", src["plain.pt"], "-o", f"{tmp_path}/one/", "--max-shard-size", "2GB")
    assert hint_line(r.output) == f"safetensors.torch.load_file('{tmp_path}/one/model.safetensors')"
    hint = load_hint(f"{tmp_path}/one/")  # the library call on the folder names the file too
    assert hint.code == f"safetensors.torch.load_file('{tmp_path}/one/model.safetensors')"
    assert hint.imports == ["import safetensors.torch"]
    r = run_cli("convert", src["tied.pt"], "-o", tmp_path / "t.safetensors")
    assert hint_line(r.output) == f"safetensors.torch.load_model(model, '{tmp_path / 't.safetensors'}')"
    assert "tied weights are stored once (2.weight is 0.weight)" in r.output
    r = run_cli("convert", src["views.pt"], "-o", tmp_path / "v.safetensors")
    assert hint_line(r.output).startswith("ckptool.load_into(model, ")
    assert "2 tensor(s) are views of another tensor that safetensors cannot hold (b, c)" in r.output
    assert load_hint(tmp_path / "v.safetensors").imports == ["import ckptool"]


def test_the_runner_catches_lines_that_do_not_load(src: Sources, run_cli: Any, tmp_path: Path) -> None:
    """The hints issue 27 found (a folder given to load_file, load_file for tied weights), a line that needs a
    module it does not import, and a line that loads other values, all fail in the runner."""
    run_cli("convert", src["plain.pt"], "-o", f"{tmp_path}/one/", "--max-shard-size", "2GB")
    run_cli("convert", src["tied.pt"], "-o", tmp_path / "t.safetensors")
    run_cli("remap", src["plain.pt"], "--to", "cpu", "-o", tmp_path / "r.pt")
    run_cli("remap", src["dp.pt"], "--to", "cpu", "-o", tmp_path / "dp.pt")
    plain, tied = src.ref(src.plain), src.ref(src.tied)
    bad = [
        {"code": f"safetensors.torch.load_file('{tmp_path}/one/')", "ref": plain},
        {"code": f"model.load_state_dict(safetensors.torch.load_file('{tmp_path / 't.safetensors'}'))", "ref": tied},
        {"code": f"safetensors.torch.load_file('{tmp_path / 't.safetensors'}')", "ref": tied},
        {"code": f"torch.load('{tmp_path / 'r.pt'}', weights_only=True)", "imports": [], "ref": plain},
        {"code": f"model.load_state_dict(torch.load('{tmp_path / 'dp.pt'}', weights_only=True))", "ref": plain},
        {"code": f"model.load_state_dict(torch.load('{tmp_path / 'r.pt'}'), strict=False)", "ref": tied},
    ]
    failures = run_hints(bad)
    assert [f["code"] for f in failures] == [c["code"] for c in bad], json.dumps(failures, indent=1)
    assert "No such device" in failures[0]["error"] or "Is a directory" in failures[0]["error"]
    assert "Missing key(s)" in failures[1]["error"] and "2.weight" in failures[1]["error"]
    assert "missing ['2.weight']" in failures[2]["error"]
    assert "NameError" in failures[3]["error"]
