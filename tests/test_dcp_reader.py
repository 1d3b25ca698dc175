"""The DCP tensor reader (:mod:`ckptool.readers.read_dcp`): every tensor of a ``torch.distributed.checkpoint``
folder as byte ranges of its ``.distcp`` files, read without torch, checked against what torch itself loads; and
``ckptool diff`` of DCP folders, which compares their values through it.

The folders are written by ``torch.distributed.checkpoint.save`` in one process (``no_dist=True``), or, for a
tensor saved in several chunks (one per rank), laid out here with DCP's own classes and ``torch.save`` records, as
``FileSystemWriter`` lays them out, and checked to load with ``torch.distributed.checkpoint.load`` first.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ckptool
from ckptool.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptool.formats.segments import read_segments
from ckptool.formats.tensors import Tensor
from ckptool.readers import open_checkpoint
from ckptool.readers.read_dcp import NON_TENSOR, dcp_source

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
import adversarial_dcpread
from dcp_craft import craft


def _save(state: dict[str, Any], folder: Path) -> Path:
    """``dcp.save`` in this one process (no process group: DCP warns and saves as rank 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


def _load(folder: Path, like: dict[str, Any]) -> dict[str, Any]:
    """What torch's own reader loads from ``folder`` into tensors shaped as ``like`` (zeros)."""
    state = {k: torch.zeros_like(v) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


def _read(t: Tensor) -> Any:
    """The values of ``t`` read from the bytes its storage names (the view it declares), as a torch tensor."""
    st = t.storage
    if st.segments is not None:
        data = read_segments(st.segments, _range)
    else:
        data = bytearray(_range(st.path, st.offset, st.nbytes))
    dtype = getattr(torch, t.dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8).view(dtype) if data else torch.empty(0, dtype=dtype)
    return flat.as_strided(t.shape, t.stride, t.offset)


def _range(path: str, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {"fc.weight": torch.randn(5, 4), "fc.bias": torch.randn(5),
                  "t": torch.randn(3, 6).t(),  # saved as the transposed view it is
                  "half": torch.randn(2, 3).to(torch.bfloat16), "count": torch.tensor(7),
                  "empty": torch.zeros(0, 3)},
        "step": 5,
    }


def test_every_tensor_reads_as_torch_loads_it(tmp_path: Path) -> None:
    state = _state()
    folder = _save(state, tmp_path / "ck")
    src = dcp_source(folder, "")
    assert src.format == "dcp" and src.skipped == [f"step: {NON_TENSOR}"]
    names = {f"model.{k}": v for k, v in state["model"].items()}
    assert [t.name for t in src.tensors] == list(names)
    loaded = _load(folder, names)
    for t in src.tensors:
        got = _read(t)
        assert got.dtype == names[t.name].dtype and torch.equal(got, loaded[t.name]), t.name
        assert torch.equal(got, names[t.name]), t.name
    assert next(t for t in src.tensors if t.name == "model.t").stride == (1, 6)


def test_state_dict_chosen_as_convert_chooses_it(tmp_path: Path) -> None:
    folder = _save(_state(), tmp_path / "ck")
    opened = open_checkpoint(folder)
    assert opened.format == "dcp" and opened.spec.tensors
    src = opened.state_dict()
    assert src.key == "model" and src.tensors[0].name == "fc.weight" and src.tensors[0].src_name == "model.fc.weight"
    assert src.left_out == [f"step: {NON_TENSOR}"]
    assert [t.name for t in opened.state_dict("model").tensors] == [t.name for t in src.tensors]
    with pytest.raises(ckptool.errors.UsageError, match="no entry 'nothing'"):
        opened.state_dict("nothing")


def _row_sharded(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    torch.manual_seed(1)
    whole = {"w": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int32), "x": torch.randn(2, 3, 4)}
    folder = craft(tmp_path / "rows", {
        "w": (whole["w"], [((2, 0), (3, 3), 1), ((0, 0), (2, 3), 0)]),  # listed out of order, in two files
        "b": (whole["b"], [((0,), (4,), 0), ((4,), (3,), 1)]),
        "x": (whole["x"], [((0, 0, 0), (1, 3, 4), 0), ((1, 0, 0), (1, 1, 4), 1), ((1, 1, 0), (1, 2, 4), 1)]),
    })
    return folder, whole


def test_row_chunks_are_gathered(tmp_path: Path) -> None:
    folder, whole = _row_sharded(tmp_path)
    loaded = _load(folder, whole)  # torch's own reader agrees the folder holds these tensors
    assert all(torch.equal(loaded[k], v) for k, v in whole.items())
    src = dcp_source(folder)
    assert [t.name for t in src.tensors] == ["w", "b", "x"]
    for t in src.tensors:
        assert t.storage.segments is not None and len(t.storage.segments) >= 2
        assert torch.equal(_read(t), whole[t.name]), t.name
    assert {s.path for s in src.tensors[0].storage.segments or []} == {str(folder / "__0_0.distcp"),
                                                                       str(folder / "__1_0.distcp")}


def test_column_and_block_chunks_are_gathered_row_by_row(tmp_path: Path) -> None:
    """Chunks that split a later dimension (Megatron's row-parallel weights; 2x2 blocks; a 3-D tensor split along
    its last dimension) are gathered as one run per row, in row-major order, as torch's own reader puts them."""
    torch.manual_seed(2)
    whole = {"w": torch.randn(4, 6), "blk": torch.randn(4, 4), "z": torch.arange(24, dtype=torch.int16).view(2, 3, 4)}
    folder = craft(tmp_path / "cols", {
        "w": (whole["w"], [((0, 3), (4, 3), 1), ((0, 0), (4, 3), 0)]),
        "blk": (whole["blk"], [((0, 0), (2, 2), 0), ((0, 2), (2, 2), 1), ((2, 0), (2, 2), 0), ((2, 2), (2, 2), 1)]),
        "z": (whole["z"], [((0, 0, 0), (2, 3, 1), 0), ((0, 0, 1), (2, 3, 3), 1)]),
    })
    loaded = _load(folder, whole)
    assert all(torch.equal(loaded[k], v) for k, v in whole.items())
    src = dcp_source(folder)
    segs = {t.name: len(t.storage.segments or []) for t in src.tensors}
    assert segs == {"w": 8, "blk": 8, "z": 12}
    for t in src.tensors:
        assert torch.equal(_read(t), whole[t.name]), t.name


def _big_endian(record: bytes) -> bytes:
    """The ``torch.save`` zip ``record`` of float32 tensors as a big-endian machine writes it: ``byteorder`` says
    ``big`` and each element of each storage has its bytes reversed (stored members, as torch writes them)."""
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(record))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename:
                data = bytes(b for i in range(0, len(data), 4) for b in reversed(data[i:i + 4]))  # float32
            z.writestr(info.filename, data)
    return out.getvalue()


def test_a_big_endian_record_reads_as_torch_loads_it(tmp_path: Path) -> None:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    buf = io.BytesIO()
    torch.save(w.clone(), buf)
    folder = craft(tmp_path / "big", {"w": (w, [((0, 0), (3, 4), 0)])},
                    records={("w", (0, 0)): _big_endian(buf.getvalue())})
    assert torch.equal(_load(folder, {"w": w})["w"], w)  # torch swaps the bytes back
    (t,) = dcp_source(folder).tensors
    assert t.storage.segments is not None and t.storage.segments[0].swap == 4
    assert torch.equal(_read(t), w)
    torch.save({"w": w}, tmp_path / "w.pt")
    assert ckptool.diff(folder, tmp_path / "w.pt").values_equal == 1


def test_chunks_with_a_gap_are_refused(tmp_path: Path) -> None:
    w = torch.randn(4, 3)
    folder = craft(tmp_path / "gap", {"w": (w, [((0, 0), (1, 3), 0), ((2, 0), (2, 3), 1)])})
    with pytest.raises(CorruptCheckpointError, match="do not cover it once"):
        dcp_source(folder)


def _gadget(marker: Path) -> bytes:
    """A protocol-2 pickle that runs ``touch marker`` through ``os.system`` when an unrestricted unpickler loads
    it."""
    cmd = f"touch {marker}".encode()
    return b"\x80\x02cposix\nsystem\nq\x00X" + len(cmd).to_bytes(4, "little") + cmd + b"\x85R."


def test_a_tensor_record_naming_other_globals_is_refused_unrun(tmp_path: Path) -> None:
    import zipfile

    marker = tmp_path / "marker"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", _gadget(marker))
        z.writestr("archive/byteorder", "little")
    folder = craft(tmp_path / "evil", {"w": (torch.ones(2), [((0,), (2,), 0)])},
                    records={("w", (0,)): buf.getvalue()})
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system"):
        dcp_source(folder)
    assert not marker.exists()
    with zipfile.ZipFile(buf) as z:  # the payload is live: an unrestricted unpickler runs it
        pickle.loads(z.read("archive/data.pkl"))
    assert marker.exists()


def test_non_tensor_entries_are_never_unpickled(tmp_path: Path) -> None:
    folder = _save({"w": torch.ones(3), "extra": 5}, tmp_path / "ck")
    marker = tmp_path / "marker"
    meta = pickle.loads((folder / ".metadata").read_bytes())
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "extra")
    data = bytearray((folder / info.relative_path).read_bytes())
    payload = _gadget(marker)
    assert len(payload) <= info.length
    data[info.offset:info.offset + len(payload)] = payload  # torch.load(weights_only=False) would run it
    (folder / info.relative_path).write_bytes(bytes(data))
    src = dcp_source(folder, "")
    assert [t.name for t in src.tensors] == ["w"] and src.skipped == [f"extra: {NON_TENSOR}"]
    assert ckptool.diff(folder, folder).identical
    assert not marker.exists()
    pickle.loads(bytes(data[info.offset:info.offset + len(payload)]))
    assert marker.exists()


