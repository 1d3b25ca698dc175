"""The rewriting commands read through the readers layer (issue 35): the registry facts they branch on, the
``Opened`` readers they use, and the result types of the public surgery functions."""

from __future__ import annotations

import json
import typing
import zipfile
from pathlib import Path
from typing import Any

import pytest

from ckptool.errors import UnsupportedError
from ckptool.formats.sharded import files_named
from ckptool.formats.torchfile import read_checkpoint
from ckptool.ops.surgery.average import AverageResult, average
from ckptool.ops.surgery.edit import filter_keys, rename
from ckptool.ops.surgery.plan import FilterResult, RuleResult
from ckptool.readers import FORMATS, Opened, open_checkpoint
from ckptool.readers.read_torch import locate_records

REPO = Path(__file__).resolve().parents[1]
DEEPSPEED = REPO / "fixtures" / "deepspeed-zero" / "zero2-1rank"


@pytest.fixture
def torch_file(tmp_path: Path) -> Path:
    torch = pytest.importorskip("torch")
    p = tmp_path / "model.pt"
    torch.save({"module.fc.weight": torch.arange(6.0).reshape(2, 3), "module.fc.bias": torch.zeros(2)}, p)
    return p


def test_the_format_facts_the_rewrites_branch_on() -> None:
    """A header-listed format (renamed in its header, data block copied) is safetensors alone; the one that must
    be consolidated before a rewrite are DeepSpeed's and Megatron's."""
    assert [f.name for f in FORMATS.values() if f.header] == ["safetensors"]
    assert [f.name for f in FORMATS.values() if f.consolidate] == ["deepspeed", "megatron-legacy", "megatron-dist"]


@pytest.mark.parametrize("command", [["remap", "--to", "cpu"], ["strip-dataparallel"]])
def test_a_deepspeed_folder_is_refused_by_the_rewrites(command: list[str], tmp_path: Path, run_cli: Any) -> None:
    r = run_cli(command[0], DEEPSPEED, *command[1:], "-o", tmp_path / "out")
    assert r.exit_code == 2
    assert "DeepSpeed ZeRO checkpoint folder, which this command does not rewrite: consolidate it first" in r.output
    assert not (tmp_path / "out").exists()


def test_opened_pickle_member_reads_the_bytes_of_one_member(torch_file: Path) -> None:
    opened = open_checkpoint(torch_file)
    entry = next(e for e in opened.zip_entries() if e.name.endswith("/data.pkl"))
    data = opened.pickle_member(entry)
    with zipfile.ZipFile(torch_file) as z:
        assert bytes(data) == z.read(entry.name)
    with open(torch_file, "rb") as f:
        assert opened.pickle_member(entry, f) == data
    with pytest.raises(UnsupportedError, match="not one zip file"):
        Opened(str(torch_file), "sharded-bin", str(torch_file)).pickle_member(entry)


def test_locate_records_finds_the_bytes_a_rewrite_copies(torch_file: Path) -> None:
    ck = read_checkpoint(str(torch_file), open_checkpoint(torch_file).format)
    with open(torch_file, "rb") as f:
        locate_records(ck, f)
        with zipfile.ZipFile(torch_file) as z:
            for rec in ck.records:
                f.seek(rec.offset)
                assert f.read(rec.size) == z.read(rec.zipinfo.name if rec.zipinfo else rec.name)


def test_files_named_by_an_index_in_the_output_folder(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                "b": "sub/model-00002-of-00002.safetensors"}}))
    assert files_named(str(index)) == {"model-00001-of-00002.safetensors"}
    index.write_text("{not json")
    assert files_named(str(index)) == set()


@pytest.mark.parametrize(("fn", "result"), [(rename, RuleResult), (filter_keys, FilterResult),
                                            (average, AverageResult)])
def test_public_surgery_results_are_typed(fn: Any, result: type) -> None:
    """For a path the result is its dataclass, for loaded state_dicts a mapping: never ``Any``."""
    overloads = typing.get_overloads(fn)
    assert len(overloads) == 2
    returns = [typing.get_type_hints(o)["return"] for o in overloads]
    assert all(r is not Any for r in returns)
    assert result in returns
    assert typing.get_type_hints(fn)["return"] is not Any


def test_rename_and_filter_of_a_file_return_their_results(torch_file: Path, tmp_path: Path) -> None:
    res = rename(torch_file, tmp_path / "r.pt", rules=[r"^module\.="])
    assert isinstance(res, RuleResult) and res.renamed == 2
    kept = filter_keys(torch_file, tmp_path / "f.pt", drop="*.bias")
    assert isinstance(kept, FilterResult) and kept.changes[0].dropped == ["module.fc.bias"]
