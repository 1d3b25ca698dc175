"""Sharded output naming (issue 12, item 6): ``convert -o NAME.safetensors --max-shard-size SIZE`` writes
``NAME-00001-of-0000N.safetensors``... plus ``NAME.safetensors.index.json`` beside it, as ``transformers``
``save_pretrained`` names them; a folder only when the output is one. Sets are written atomically as a whole."""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptool
from ckptool.errors import OutputError, UsageError
from ckptool.formats.sharded import SetLayout, output_layout
from ckptool.ops.convert import convert
from ckptool.ops.convert import outputs as outputs_mod
from ckptool.ops.rewrite import set_writer as set_writer_mod


def _source(tmp_path: Path, tied: bool = True) -> tuple[Path, dict[str, torch.Tensor]]:
    """A state_dict of 5 KiB-ish layers (4 KiB each in float32) plus an embedding, tied to the head when ``tied``."""
    g = torch.Generator().manual_seed(12)
    sd: dict[str, torch.Tensor] = {f"layers.{i}.weight": torch.randn(32, 32, generator=g) for i in range(5)}
    sd["embed.weight"] = torch.randn(40, 32, generator=g)
    if tied:
        sd["lm_head.weight"] = sd["embed.weight"]
    sd["steps"] = torch.arange(7)
    path = tmp_path / "src" / "full.pt"
    path.parent.mkdir()
    torch.save(sd, path)
    return path, sd


def _stored(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if k != "lm_head.weight"}


