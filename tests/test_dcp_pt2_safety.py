"""No DCP or ``.pt2`` item reaches a loader that unpickles it without restriction unless the user trusts the file,
and ``scan`` reads the items those loaders read.

* DCP: an entry is a tensor or a non-tensor entry by its class, as DCP's load planner decides
  (:func:`ckptool.formats.dcp.entry_kind`); every record is checked with the same rules whatever its class
  (``check_dcp_safe`` runs ``scan``), because a pickle can BUILD an entry twice and change its class on the way.
* ``.pt2``: ``torch.export.load`` unpickles every constant named ``opaque_obj_*`` / ``custom_obj_*`` whatever the
  config says (:func:`ckptool.formats.pt2.constant_role`, :func:`~ckptool.formats.pt2.member_roles`).

The fixtures are the cases of ``fuzz/adversarial_dcp.py``; each ``loader`` snippet is run once to show that the
payload is live in torch's own loader (the independent evidence that scan must flag it).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ckptool.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptool.formats.dcp import read_dcp_metadata
from ckptool.formats.detect import zip_entries
from ckptool.formats.pt2 import member_roles, read_pt2
from ckptool.ops.convert import convert
from ckptool.scanning.dcp_safety import check_dcp_safe
from ckptool.scanning.entry import scan_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))
import adversarial
import adversarial_dcp

CASES = {c.name: c for c in adversarial_dcp.CASES}
DCP_CASES = [n for n in CASES if n.startswith("dcp-")]


def _make(name: str, tmp_path: Path) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return CASES[name].make(folder)


@pytest.fixture
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "MARKER"
    monkeypatch.setenv(adversarial.MARKER_ENV, str(path))
    return path


def _run_loader(name: str, path: Path, marker: Path) -> None:
    code = f"PATH = {str(path)!r}\n" + (CASES[name].loader or "")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, adversarial.MARKER_ENV: str(marker)},
                   capture_output=True, timeout=300, check=False)


# ------------------------------------------------------------------------------------------------ DCP
@pytest.mark.parametrize("name", [n for n in DCP_CASES if CASES[n].loader])
def test_the_dcp_payload_runs_in_torchs_loader(name: str, tmp_path: Path, marker: Path) -> None:
    """The fixtures are live: DCP's own load (default planner) runs the payload."""
    path = _make(name, tmp_path)
    _run_loader(name, path, marker)
    assert marker.exists()


@pytest.mark.parametrize("name", DCP_CASES)
def test_scan_flags_every_dcp_case_dangerous(name: str, tmp_path: Path) -> None:
    res = scan_file(_make(name, tmp_path))
    assert res.verdict == "dangerous" and "os.system" in {g.name for g in res.unsafe}, (res.error, res.notes)


@pytest.mark.parametrize("name", DCP_CASES)
@pytest.mark.parametrize("out", ["m.pt", "m.safetensors"])
def test_convert_of_a_dcp_case_runs_nothing(name: str, out: str, tmp_path: Path, marker: Path) -> None:
    path = _make(name, tmp_path)
    with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError)):
        convert(path, tmp_path / out)
    assert not marker.exists()
    assert not (tmp_path / out).exists()


def test_a_bytes_entry_with_a_size_is_a_bytes_entry(tmp_path: Path) -> None:
    meta = read_dcp_metadata(_make("dcp-bytes-entry-with-size", tmp_path))
    entries = {e.fqn: e for e in meta.entries}
    assert entries["step"].dtype is None and entries["w"].dtype == "float32"
    assert [i.fqn for i in meta.items() if i.is_bytes] == ["step"]


def test_a_class_switch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match="never pickles"):
        read_dcp_metadata(_make("dcp-class-switch", tmp_path))


def test_an_entry_of_another_class_is_refused_and_its_records_still_scanned(tmp_path: Path) -> None:
    path = _make("dcp-unknown-entry-class", tmp_path)
    with pytest.raises(CorruptCheckpointError, match="ChunkStorageMetadata"):
        read_dcp_metadata(path)
    meta = read_dcp_metadata(path, strict=False)
    assert meta.problems and "step" in meta.unclassified
    assert [i.fqn for i in meta.items() if i.is_bytes] == ["step"]