@pytest.mark.parametrize("make", ["make_tensor_record_zip_gadget", "make_tensor_record_bare_gadget"])
def test_diff_refuses_a_tensor_record_holding_a_payload(tmp_path: Path, run_cli: Any, make: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    folder = getattr(adversarial_dcpread, make)(tmp_path)
    marker = tmp_path / "marker"
    monkeypatch.setenv("CKPTOOL_MARKER", str(marker))
    r = run_cli("diff", folder, folder)
    assert r.exit_code in (1, 2) and r.output.startswith("Error: ") and r.output.count("\n") == 1, r.output
    assert "the record of 'w'" in r.output and not marker.exists()


def test_metadata_naming_another_global_is_refused(tmp_path: Path) -> None:
    folder = _save({"w": torch.ones(3)}, tmp_path / "ck")
    meta = pickle.loads((folder / ".metadata").read_bytes())
    meta.planner_data = {"w": ("w",), "odd": eval}
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.eval"):
        dcp_source(folder)


# ------------------------------------------------------------------------------------------------ diff
def test_diff_of_dcp_folders_compares_every_value(tmp_path: Path) -> None:
    state = _state()
    a = _save(state, tmp_path / "a")
    b = _save(state, tmp_path / "b")
    res = ckptool.diff(a, b)
    n = len(state["model"])
    assert res.identical and res.compared == n and res.values_equal == n and res.not_compared == 0
    changed = {**state, "model": dict(state["model"])}
    w = changed["model"]["fc.weight"].clone()
    w[2, 1] += 1
    changed["model"]["fc.weight"] = w
    c = _save(changed, tmp_path / "c")
    res = ckptool.diff(a, c)
    assert not res.identical and [(t.key, t.values, t.mismatched) for t in res.tensors] == [
        ("model.fc.weight", "differ", 1)]
    assert res.values_equal == n - 1


def test_diff_of_dcp_against_its_conversion_is_identical(tmp_path: Path, run_cli: Any) -> None:
    a = _save(_state(), tmp_path / "a")
    out = tmp_path / "a.safetensors"
    assert run_cli("convert", a, "-o", out).exit_code == 0
    res = ckptool.diff(a, out)
    assert res.identical and res.key_a == "model" and res.values_equal == res.compared == 6, res.to_dict()
    r = run_cli("diff", a, out)
    assert r.exit_code == 0 and "identical" in r.output


def test_diff_of_gathered_chunks_against_a_torch_file(tmp_path: Path) -> None:
    folder, whole = _row_sharded(tmp_path)
    torch.save(whole, tmp_path / "whole.pt")
    res = ckptool.diff(folder, tmp_path / "whole.pt")
    assert res.identical and res.values_equal == 3
    os.remove(folder / "__1_0.distcp")
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp, which cannot be read"):
        ckptool.diff(folder, tmp_path / "whole.pt")
