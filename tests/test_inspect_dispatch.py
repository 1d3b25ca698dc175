"""``inspect`` recognises the format once (:func:`ckptool.readers.open_checkpoint`) and dispatches on it
(:data:`ckptool.ops.inspect.DESCRIBERS`): one describer per registry format, a pickle read once through
:meth:`ckptool.readers.Opened.graph`."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from ckptool import readers
from ckptool.formats import torchfile
from ckptool.ops.inspect import DESCRIBERS, inspect
from ckptool.readers import open_checkpoint

pytestmark = pytest.mark.torchfree


def test_a_describer_for_every_registry_format() -> None:
    assert set(DESCRIBERS) == set(readers.FORMATS)


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
