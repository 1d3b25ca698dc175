"""``torch.export`` archives (``.pt2``): recognised, inspected, converted and extracted without running anything,
scanned by the members the loader unpickles; the outputs equal ``torch.export.load(path).state_dict`` /
``.constants`` bit for bit (fixtures from ``fixtures/make_pt2.py``)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import make_pt2
import pytest
import torch
from helpers import storage_groups

from ckptool import errors
from ckptool.formats import detect
from ckptool.formats.pt2 import read_pt2
from ckptool.ops.inspect.entry import inspect


@pytest.fixture(scope="module")
def pt2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_pt2.build(tmp_path_factory.mktemp("pt2"))


@pytest.fixture(scope="module")
def loaded(pt2: dict[str, Path]) -> Any:
    """The reference: torch's own loader on the (trusted, generated) archive."""
    return torch.export.load(pt2["model.pt2"])


def _same(a: torch.Tensor, b: torch.Tensor, key: str, *, layout: bool = True) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, key
    if layout:
        assert a.stride() == b.stride() and a.storage_offset() == b.storage_offset(), key
    assert torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                       b.detach().contiguous().reshape(-1).view(torch.uint8)), key


def test_detected_as_torch_export(pt2: dict[str, Path]) -> None:
    assert detect.detect_format(str(pt2["model.pt2"])) == detect.PT2


def test_reader_layout_and_versions(pt2: dict[str, Path], loaded: Any) -> None:
    path = str(pt2["model.pt2"])
    arch = read_pt2(path, detect.zip_entries(path))
    assert arch.version == "0" and [p.name for p in arch.programs] == ["model"]
    prog = arch.programs[0]
    assert [p.fqn for p in prog.weights] == list(loaded.state_dict)
    assert {p.fqn for p in prog.constants} == set(loaded.constants)
    by = {p.fqn: p for p in prog.weights}
    assert by["emb.weight"].member == by["head.weight"].member  # tied: one member
    assert (by["window"].storage_offset, by["window"].stride, by["window"].record_size) == (2, (3,), 80)
    assert by["lin.weight"].kind == "parameter" and by["steps"].kind == "buffer"
    kinds = {p.fqn: p.kind for p in prog.constants}
    assert kinds == {"const": "constant", "nonpers": "buffer"}
    assert prog.schema_version.startswith("8.") and prog.torch_version == torch.__version__


def test_inspect_lists_weights_and_signature(pt2: dict[str, Path], loaded: Any) -> None:
    info = inspect(pt2["model.pt2"])
    assert (info.format, info.kind) == ("torch-export", "exported_program")
    rows = {t.key: t for t in info.tensors}
    expected = {**dict(loaded.state_dict), **{f"constants.{k}": v for k, v in loaded.constants.items()}}
    assert set(rows) == set(expected)
    for key, t in expected.items():
        r = rows[key]
        assert (r.shape, r.dtype, r.device, r.nbytes) == (list(t.shape), str(t.dtype).removeprefix("torch."),
                                                          "cpu", t.numel() * t.element_size()), key
        assert (r.stride, r.storage_offset) == (list(t.stride()), t.storage_offset()), key
    assert rows["emb.weight"].storage_key == rows["head.weight"].storage_key
    assert info.state_dicts[0].tensors == len(loaded.state_dict)
    (prog,) = info.programs
    user = [(e["name"], e["dtype"], e["shape"]) for e in prog["inputs"] if e["kind"] == "user_input"]
    assert user == [("x", "float32", [2, 4]), ("idx", "int64", [2])]
    assert [e["kind"] for e in prog["outputs"]] == ["user_output", "user_output"]
    targets = {e["target"] for e in prog["inputs"] if e["kind"] in ("parameter", "buffer", "tensor_constant")}
    assert targets == set(expected_fqns(loaded))
    assert info.metadata is not None and info.metadata["archive_version"] == "0"
    assert info.verdict == "safe"


def expected_fqns(loaded: Any) -> list[str]:
    return [*loaded.state_dict, *loaded.constants]


def test_inspect_cli_text_and_json(pt2: dict[str, Path], run_cli: Any) -> None:
    r = run_cli("inspect", pt2["model.pt2"])
    assert r.exit_code == 0, r.output
    assert "Format:   torch-export" in r.output and "Exported program 'model'" in r.output
    assert "inputs:  x float32 2x4, idx int64 2" in r.output
    r = run_cli("inspect", "--json", pt2["model.pt2"])
    d = json.loads(r.output)
    assert d["format"] == "torch-export" and d["programs"][0]["name"] == "model"
    assert {t["key"] for t in d["tensors"]} >= {"lin.weight", "constants.const"}