def _assert_equal(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def _listing(folder: Path) -> dict[str, bytes]:
    """Every entry of ``folder`` (hidden scratch files included) with its bytes."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()} | \
        {p.name + "/": b"" for p in folder.iterdir() if p.is_dir()}


def _load_shard(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    return load_file(path) if fmt == "safetensors" else dict(torch.load(path, weights_only=True))


def _load_via_index(index_path: Path, fmt: str) -> dict[str, torch.Tensor]:
    """What ``transformers`` ``load_sharded_checkpoint`` does: read the index, load every shard it names, merge."""
    index = json.loads(index_path.read_text())
    merged: dict[str, torch.Tensor] = {}
    for shard in dict.fromkeys(index["weight_map"].values()):
        merged.update(_load_shard(index_path.parent / shard, fmt))
    return merged


# ------------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize(("name", "fmt", "stem", "ext", "index"), [
    ("x.safetensors", "safetensors", "x", ".safetensors", "x.safetensors.index.json"),
    ("pytorch_model.bin", "torch", "pytorch_model", ".bin", "pytorch_model.bin.index.json"),
    ("net.pt", "torch", "net", ".pt", "net.pt.index.json"),
    ("net.PTH", "torch", "net", ".PTH", "net.PTH.index.json"),
    ("out", "safetensors", "model", ".safetensors", "model.safetensors.index.json"),
    ("out/", "torch", "pytorch_model", ".bin", "pytorch_model.bin.index.json"),
    ("x.safetensors/", "safetensors", "model", ".safetensors", "model.safetensors.index.json"),
])
def test_output_layout_names(tmp_path: Path, name: str, fmt: str, stem: str, ext: str, index: str) -> None:
    layout = output_layout(str(tmp_path / name) + ("/" if name.endswith("/") else ""), fmt)
    assert (layout.stem, layout.ext, layout.index_name) == (stem, ext, index)
    assert layout.is_output_folder == (stem in ("model", "pytorch_model") and name != "pytorch_model.bin")
    assert layout.shard_names(1) == [stem + ext]
    assert layout.shard_names(3) == [f"{stem}-0000{i}-of-00003{ext}" for i in (1, 2, 3)]


def test_existing_folder_with_a_file_suffix_keeps_the_folder_layout(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").mkdir()  # what earlier versions made of -o x.safetensors --max-shard-size
    layout = output_layout(str(tmp_path / "x.safetensors"), "safetensors")
    assert layout == SetLayout(str(tmp_path / "x.safetensors"), "model", ".safetensors", is_output_folder=True)


def test_set_membership() -> None:
    layout = SetLayout("/d", "x", ".safetensors")
    for name in ("x.safetensors", "x-00002-of-00007.safetensors", "x.safetensors.index.json"):
        assert layout.is_member(name)
    for name in ("y.safetensors", "xx-00001-of-00002.safetensors", "x-1-of-2.safetensors", "x.bin",
                 "model.safetensors.index.json", "x.safetensors.index.json.bak"):
        assert not layout.is_member(name)


def test_bare_suffix_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="names no file"):
        output_layout(str(tmp_path / ".safetensors"), "safetensors")


# ------------------------------------------------------------------------------------------------ N > 1 shards
@pytest.mark.parametrize(("name", "fmt"), [("x.safetensors", "safetensors"), ("pytorch_model.bin", "torch"),
                                           ("net.pt", "torch")])
def test_several_shards_are_named_as_transformers_names_them(tmp_path: Path, name: str, fmt: str) -> None:
    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    res = convert(src, out / name, max_shard_size="10KB")
    stem, ext = os.path.splitext(name)
    n = res.shards
    assert res.format_out == fmt and n >= 3
    shards = [f"{stem}-{i:05d}-of-{n:05d}{ext}" for i in range(1, n + 1)]
    index_path = out / f"{name}.index.json"
    assert sorted(p.name for p in out.iterdir()) == sorted([*shards, index_path.name])  # no folder, no leftovers
    assert res.files == [str(out / s) for s in shards] + [str(index_path)] and res.dst == str(index_path)

    index = json.loads(index_path.read_text())
    assert list(index) == ["metadata", "weight_map"] and list(index["weight_map"]) == sorted(index["weight_map"])
    stored = _stored(sd) if fmt == "safetensors" else sd  # safetensors stores a tied tensor once
    assert set(index["weight_map"]) == set(stored) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in _stored(sd).values())
    per_shard: dict[str, dict[str, torch.Tensor]] = {s: _load_shard(out / s, fmt) for s in shards}
    for tensor_name, shard in index["weight_map"].items():  # every tensor is in the shard the index names
        assert tensor_name in per_shard[shard]
    assert sum(len(p) for p in per_shard.values()) == len(stored)
    _assert_equal(stored, _load_via_index(index_path, fmt))

    back = convert(index_path, tmp_path / "back.pt")  # ckptool reads the set through its index; ties come back
    set_name = "sharded-safetensors" if fmt == "safetensors" else "sharded-bin"  # the registry's names
    assert back.format_in == set_name
    _assert_equal(sd, dict(torch.load(tmp_path / "back.pt", weights_only=True)))
    info = ckptool.inspect(index_path)
    assert info.format == set_name and info.metadata is not None and info.metadata["shards"] == str(n)


def test_cli_writes_the_set_beside_the_name_and_inspect_reads_it(tmp_path: Path, run_cli: Any) -> None:
    src, sd = _source(tmp_path)
    r = run_cli("convert", src, "-o", tmp_path / "x.safetensors", "--max-shard-size", "10KB")
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "x.safetensors").exists()
    index = tmp_path / "x.safetensors.index.json"
    assert re.search(rf"^Wrote {re.escape(str(index))} \(.*shards \+ index\)$", r.output, re.M), r.output
    _assert_equal(_stored(sd), _load_via_index(index, "safetensors"))
    r = run_cli("inspect", index)
    assert r.exit_code == 0 and "sharded-safetensors" in r.output and "layers.4.weight" in r.output
    r = run_cli("convert", index, "-o", tmp_path / "back.safetensors")
    assert r.exit_code == 0, r.output
    _assert_equal(_stored(sd), load_file(tmp_path / "back.safetensors"))


# ------------------------------------------------------------------------------------------------ one shard
@pytest.mark.parametrize(("name", "fmt"), [("x.safetensors", "safetensors"), ("pytorch_model.bin", "torch")])
def test_one_shard_is_a_single_file_without_index(tmp_path: Path, run_cli: Any, name: str, fmt: str) -> None:
    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    r = run_cli("convert", src, "-o", out / name, "--max-shard-size", "1MB")
    assert r.exit_code == 0, r.output
    assert [p.name for p in out.iterdir()] == [name]
    assert "Note: everything fits one shard: wrote the single file " + name + " and no index" in r.output
    _assert_equal(_stored(sd) if fmt == "safetensors" else sd, _load_shard(out / name, fmt))
    res = convert(src, out / name, max_shard_size="1MB")
    assert res.shards == 1 and res.files == [str(out / name)] and res.dst == str(out / name)


def test_folder_output_keeps_the_default_names(tmp_path: Path) -> None:
    src, sd = _source(tmp_path)
    res = convert(src, str(tmp_path / "new") + "/", max_shard_size="10KB", format="torch")
    names = sorted(p.name for p in (tmp_path / "new").iterdir())
    assert names[-1] == "pytorch_model.bin.index.json" and len(names) == res.shards + 1
    assert names[0] == f"pytorch_model-00001-of-{res.shards:05d}.bin"
    _assert_equal(sd, _load_via_index(tmp_path / "new" / names[-1], "torch"))


# ------------------------------------------------------------------------------------------------ replacing sets
def test_rerun_replaces_its_own_earlier_set_and_nothing_else(tmp_path: Path) -> None:
    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    others = {"y.safetensors": b"other", "y-00001-of-00002.safetensors": b"other", "notes.txt": b"keep"}
    for n, data in others.items():
        (out / n).write_bytes(data)
    first = convert(src, out / "x.safetensors", max_shard_size="10KB")
    second = convert(src, out / "x.safetensors", max_shard_size="20KB")
    assert second.shards < first.shards
    gone = sorted({os.path.basename(p) for p in first.files} - {os.path.basename(p) for p in second.files})
    assert "earlier shard set" in second.notes[-1] and gone[0] in second.notes[-1]
    assert sorted(p.name for p in out.iterdir()) == sorted([*others, *(os.path.basename(p) for p in second.files)])
    assert all((out / n).read_bytes() == data for n, data in others.items())
    _assert_equal(_stored(sd), _load_via_index(out / "x.safetensors.index.json", "safetensors"))
    third = convert(src, out / "x.safetensors", max_shard_size="1MB")  # one file now: the index goes too
    assert sorted(p.name for p in out.iterdir()) == sorted([*others, "x.safetensors"]) and third.shards == 1


def test_the_set_never_replaces_an_input(tmp_path: Path) -> None:
    src, _sd = _source(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    convert(src, out / "x.safetensors", max_shard_size="10KB")
    before = _listing(out)
    with pytest.raises(UsageError, match="would replace the input"):
        convert(out / "x.safetensors.index.json", out / "x.safetensors", max_shard_size="20KB")
    with pytest.raises(UsageError, match="would replace the input"):  # a symbolic link to an input counts
        os.symlink(src, out / "z-00001-of-00002.safetensors")
        convert(src, out / "z.safetensors", max_shard_size="10KB")
    os.unlink(out / "z-00001-of-00002.safetensors")
    assert _listing(out) == before
    res = convert(out / "x.safetensors.index.json", out / "y.safetensors", max_shard_size="20KB")  # other name: fine
    assert os.path.basename(res.dst) == "y.safetensors.index.json"


def test_a_directory_in_the_way_is_refused(tmp_path: Path) -> None:
    src, _sd = _source(tmp_path)
    (tmp_path / "x-00001-of-00004.safetensors").mkdir()
    with pytest.raises(UsageError, match="is a directory"):
        convert(src, tmp_path / "x.safetensors", max_shard_size="10KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "x-00001-of-00004.safetensors"]


def test_missing_output_folder_is_refused(tmp_path: Path) -> None:
    src, _sd = _source(tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        convert(src, tmp_path / "nowhere" / "x.safetensors", max_shard_size="10KB")
    assert not (tmp_path / "nowhere").exists()


# ------------------------------------------------------------------------------------------------ failures
def _fail_on_call(monkeypatch: pytest.MonkeyPatch, target: str, n: int) -> None:
    """Make ``<target>`` (of the convert writer, or of the set writer: ``encode_index``) raise OutputError on its
    ``n``-th call."""
    module = set_writer_mod if target == "encode_index" else outputs_mod
    real = getattr(module, target)
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            raise OutputError("injected failure", "somewhere")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, target, wrapper)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_failure_midway_leaves_nothing_of_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    src, _sd = _source(tmp_path)
    _fail_on_call(monkeypatch, "emit", 3)  # the third shard fails
    with pytest.raises(OutputError, match="injected failure"):
        convert(src, tmp_path / ("x.safetensors" if fmt == "safetensors" else "x.bin"), max_shard_size="10KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no shard, no scratch file, no index
    _fail_on_call(monkeypatch, "emit", 1)
    with pytest.raises(OutputError):
        convert(src, tmp_path / "made", max_shard_size="10KB")  # a folder this run made goes too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_failure_writing_the_index_removes_the_renamed_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _sd = _source(tmp_path)
    _fail_on_call(monkeypatch, "encode_index", 1)
    with pytest.raises(OutputError, match="injected failure"):
        convert(src, tmp_path / "x.safetensors", max_shard_size="10KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_failure_keeps_an_earlier_set_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    first = convert(src, out / "x.safetensors", max_shard_size="10KB")
    before = _listing(out)
    other = tmp_path / "other.pt"  # same layout, other values: the new set has the same names, other bytes
    changed = {k: v + 1 for k, v in sd.items()}
    changed["lm_head.weight"] = changed["embed.weight"]
    torch.save(changed, other)
    _fail_on_call(monkeypatch, "emit", first.shards)  # every shard but the last is written, then the last fails
    with pytest.raises(OutputError):
        convert(other, out / "x.safetensors", max_shard_size="10KB")
    assert _listing(out) == before
    _assert_equal(_stored(sd), _load_via_index(out / "x.safetensors.index.json", "safetensors"))
    monkeypatch.undo()
    (tmp_path / "check").mkdir()
    redo = convert(other, tmp_path / "check" / "x.safetensors", max_shard_size="10KB")
    assert [os.path.basename(p) for p in redo.files] == [os.path.basename(p) for p in first.files]


# ------------------------------------------------------------------------------------------------ transformers
def test_transformers_loads_the_set(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    # transformers 5 has it in trainer_utils, 4.x in modeling_utils
    load_sharded_checkpoint = getattr(importlib.import_module("transformers.trainer_utils"),
                                      "load_sharded_checkpoint", None) or \
        importlib.import_module("transformers.modeling_utils").load_sharded_checkpoint
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(6)))
    src = tmp_path / "sd.pt"
    torch.save(model.state_dict(), src)
    for name in ("model.safetensors", "pytorch_model.bin"):
        folder = tmp_path / name.split(".")[1]
        folder.mkdir()
        res = convert(src, folder / name, max_shard_size="10KB")
        assert res.shards > 1
        fresh = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(6)))
        load_sharded_checkpoint(fresh, str(folder), strict=True, prefer_safe=name.endswith(".safetensors"))
        _assert_equal(model.state_dict(), fresh.state_dict())
