"""The large-checkpoint paths of inspect and the rewriters: the zip directory is parsed once per run, the scan does
not walk ``data.pkl`` again, and the per-tensor objects carry no ``__dict__`` (issue 14, memory at 1M tensors)."""

from __future__ import annotations

import pickle

import pytest

import ckptool.formats.detect as detect_mod
import ckptool.scanning.directories as scan_directories_mod
import ckptool.scanning.pickles as scan_pickles_mod
from ckptool.formats.pickler import GraphPickler
from ckptool.formats.torchfile import Record, read_checkpoint
from ckptool.ops.inspect.entry import TensorInfo, inspect


@pytest.fixture
def many(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "many.pt"
    torch.save({f"blocks.{i}.w": torch.full((4,), float(i)) for i in range(300)}, path)
    return str(path)


def test_inspect_reads_the_directory_once_and_data_pkl_once(many, monkeypatch) -> None:
    detect_mod._zip_cache.clear()
    reads, walks = [], []
    real_read, real_check = detect_mod.read_directory, scan_pickles_mod.check_pickle
    monkeypatch.setattr(detect_mod, "read_directory", lambda *a, **k: reads.append(1) or real_read(*a, **k))
    monkeypatch.setattr(scan_directories_mod, "read_directory", lambda *a, **k: reads.append(2) or real_read(*a, **k))
    monkeypatch.setattr(scan_pickles_mod, "check_pickle", lambda *a, **k: walks.append(1) or real_check(*a, **k))
    info = inspect(many)
    assert len(info.tensors) == 300 and info.scan is not None and info.scan.verdict == "safe"
    assert reads == [1]  # detection, the reader and the scan share one parse
    assert walks == []  # the scan took data.pkl's end from the reader
    assert [p.where for p in info.scan.pickles] == ["many/data.pkl"]


def test_reader_gives_where_data_pkl_ends(many) -> None:
    """``Checkpoint.pickle_size``: the offset after STOP (torch.save writes nothing after it); a pickle hidden after
    STOP stays visible to the scan (tests/test_scan_safety.py, zip-data-pkl-trailing-pickle.pt)."""
    ck = read_checkpoint(many)
    rec = ck.record("data.pkl")
    assert rec is not None and ck.pickle_size == rec.size
    with open(many, "rb") as f:
        data = f.read()
    start = data.index(b"\x80\x02", data.index(b"data.pkl"))
    assert data[start + ck.pickle_size - 1:start + ck.pickle_size] == b"."


def test_per_tensor_objects_have_no_dict(many) -> None:
    ck = read_checkpoint(many)
    assert not hasattr(ck.records[0], "__dict__") and isinstance(ck.records[0], Record)
    assert not hasattr(inspect(many).tensors[0], "__dict__") and isinstance(inspect(many).tensors[0], TensorInfo)
    assert len({id(r.location) for r in ck.storages.values()}) == 1  # one string per distinct location tag


def test_pickle_writer_output_is_one_buffer() -> None:
    out = GraphPickler(2).dumps({"a": [1, 2.5, "x"], "b": (None, True)})
    assert type(out) is bytes and pickle.loads(out) == {"a": [1, 2.5, "x"], "b": (None, True)}
