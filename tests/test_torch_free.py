"""``pip install ckptool`` without torch: the commands that need no torch work on GPU-tagged fixtures, their outputs
load bit-exactly in torch, and a command that needs torch says how to install it in one line.

The commands run in a subprocess where ``import torch`` and ``import numpy`` fail (a folder on ``PYTHONPATH`` whose
``torch`` and ``numpy`` packages raise ``ModuleNotFoundError``), so the same tests mean the same thing with or
without torch installed. ``.ci/run`` runs the ``torchfree`` tests in a virtual environment without torch, with
``$CKPTOOL_TORCHFREE_OUT`` naming the folder the commands write into, then runs this module again with torch: when
that folder already holds ``results.json``, the outputs made there are the ones loaded in torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest

#: the folder the commands write into (a temporary one when unset); one holding results.json is reused with torch
OUT_ENV = "CKPTOOL_TORCHFREE_OUT"
HINT = ("Error: this needs the torch package, which is not installed (`pip install ckptool` leaves it out); "
        "install it with: pip install 'ckptool[torch]'")

#: (name, ckptool arguments, output file or ""): ``{g}`` is the generated fixtures' folder, ``{o}`` the output one.
#: In order: a later command may read an earlier one's output.
CASES: list[tuple[str, list[str], str]] = [
    ("inspect", ["inspect", "{g}/sd_mixed.pt", "--json"], ""),
    ("scan", ["scan", "{g}/sd_cuda0.pt", "{g}/train_cuda1_legacy.pt"], ""),
    ("remap", ["remap", "{g}/sd_mixed.pt", "--to", "cpu", "-o", "{o}/remap.pt"], "remap.pt"),
    ("remap-legacy", ["remap", "{g}/train_cuda1_legacy.pt", "--to", "cpu", "-o", "{o}/remap_legacy.pt"],
     "remap_legacy.pt"),
    ("strip-dataparallel", ["strip-dataparallel", "{g}/sd_dp_cuda0.pt", "-o", "{o}/strip.pt"], "strip.pt"),
    ("extract-state-dict", ["extract-state-dict", "{g}/model_full_cuda0.pt", "-o", "{o}/extract.pt"], "extract.pt"),
    ("sanitize", ["sanitize", "{g}/model_full_cuda0.pt", "--to", "cpu", "-o", "{o}/sanitize.pt"], "sanitize.pt"),
    ("to-safetensors", ["convert", "{g}/sd_cuda0.pt", "-o", "{o}/sd.safetensors"], "sd.safetensors"),
    ("legacy-to-safetensors", ["convert", "{g}/train_cuda1_legacy.pt", "-o", "{o}/train.safetensors"],
     "train.safetensors"),
    ("from-safetensors", ["convert", "{o}/sd.safetensors", "-o", "{o}/back.pt"], "back.pt"),
    ("torch-to-torch", ["convert", "{g}/dtypes_cuda0.pt", "--to", "cpu", "-o", "{o}/dtypes.pt"], "dtypes.pt"),
]
OUTPUTS = [(name, out) for name, _args, out in CASES if out]


def _blocker(folder: Path) -> Path:
    """``folder`` holding ``torch`` and ``numpy`` packages that fail to import, as where they are not installed."""
    for mod in ("torch", "numpy"):
        (folder / mod).mkdir(parents=True, exist_ok=True)
        (folder / mod / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{mod}'\", name={mod!r})\n", encoding="utf-8")
    return folder


def run_without_torch(args: list[str], block: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m ckptool ARGS`` in a subprocess where torch and numpy cannot be imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(block), os.environ.get("PYTHONPATH")]))}
    env.pop("CKPTOOL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "ckptool", *args], check=False, env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def block(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _blocker(tmp_path_factory.mktemp("block"))


@pytest.fixture(scope="session")
def runs(generated: dict[str, Path], block: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(output folder, name -> {"argv", "rc", "stdout", "stderr"}) of every case of :data:`CASES`, run without
    torch; with torch, a folder ``$CKPTOOL_TORCHFREE_OUT`` that already holds ``results.json`` is read instead."""
    from conftest import has_torch

    folder = os.environ.get(OUT_ENV)
    out = Path(folder) if folder else tmp_path_factory.mktemp("torchfree")
    results = out / "results.json"
    if folder and has_torch() and results.is_file():
        return out, json.loads(results.read_text(encoding="utf-8"))
    out.mkdir(parents=True, exist_ok=True)
    g = next(iter(generated.values())).parent
    done: dict[str, dict[str, Any]] = {}
    for name, args, _out in CASES:
        argv = [a.format(g=g, o=out) for a in args]
        p = run_without_torch(argv, block, out)
        done[name] = {"argv": argv, "rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
    results.write_text(json.dumps(done, indent=1), encoding="utf-8")
    return out, done


# ------------------------------------------------------------------------------------------ without torch
@pytest.mark.torchfree
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_command_works_without_torch(runs: tuple[Path, dict], name: str) -> None:
    from ckptool import inspect

    out, done = runs
    r = done[name]
    assert r["rc"] == 0, f"ckptool {' '.join(r['argv'])}: exit {r['rc']}\n{r['stderr']}"
    if name == "inspect":
        assert json.loads(r["stdout"])["devices"] == {"cpu": 2, "cuda:0": 5, "cuda:1": 2}
    elif name == "scan":
        assert r["stdout"].count(": safe (") == 2
    elif name.startswith("remap"):
        assert set(inspect(out / dict(OUTPUTS)[name]).devices) == {"cpu"}
    elif name == "strip-dataparallel":
        keys = [t.key for t in inspect(out / "strip.pt").tensors]
        assert keys and not any(k.startswith("module.") for k in keys)
    elif name not in ("extract-state-dict", "sanitize"):  # the conversions check their output
        assert "Verified:" in r["stdout"]


@pytest.mark.torchfree
@pytest.mark.parametrize("args", [
    ["verify", "{g}/sd_cpu.pt", "--model", "{o}/model.py:build"],
    ["verify", "{g}/sd_cpu.pt", "--model", "{o}/torch_model.py:build"],  # the model's own `import torch` fails
    ["extract-state-dict", "{g}/model_full_cuda0.pt", "--trust", "-o", "{o}/x.pt"],
    ["convert", "{g}/sd_cuda0.pt", "--dtype", "float16", "-o", "{o}/x.safetensors"],
    ["demo"],
])
def test_command_that_needs_torch_prints_one_line(generated: dict[str, Path], block: Path, tmp_path: Path,
                                                  args: list[str]) -> None:
    (tmp_path / "model.py").write_text("def build():\n    return None\n", encoding="utf-8")
    (tmp_path / "torch_model.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(2, 2)\n",
                                             encoding="utf-8")
    g = next(iter(generated.values())).parent
    p = run_without_torch([a.format(g=g, o=tmp_path) for a in args], block, tmp_path)
    assert (p.returncode, p.stderr.splitlines(), p.stdout) == (1, [HINT], "")  # 1: EXIT_FAILURE


@pytest.mark.torchfree
def test_error_table_names_the_torch_extra() -> None:
    from ckptool.cli._errors import describe_error
    from ckptool.errors import UsageError

    missing = ModuleNotFoundError("No module named 'torch'", name="torch")
    assert describe_error(missing) == (HINT.removeprefix("Error: "), 1)
    numpy = describe_error(ModuleNotFoundError("No module named 'numpy'", name="numpy"))
    assert numpy[0].endswith("pip install 'ckptool[numpy]'")
    try:
        raise UsageError("--model m:f: cannot import m") from missing
    except UsageError as e:
        assert describe_error(e) == (HINT.removeprefix("Error: "), 1)
    assert describe_error(UsageError("--model m:f: cannot import m")) == ("--model m:f: cannot import m", 2)


@pytest.mark.torchfree
def test_help_lists_the_commands_that_need_torch(block: Path, tmp_path: Path) -> None:
    p = run_without_torch(["--help"], block, tmp_path)
    assert p.returncode == 0
    commands = {line.split()[0] for line in p.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert {"verify", "demo", "inspect", "convert"} <= commands


@pytest.mark.torchfree
def test_own_readers_catch_what_safe_open_and_torch_load_would(runs: tuple[Path, dict], tmp_path: Path) -> None:
    """The checks that run without torch and NumPy find a changed byte, dtype, key or record."""
    from ckptool.formats.safetensors import read_header
    from ckptool.formats.tensors import Storage
    from ckptool.ops.convert.verify import header_difference, reader_difference, records_difference
    from ckptool.readers.read_torch import torch_source

    out, _done = runs
    st = tmp_path / "sd.safetensors"
    st.write_bytes((out / "sd.safetensors").read_bytes())
    h = read_header(str(st))
    data = st.read_bytes()
    expect = [(k, {"F32": "float32", "I64": "int64"}[e["dtype"]], tuple(e["shape"]),
               zlib.crc32(data[h.data_start + e["data_offsets"][0]:h.data_start + e["data_offsets"][1]]))
              for k, e in h.entries.items()]
    assert header_difference(str(st), expect, h.metadata) is None
    assert header_difference(str(st), expect, {"x": "y"}) == "__metadata__ differs"
    wrong = [(expect[0][0], "float16", *expect[0][2:]), *expect[1:]]
    assert "reads back as float32" in (header_difference(str(st), wrong, h.metadata) or "")
    first = min(h.entries.values(), key=lambda e: e["data_offsets"][0])
    flipped = bytearray(data)
    flipped[h.data_start + first["data_offsets"][0]] ^= 1
    st.write_bytes(bytes(flipped))
    assert "different bytes (CRC-32)" in (header_difference(str(st), expect, h.metadata) or "")

    pt = str(out / "back.pt")
    back = torch_source(pt, "torch-zip", None)
    expected = back.tensors
    assert reader_difference(pt, expected) is None
    assert reader_difference(pt, expected[::-1]) == "the state_dict keys differ"
    assert "reads back as" in (reader_difference(pt, expected, lambda d: "float64") or "")
    moved = dataclasses.replace(expected[1], storage=expected[0].storage)  # a storage the file does not share
    assert "storage" in (reader_difference(pt, [expected[0], moved, *expected[2:]]) or "")
    alone = dataclasses.replace(expected[0], storage=Storage(**vars(expected[0].storage)))
    if any(t.storage is expected[0].storage for t in expected[1:]):
        assert "shares" in (reader_difference(pt, [alone, *expected[1:]]) or "")
    with zipfile.ZipFile(pt) as z:
        records = {i.filename.split("/", 1)[-1]: i.CRC for i in z.infolist() if "/data/" in i.filename}
    assert records and records_difference(pt, records) is None
    name = next(iter(records))
    assert "CRC-32 differs" in (records_difference(pt, {**records, name: records[name] ^ 1}) or "")


@pytest.mark.torchfree
def test_verification_says_which_check_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.ops.convert import OutputFormat, verify
    from ckptool.torch_ops import convert_verify

    monkeypatch.setattr(convert_verify, "is_installed", lambda module: False)
    monkeypatch.setattr(verify, "is_installed", lambda module: False)
    assert "ckptool's own safetensors reader" in verify.verification_check(OutputFormat.SAFETENSORS, {"float32"})
    assert "ckptool's own reader" in verify.verification_check(OutputFormat.TORCH, {"float32"})
    monkeypatch.setattr(convert_verify, "is_installed", lambda module: True)
    monkeypatch.setattr(verify, "is_installed", lambda module: True)
    assert "safe_open with NumPy" in verify.verification_check(OutputFormat.SAFETENSORS, {"float32"})
    assert "safe_open with torch" in verify.verification_check(OutputFormat.SAFETENSORS, {"bfloat16"})
    assert "torch.load(weights_only=True)" in verify.verification_check(OutputFormat.TORCH, {"float32"})


# ------------------------------------------------------------------------------------------ in torch
def _expected(name: str, generated: dict[str, Path]) -> Any:
    """What the output of case ``name`` must hold, loaded by torch from the source fixture."""
    import torch
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    def load(n: str) -> Any:
        return torch.load(generated[n], map_location="cpu", weights_only=n != "model_full_cuda0.pt")

    if name == "remap":
        return load("sd_mixed.pt")
    if name == "remap-legacy":
        return load("train_cuda1_legacy.pt")
    if name == "strip-dataparallel":
        sd = load("sd_dp_cuda0.pt")
        consume_prefix_in_state_dict_if_present(sd, "module.")
        return dict(sd)
    if name in ("extract-state-dict", "sanitize"):
        return dict(load("model_full_cuda0.pt").state_dict())
    if name in ("to-safetensors", "from-safetensors"):
        return dict(sorted(load("sd_cuda0.pt").items()))
    if name == "legacy-to-safetensors":
        return dict(sorted(load("train_cuda1_legacy.pt")["model_state_dict"].items()))
    return dict(load("dtypes_cuda0.pt"))


@pytest.mark.parametrize("name, output", OUTPUTS)
def test_outputs_made_without_torch_load_bit_exactly_in_torch(runs: tuple[Path, dict], generated: dict[str, Path],
                                                              name: str, output: str) -> None:
    import torch
    from helpers import assert_same_tensors, storage_groups
    from safetensors.torch import load_file

    out, done = runs
    assert done[name]["rc"] == 0, done[name]["stderr"]
    want = _expected(name, generated)
    path = out / output
    if output.endswith(".safetensors"):
        got = dict(sorted(load_file(str(path)).items()))
        assert_same_tensors(want, got)
        return
    if name in ("strip-dataparallel", "extract-state-dict"):  # the source's cuda tags are kept
        got = torch.load(path, weights_only=True, map_location="cpu")
    else:  # no map_location: every storage is tagged cpu
        got = torch.load(path, weights_only=True)
    if name.startswith("remap"):
        assert_same_tensors(want, got)
        assert storage_groups(want) == storage_groups(got)
    else:
        assert_same_tensors(dict(sorted(want.items())), dict(sorted(got.items())))