@pytest.mark.parametrize("command", ["convert", "extract-state-dict"])
def test_torch_output_equals_torch_export_load(pt2: dict[str, Path], loaded: Any, tmp_path: Path, run_cli: Any,
                                               command: str) -> None:
    out = tmp_path / "sd.pth"
    r = run_cli(command, pt2["model.pt2"], "-o", out)
    assert r.exit_code == 0, r.output
    sd = torch.load(out, weights_only=True)
    assert list(sd) == list(loaded.state_dict)
    for k, v in loaded.state_dict.items():
        _same(sd[k], v, k)
    assert storage_groups(sd) == storage_groups(dict(loaded.state_dict)) == {frozenset({"emb.weight",
                                                                                         "head.weight"})}


def test_constants_with_key(pt2: dict[str, Path], loaded: Any, tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "c.pth"
    r = run_cli("convert", pt2["model.pt2"], "--key", "constants", "-o", out)
    assert r.exit_code == 0, r.output
    c = torch.load(out, weights_only=True)
    assert set(c) == set(loaded.constants)
    for k, v in loaded.constants.items():
        _same(c[k], v, k)
    r = run_cli("convert", pt2["model.pt2"], "--key", "graph", "-o", tmp_path / "x.pth")
    assert r.exit_code == 2 and "choose one of state_dict, constants" in r.output


@pytest.mark.parametrize("command", ["convert", "extract-state-dict"])
def test_safetensors_output_equals_torch_export_load(pt2: dict[str, Path], loaded: Any, tmp_path: Path,
                                                     run_cli: Any, command: str) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "sd.safetensors"
    r = run_cli(command, pt2["model.pt2"], "-o", out)
    assert r.exit_code == 0, r.output
    st = load_file(out)
    for k, v in loaded.state_dict.items():
        if k in st:
            _same(st[k], v, k, layout=False)
    assert set(loaded.state_dict) - set(st) <= {"head.weight"}  # a tied alias may be stored once


def test_scan_safe_and_payloads(pt2: dict[str, Path], run_cli: Any) -> None:
    from ckptool.scanning.entry import scan_file

    res = scan_file(pt2["model.pt2"])
    assert (res.format, res.verdict) == ("torch-export", "safe")
    assert not any("weight_" in n for n in res.notes)  # raw tensor members are not read as pickles
    for name, member in (("sample_payload.pt2", "sample_inputs/model.pt"), ("weight_payload.pt2", "weight_0"),
                         ("opaque_payload.pt2", "opaque_obj_0")):
        res = scan_file(pt2[name])
        assert res.verdict == "dangerous", name
        (g,) = [g for g in res.globals if g.name == "os.system"]
        assert any(member in w for w in g.where), (name, g.where)
    r = run_cli("scan", pt2["opaque_payload.pt2"])
    assert r.exit_code == 1 and "DANGEROUS" in r.output


def test_pickled_payloads_are_not_run(pt2: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    r = run_cli("convert", pt2["weight_payload.pt2"], "-o", tmp_path / "w.pth")
    assert r.exit_code == 1
    assert "is a tensor subclass pickled in member data/weights/weight_0" in r.output
    info = inspect(pt2["opaque_payload.pt2"])
    assert info.verdict in ("needs-trust", "dangerous") and [v.path for v in info.values] == ["constants.obj"]
    r = run_cli("convert", pt2["opaque_payload.pt2"], "--key", "constants", "-o", tmp_path / "c.pth")
    assert r.exit_code == 0, r.output
    assert "obj: pickled object (data/constants/opaque_obj_0, not read)" in r.output


def test_newer_archive_version_refused(pt2: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    for args in (("inspect", pt2["future.pt2"]), ("convert", pt2["future.pt2"], "-o", tmp_path / "f.pth")):
        r = run_cli(*args)
        assert r.exit_code == 1
        assert "archive_version '1'; ckptool reads version 0" in r.output
    with pytest.raises(errors.UnsupportedError, match="archive_version"):
        inspect(pt2["future.pt2"])


def test_newer_schema_and_damaged_config(pt2: dict[str, Path], tmp_path: Path) -> None:
    def rewrite(name: str, change: Any) -> Path:
        dst = tmp_path / name
        with zipfile.ZipFile(pt2["model.pt2"]) as zin, zipfile.ZipFile(dst, "w") as zout:
            for i in zin.infolist():
                zout.writestr(i.filename, change(i.filename, zin.read(i.filename)))
        return dst

    def schema(name: str, data: bytes) -> bytes:
        if name.endswith("models/model.json"):
            doc = json.loads(data)
            doc["schema_version"]["major"] = 99
            return json.dumps(doc).encode()
        return data

    with pytest.raises(errors.UnsupportedError, match="schema version 99"):
        inspect(rewrite("schema.pt2", schema))
    short = rewrite("short.pt2", lambda n, d: d[:8] if n.endswith("data/weights/weight_3") else d)
    with pytest.raises(errors.CorruptCheckpointError, match=r"emb\.weight"):
        inspect(short)

    def config(change: Any) -> Any:
        def rewrite_config(name: str, data: bytes) -> bytes:
            if name.endswith("data/weights/model_weights_config.json"):
                cfg = json.loads(data)
                change(cfg["config"]["lin.weight"])
                return json.dumps(cfg).encode()
            return data
        return rewrite_config

    missing = rewrite("missing.pt2", config(lambda m: m.update(path_name="weight_99")))
    with pytest.raises(errors.CorruptCheckpointError, match="weight_99"):
        inspect(missing)
    negative = rewrite("negative.pt2", config(lambda m: m["tensor_meta"]["strides"][0].update(as_int=-4)))
    with pytest.raises(errors.CorruptCheckpointError, match="invalid layout"):
        inspect(negative)
    escape = rewrite("escape.pt2", config(lambda m: m.update(path_name="../models/model.json")))
    with pytest.raises(errors.CorruptCheckpointError, match="does not hold"):
        inspect(escape)


def test_other_commands_name_the_format(pt2: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    r = run_cli("remap", pt2["model.pt2"], "--to", "cpu", "-o", tmp_path / "r.pth")
    assert r.exit_code == 1 and "is a torch.export archive (.pt2)" in r.output and "ckptool convert" in r.output


def test_verify_and_load_into_without_running_the_archive(pt2: dict[str, Path], loaded: Any) -> None:
    from ckptool import load_into, verify
    from ckptool.torch_ops.load import load_checkpoint

    sd, saved = load_checkpoint(pt2["model.pt2"], "cpu")
    assert list(sd) == list(loaded.state_dict) and saved == {"cpu": len(sd)}
    for k, v in loaded.state_dict.items():
        _same(sd[k], v, k)
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    report = verify(make_pt2.ExportNet, pt2["model.pt2"], device="cpu")
    assert report.ok, report
    model = make_pt2.ExportNet()
    load_into(model, pt2["model.pt2"])
    for k, v in loaded.state_dict.items():
        _same(model.state_dict()[k], v, k, layout=False)


def test_diff_against_the_converted_file(pt2: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "w.pth"
    assert run_cli("convert", pt2["model.pt2"], "-o", out).exit_code == 0
    r = run_cli("diff", pt2["model.pt2"], out)
    assert r.exit_code == 0, r.output
    st = tmp_path / "w.safetensors"
    assert run_cli("convert", pt2["model.pt2"], "-o", st).exit_code == 0
    r = run_cli("diff", pt2["model.pt2"], st)  # safetensors stores the strided view contiguous: not a difference
    assert r.exit_code == 0, r.output
    assert "1 tensor: non-contiguous stride [3] in A, not stored in B (safetensors)" in r.output
    assert "8 of 8 matched tensors equal (bit-exact)" in r.output
    r = run_cli("diff", pt2["model.pt2"], st, "--strict")  # --strict counts what B cannot store
    assert r.exit_code == 1 and "stride" in r.output


@pytest.mark.filterwarnings("ignore:No complete tensor found")
def test_archive_of_several_programs(loaded: Any, tmp_path: Path, run_cli: Any) -> None:
    from torch.export.pt2_archive._package import package_pt2

    path = tmp_path / "two.pt2"
    package_pt2(str(path), exported_programs={"enc": make_pt2.export_model(), "dec": make_pt2.export_model()})
    info = inspect(path)
    keys = {t.key for t in info.tensors}
    assert {"enc.lin.weight", "dec.constants.const"} <= keys and len(info.programs) == 2
    r = run_cli("convert", path, "-o", tmp_path / "x.pth")
    assert r.exit_code == 2 and "enc.state_dict" in r.output and "dec.constants" in r.output
    r = run_cli("convert", path, "--key", "dec.constants", "-o", tmp_path / "c.pth")
    assert r.exit_code == 0, r.output
    c = torch.load(tmp_path / "c.pth", weights_only=True)
    for k, v in loaded.constants.items():
        _same(c[k], v, k)


def test_inspect_imports_no_torch(pt2: dict[str, Path]) -> None:
    import subprocess
    import sys

    code = (f"import sys, ckptool\ninfo = ckptool.inspect({str(pt2['model.pt2'])!r})\n"
            "assert info.format == 'torch-export' and info.programs\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
