"""``inspect`` recognises the format once (:func:`ckptool.readers.open_checkpoint`) and dispatches on it
(:data:`ckptool.ops.inspect.entry.DESCRIBE`): one describer per registry format, a pickle read once through
:meth:`ckptool.readers.Opened.graph`, a ``.pt2`` archive scanned once."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from test_pt2_torchfree import make_pt2

from ckptool import readers
from ckptool.formats import torchfile
from ckptool.ops.inspect.entry import inspect
from ckptool.readers import open_checkpoint
from ckptool.scanning.shipped_code import CodeScanner

pytestmark = pytest.mark.torchfree


def test_a_describer_for_every_registry_format() -> None:
    from ckptool.ops.inspect.entry import DESCRIBE, inspect_tensors

    assert all(callable(DESCRIBE.get(name, inspect_tensors)) for name in readers.FORMATS)


def _no_second_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("the pickle was read a second time")

    for mod in (readers, torchfile):
        monkeypatch.setattr(mod, "read_checkpoint", fail)
        monkeypatch.setattr(mod, "read_pickle_file", fail)


def _same_as_by_path(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = inspect(path).to_json()
    opened = open_checkpoint(path)
    graph = opened.graph()
    _no_second_read(monkeypatch)
    info = inspect(opened)
    assert info.to_json() == want
    assert opened.graph() is graph


def test_an_opened_plain_pickle_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "args.pkl"
    path.write_bytes(pickle.dumps({"epoch": 3, "lr": 0.1, "names": ["a", "b"]}, protocol=4))
    _same_as_by_path(path, monkeypatch)


def test_an_opened_torch_file_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "sd.pt"
    torch.save({"model": {"w": torch.ones(2, 3), "b": torch.zeros(3)}, "epoch": 4}, path)
    _same_as_by_path(path, monkeypatch)


def test_pt2_archive_is_scanned_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_pt2(tmp_path / "m.pt2")
    scans: list[str] = []
    real = CodeScanner.any

    def counting(self: Any, buf: Any, where: str, *args: Any, **kwargs: Any) -> Any:
        if not where:  # the file itself, not a member inside it
            scans.append(self.res.path)
        return real(self, buf, where, *args, **kwargs)

    monkeypatch.setattr(CodeScanner, "any", counting)
    info = inspect(path)
    assert scans == [str(path)]
    assert info.scan is not None and [g.name for g in info.globals] == [g.name for g in info.scan.globals]
