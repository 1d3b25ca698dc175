"""One classifier of folders (issue 46): :data:`ckptool.formats.folders.FOLDER_ACCEPTS`, an ordered list of "is
this mine?" answers from a folder's listing, asked by the readers (:func:`ckptool.readers.format_of`) and by the
scan engine's dispatch (:func:`ckptool.scanning.entry.scans_as_one`: a folder written as a
torch.distributed.checkpoint is scanned as one unit) alike. Built on the committed fixtures (no torch needed)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from ckptool.errors import UsageError
from ckptool.formats import deepspeed, folders, megatron
from ckptool.formats.safetensors import read_header
from ckptool.readers import FORMATS, format_of
from ckptool.scanning.entry import scan_file, scans_as_one

pytestmark = pytest.mark.torchfree

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DIST = FIXTURES / "megatron-ckpts" / "dist-gpt"
LEGACY = FIXTURES / "megatron-ckpts" / "legacy-gpt"
ZERO = FIXTURES / "deepspeed-zero" / "zero2-1rank"
MODEL = FIXTURES / "lora" / "gpt2-tiny"
ADAPTER = FIXTURES / "lora" / "gpt2-tiny-lora"


def _dcp(tmp: Path) -> Path:
    """A plain torch.distributed.checkpoint folder: Megatron's torch_dist fixture without its ``metadata.json``."""
    out = tmp / "dcp"
    shutil.copytree(DIST, out, ignore=shutil.ignore_patterns("metadata.json", "common.pt"))
    return out


def _set(tmp: Path) -> Path:
    """A model folder holding a sharded set of one safetensors shard (named like a torch shard: the bytes decide)."""
    out = tmp / "set"
    out.mkdir()
    shard = "pytorch_model-00001-of-00001.bin"
    shutil.copy(MODEL / "model.safetensors", out / shard)
    names = list(read_header(str(out / shard)).entries)
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(
        names, shard)}))
    return out


def _megatron_top(tmp: Path) -> Path:
    """A Megatron top folder whose latest file names a torch_dist iteration folder."""
    top = tmp / "top"
    shutil.copytree(DIST, top / "iter_0000005")
    (top / megatron.LATEST_FILE).write_text("5\n")
    return top


#: folder -> (first answer of FOLDER_ACCEPTS, readers' format, the path read relative to the folder, scanned as one)
CASES = {
    "megatron-dist": (lambda t: DIST, "megatron-dist", "megatron-dist", ".", True),
    "megatron-top": (_megatron_top, "megatron-dist", "megatron-dist", "iter_0000005", False),
    "megatron-legacy": (lambda t: LEGACY, "megatron-legacy", "megatron-legacy", "iter_0000010", False),
    "deepspeed": (lambda t: ZERO, "deepspeed", "deepspeed", ".", False),
    "dcp": (_dcp, "dcp", "dcp", ".", True),
    "sharded-set": (_set, folders.SHARDED_SET, "sharded-safetensors", "pytorch_model.bin.index.json", False),
    "model-folder": (lambda t: MODEL, folders.WEIGHTS_FILE, "safetensors", "model.safetensors", False),
    "peft-adapter": (lambda t: ADAPTER, folders.PEFT_ADAPTER, "safetensors", "adapter_model.safetensors", False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_readers_and_scan_ask_the_one_list(case: str, tmp_path: Path) -> None:
    make, answer, fmt, target, one_unit = CASES[case]
    folder = str(make(tmp_path))
    got, read = folders.classify(folder)
    assert got == answer
    assert os.path.normpath(read) == os.path.normpath(os.path.join(folder, target))
    assert format_of(folder) == (fmt, read)
    assert scans_as_one(folder) is one_unit
    assert fmt in FORMATS


def test_every_answer_is_a_registry_format_or_named_by_bytes() -> None:
    names = [name for name, _accept in folders.FOLDER_ACCEPTS]
    assert len(set(names)) == len(names)
    assert all(n in FORMATS or n == folders.SHARDED_SET or n in folders.ONE_FILE for n in names)
    assert set(names) >= folders.DCP_WRITTEN


def test_dropping_an_entry_changes_readers_and_scan_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both commands' dispatch follow the list: without its DCP entry a DCP folder is neither read nor scanned as
    one; with DCP asked before Megatron, the torch_dist folder is a DCP folder to both."""
    plain = str(_dcp(tmp_path))
    accepts = folders.FOLDER_ACCEPTS
    monkeypatch.setattr(folders, "FOLDER_ACCEPTS", tuple(e for e in accepts if e[0] != folders.DCP))
    with pytest.raises(UsageError, match=r"neither a torch\.distributed\.checkpoint folder"):
        format_of(plain)
    assert not scans_as_one(plain)
    dcp_first = tuple(e for e in accepts if e[0] == folders.DCP) + tuple(e for e in accepts if e[0] != folders.DCP)
    monkeypatch.setattr(folders, "FOLDER_ACCEPTS", dcp_first)
    assert format_of(str(DIST)) == ("dcp", str(DIST))
    assert scans_as_one(str(DIST)) and scan_file(str(DIST)).format == "dcp"


def test_a_model_folder_is_classified_from_its_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder holding none of the names Megatron, DeepSpeed and DCP look for is never searched further (their
    probes list and open files): one listing decides."""
    def probe(*_a: object) -> None:
        raise AssertionError("probed a folder its listing rules out")

    monkeypatch.setattr(megatron, "megatron_layout", probe)
    monkeypatch.setattr(deepspeed, "is_deepspeed_folder", probe)
    scans: list[str] = []
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p: (scans.append(os.fspath(p)), real(p))[1])
    assert folders.classify(str(MODEL)) == (folders.WEIGHTS_FILE, str(MODEL / "model.safetensors"))
    assert scans == [str(MODEL)]


def test_several_indexes_are_refused(tmp_path: Path) -> None:
    folder = _set(tmp_path)
    (folder / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(UsageError, match="several sharded indexes"):
        folders.classify(str(folder))
    assert not scans_as_one(str(folder))


def test_a_folder_no_format_accepts_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UsageError, match="is a folder but neither"):
        format_of(tmp_path)


def test_a_folder_holding_one_checkpoint_file_is_that_file(tmp_path: Path) -> None:
    """A folder none of the folder formats accepts, holding exactly one checkpoint file, in it or below it
    (``outputs/last.ckpt``), is read as that file, the file ``scan`` of the folder reads (issue 46: inspect refused
    it while scan read it); two such files are refused with their names, and other files do not count."""
    top = tmp_path / "outputs"
    (top / "run" / "weights").mkdir(parents=True)
    (top / "notes.txt").write_text("lr 0.1\n")
    ckpt = top / "run" / "weights" / "last.ckpt"
    ckpt.write_bytes(pickle.dumps({"step": 3}, protocol=2))
    assert folders.classify(str(top)) == (folders.ONE_CHECKPOINT, str(ckpt))
    assert format_of(str(top)) == ("pickle", str(ckpt))
    (top / "second.pt").write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(UsageError, match=r"several checkpoint files \(second\.pt, run/weights/last\.ckpt\)"):
        folders.classify(str(top))