def test_the_twice_built_entry_is_caught_by_checking_every_record(tmp_path: Path) -> None:
    """The last BUILD shows a tensor, so the class says "tensor": only checking every record with the same rules
    catches it (torch loads it as a non-tensor entry)."""
    path = _make("dcp-class-switch-twice-built", tmp_path)
    meta = read_dcp_metadata(path)
    assert {e.fqn: e.dtype for e in meta.entries}["step"] == "float32"
    with open(path / ".metadata", "rb") as f:
        real = pickle.load(f)  # the fixture's own metadata: what torch sees
    assert type(real.state_dict_metadata["step"]).__name__ == "BytesStorageMetadata"
    with pytest.raises(UnsafeCheckpointError, match=r"os\.system"):
        check_dcp_safe(meta, trust=False)


def test_a_dcp_folder_written_by_torch_still_converts_without_trust(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(4.0), "step": 3, "cfg": {"lr": 0.5}}
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    meta = read_dcp_metadata(tmp_path / "ok")
    check_dcp_safe(meta, trust=False)
    convert(tmp_path / "ok", tmp_path / "ok.pt")
    got = torch.load(tmp_path / "ok.pt", weights_only=True)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3 and got["cfg"] == {"lr": 0.5}


@pytest.mark.parametrize("proto", [0, 1, 2, 4])
def test_entry_class_in_every_protocol(proto: int) -> None:
    """DCP's entry classes are read the same whichever protocol pickled them (``copyreg._reconstructor`` in
    protocols 0 and 1, NEWOBJ from 2); another class or a plain value is no DCP entry."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, TensorProperties
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as TSM

    from ckptool.formats.dcp import BYTES_METADATA, TENSOR_METADATA, entry_class, entry_kind
    from ckptool.formats.unpickler import load_structure

    t = TSM(TensorProperties(dtype=torch.float32), torch.Size([2]), [])
    nodes, _ = load_structure(pickle.dumps([t, BytesStorageMetadata(), ChunkStorageMetadata(torch.Size([0]),
                                                                                            torch.Size([1])), 3],
                                           protocol=proto))
    assert [entry_class(n) for n in nodes[:2]] == [TENSOR_METADATA, BYTES_METADATA]
    assert [entry_kind("t", nodes[0]), entry_kind("b", nodes[1])] == ["tensor", "bytes"]
    for n in nodes[2:]:
        with pytest.raises(CorruptCheckpointError, match="neither"):
            entry_kind("x", n)


def test_odd_entry_shapes_are_refused() -> None:
    """A tensor entry without its size, one with no state, a plain value: refused (scan treats their records as a
    non-tensor entry's); a bytes entry carrying a tensor's attributes is still a bytes entry."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as TSM

    from ckptool.formats.dcp import entry_kind
    from ckptool.formats.unpickler import load_structure

    no_size = TSM(TensorProperties(dtype=torch.float32), torch.Size([2]), [])
    del no_size.size
    bare = TSM.__new__(TSM)
    both = BytesStorageMetadata()
    both.size, both.properties, both.chunks = torch.Size([2]), TensorProperties(), []
    nodes, _ = load_structure(pickle.dumps([no_size, bare, {"size": [2]}, both], protocol=2))
    for n in nodes[:3]:
        with pytest.raises(CorruptCheckpointError):
            entry_kind("x", n)
    assert entry_kind("x", nodes[3]) == "bytes"


# ------------------------------------------------------------------------------------------------ .pt2
def test_the_opaque_obj_payload_runs_in_torch_export_load(tmp_path: Path, marker: Path) -> None:
    path = _make("pt2-opaque-obj-constant", tmp_path)
    _run_loader("pt2-opaque-obj-constant", path, marker)
    assert marker.exists()


def test_scan_flags_an_opaque_obj_constant(tmp_path: Path) -> None:
    res = scan_file(_make("pt2-opaque-obj-constant", tmp_path))
    assert res.verdict == "dangerous" and "os.system" in {g.name for g in res.unsafe}


def test_an_opaque_obj_constant_is_an_object_never_read(tmp_path: Path, marker: Path, run_cli) -> None:
    path = _make("pt2-opaque-obj-constant", tmp_path)
    arch = read_pt2(str(path), zip_entries(str(path)))
    const = next(p for p in arch.programs[0].constants if p.member.endswith("opaque_obj_0"))
    assert const.kind == "object" and const.pickled and const.dtype is None
    for args in (["inspect", path], ["convert", path, "-o", tmp_path / "w.safetensors"],
                 ["convert", path, "--key", "constants", "-o", tmp_path / "c.safetensors"]):
        run_cli(*args)
        assert not marker.exists()
    assert not (tmp_path / "c.safetensors").exists()  # the only constant is the object: nothing to convert


def _retarget(src: Path, dst: Path, path_name: str, payload: bytes | None = None, *,
              unnamed: str | None = None) -> Path:
    """``src`` with its first constant's member renamed to ``path_name`` (and the config with it); with
    ``unnamed``, also a member of that name that no config names."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        top = zin.namelist()[0].split("/", 1)[0] + "/"
        cfg_name = top + "data/constants/model_constants_config.json"
        cfg = json.loads(zin.read(cfg_name))
        meta = next(iter(cfg["config"].values()))
        old = top + "data/constants/" + meta["path_name"]
        meta["path_name"] = path_name
        for n in zin.namelist():
            if n == cfg_name:
                zout.writestr(n, json.dumps(cfg))
            elif n == old:
                zout.writestr(top + "data/constants/" + path_name, payload if payload is not None else zin.read(n))
            else:
                zout.writestr(n, zin.read(n))
        if unnamed:
            zout.writestr(top + unnamed, adversarial.marker_pickle(0))
    return dst


def test_member_roles_name_every_object_member_a_pickle(tmp_path: Path) -> None:
    path = _make("pt2-opaque-obj-constant", tmp_path)
    extra = _retarget(path, tmp_path / "x.pt2", "opaque_obj_0", adversarial.marker_pickle(0),
                      unnamed="DATA/CONSTANTS/OPAQUE_OBJ_7")
    with open(extra, "rb") as f:
        pickled, raw = member_roles(f, extra.stat().st_size, zip_entries(str(extra)), str(extra))
    names = {n.split("/", 1)[1] for n in pickled}
    assert {"data/constants/opaque_obj_0", "DATA/CONSTANTS/OPAQUE_OBJ_7"} <= names
    assert not any("opaque_obj" in n.lower() for n in raw)
    res = scan_file(extra)
    assert res.verdict == "dangerous"
    assert any("OPAQUE_OBJ_7" in w for g in res.unsafe for w in g.where)


def test_a_config_with_a_bad_crc_is_still_read(tmp_path: Path, marker: Path) -> None:
    """torch's zip reader ignores a member's CRC-32: a constants config with a wrong one still makes
    ``torch.export.load`` unpickle the ``use_pickle`` constant it names, so scan must read that config too."""
    name = "pt2-pickled-constant-config-bad-crc"
    path = _make(name, tmp_path)
    _run_loader(name, path, marker)
    assert marker.exists()  # the payload is live
    res = scan_file(path)
    assert res.verdict == "dangerous" and "os.system" in {g.name for g in res.unsafe}, res.notes


def test_constant_roles_follow_torch() -> None:
    from ckptool.formats.pt2 import constant_role

    assert constant_role("tensor_0", False) == "raw" and constant_role("tensor_0", True) == "pickled"
    assert constant_role("opaque_obj_3", False) == "object" and constant_role("custom_obj_0", False) == "object"
    assert constant_role("weight_0", False) is None


def test_a_constant_of_another_name_is_refused_as_torch_refuses_it(tmp_path: Path) -> None:
    path = _make("pt2-opaque-obj-constant", tmp_path)
    other = _retarget(path, tmp_path / "o.pt2", "blob_0", adversarial.marker_pickle(0))
    with pytest.raises(CorruptCheckpointError, match="blob_0"):
        read_pt2(str(other), zip_entries(str(other)))
    code = f"import torch\ntorch.export.load({str(other)!r})\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode != 0 and "Unsupported constant type" in r.stderr


def test_every_case_is_refused_or_flagged_through_the_cli(tmp_path: Path, marker: Path, run_cli) -> None:
    """scan's exit status for each payload case is 1 (dangerous) and no command runs the payload."""
    for name, case in CASES.items():
        if case.verdict != "dangerous":
            continue
        path = _make(name, tmp_path)
        r = run_cli("scan", path)
        assert r.exit_code == 1, (name, r.output)
        for args in (["inspect", path], ["convert", path, "-o", tmp_path / f"{name}.pt"]):
            run_cli(*args, catch_exceptions=True)
        assert not marker.exists(), name
