"""``ckptool rename`` and ``ckptool filter`` on sharded sets (safetensors and ``.bin``) and on
``torch.distributed.checkpoint`` folders (issue 26): the outputs are a set with its index / a new DCP folder, the
rules and globs are checked on the whole set or nesting before a byte is written, and refusals write nothing.

Sets are made with ``ckptool convert --max-shard-size``; DCP folders with ``dcp.save``. Outputs are read with torch
and safetensors themselves (``safetensors.torch.load_file`` / ``torch.load`` per shard, ``dcp_to_torch_save``,
``dcp.load``), never with ckptool.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_craft import dcp_back, save_dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader

import ckptool
from ckptool.errors import KeyCollisionError, PrefixNotFoundError, UsageError


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(26)
    return {"enc.weight": torch.randn(16, 16, generator=g), "enc.bias": torch.randn(16, generator=g),
            "head.weight": torch.randn(16, 16, generator=g), "head.bias": torch.randn(16, generator=g)}


def _make_set(run_cli: Callable[..., Any], tmp_path: Path, fmt: str, shard: str = "1KB") -> Path:
    """``_sd()`` as a set of ``fmt`` shards in ``tmp_path/set``; returns the index path."""
    torch.save(_sd(), tmp_path / "model.pth")
    r = run_cli("convert", tmp_path / "model.pth", "-o", f"{tmp_path / 'set'}/", "--format", fmt,
                "--max-shard-size", shard)
    assert r.exit_code == 0, r.output
    return next((tmp_path / "set").glob("*.index.json"))


def _index(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _load_set(index: Path) -> dict[str, torch.Tensor]:
    """Every shard the index names, read by safetensors' or torch's own loader; the shard files beside it must be
    exactly those."""
    names = sorted(set(_index(index)["weight_map"].values()))
    ext = ".safetensors" if names[0].endswith(".safetensors") else ".bin"
    assert sorted(p.name for p in index.parent.glob(f"*{ext}")) == names
    out: dict[str, torch.Tensor] = {}
    for n in names:
        part = load_file(index.parent / n) if ext == ".safetensors" else torch.load(index.parent / n,
                                                                                    weights_only=True)
        assert set(part) == {k for k, v in _index(index)["weight_map"].items() if v == n}, n
        out.update(part)
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


# ------------------------------------------------------------------------------------------------ sets
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_rename_set_same_layout(run_cli: Callable[..., Any], tmp_path: Path, fmt: str) -> None:
    """rename on a set (its folder): one output shard per input shard under the same names, every shard's keys
    and the index's weight_map renamed by the rule, the index metadata kept, the tensors bit for bit."""
    index = _make_set(run_cli, tmp_path, fmt)
    r = run_cli("rename", tmp_path / "set", "--rule", r"^(enc|head)\.=model.\1.")
    assert r.exit_code == 0, r.output
    out = tmp_path / "set.renamed" / index.name  # the default: a folder beside the set's
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(p.name for p in index.parent.iterdir())
    old, new = _index(index), _index(out)
    assert new["metadata"] == old["metadata"]
    assert new["weight_map"] == {f"model.{k}": v for k, v in old["weight_map"].items()}
    _same(_load_set(out), {f"model.{k}": v for k, v in _sd().items()})
    assert "in 4 shards" in r.output


def test_rename_set_json_and_dry_run(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """--json keeps rename's fields and adds the set's (shards, files); --dry-run lists old -> new and writes
    nothing."""
    index = _make_set(run_cli, tmp_path, "safetensors")
    r = run_cli("rename", index, "--rule", r"^enc\.=encoder.", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "  enc.weight -> encoder.weight" in r.output and "Dry run: nothing was written" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pth", "set"]
    r = run_cli("rename", index, "--rule", r"^enc\.=encoder.", "-o", tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["rules"] == [{"rule": r"^enc\.=encoder.", "matched": 2}] and doc["shards"] == 4
    assert {"path": "", "old": "enc.bias", "new": "encoder.bias"} in doc["renames"]
    assert doc["dst"] == str(tmp_path / "out" / index.name) and len(doc["files"]) == 5


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_filter_set_drops_emptied_shards(run_cli: Callable[..., Any], tmp_path: Path, fmt: str) -> None:
    """filter --drop 'head.*' on a set of one tensor per shard: the two emptied shards are not written, the two
    kept are numbered anew (-00001-of-00002, -00002-of-00002), the index names only the kept tensors with
    total_size their bytes, and they read back bit for bit."""
    index = _make_set(run_cli, tmp_path, fmt)
    r = run_cli("filter", index, "--drop", "head.*", "-o", tmp_path / "out")
    assert r.exit_code == 0, r.output
    out = tmp_path / "out" / index.name
    stem, ext = ("model", ".safetensors") if fmt == "safetensors" else ("pytorch_model", ".bin")
    doc = _index(out)
    assert sorted(set(doc["weight_map"].values())) == [f"{stem}-00001-of-00002{ext}", f"{stem}-00002-of-00002{ext}"]
    kept = {k: v for k, v in _sd().items() if not k.startswith("head.")}
    assert doc["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in kept.values())
    _same(_load_set(out), kept)
    assert "2 shards held only dropped tensors" in r.output


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_filter_set_within_a_shard(run_cli: Callable[..., Any], tmp_path: Path, fmt: str) -> None:
    """Shards of two tensors (weight and bias): --drop '*.bias' keeps both shards, each without its bias, and the
    bias bytes leave the shard files."""
    index = _make_set(run_cli, tmp_path, fmt, shard="2KB")
    assert len(set(_index(index)["weight_map"].values())) == 2
    r = run_cli("filter", index.parent, "--drop", "*.bias", "-o", tmp_path / "out")
    assert r.exit_code == 0, r.output
    out = tmp_path / "out" / index.name
    kept = {k: v for k, v in _sd().items() if k.endswith("weight")}
    _same(_load_set(out), kept)
    assert sorted(set(_index(out)["weight_map"].values())) == sorted(set(_index(index)["weight_map"].values()))
    data = b"".join(p.read_bytes() for p in out.parent.iterdir() if p.suffix != ".json")
    for k, v in _sd().items():
        assert (v.numpy().tobytes() in data) == k.endswith("weight"), k


def test_set_refusals_write_nothing(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """On a set, as on a file: a rule or glob matching no key of the whole set, two keys of different shards
    renamed to one, every key dropped, --key, --in-place: an error, and nothing written."""
    index = _make_set(run_cli, tmp_path, "safetensors")
    with pytest.raises(PrefixNotFoundError, match="matches no key"):
        ckptool.rename(index, tmp_path / "out", rules=[r"^nothing\.="])
    with pytest.raises(KeyCollisionError, match=r"'head\.bias' <- "):
        ckptool.rename(index, tmp_path / "out", rules=[r"^enc\.=head."])
    with pytest.raises(PrefixNotFoundError, match="matches no key"):
        ckptool.filter_keys(index, tmp_path / "out", keep="decoder.*")
    with pytest.raises(UsageError, match="drop every key"):
        ckptool.filter_keys(index, tmp_path / "out", drop="*")
    with pytest.raises(UsageError, match="--key does not apply"):
        ckptool.filter_keys(index, tmp_path / "out", drop="head.*", key="model")
    r = run_cli("filter", index, "--drop", "head.*", "--in-place")
    assert r.exit_code == 2 and "--in-place does not apply" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pth", "set"]


def test_filter_set_allow_unused(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """--allow-unused lets a glob that matches nothing pass; the others still apply."""
    index = _make_set(run_cli, tmp_path, "torch")
    res = ckptool.filter_keys(index, tmp_path / "out", drop=["head.*", "nothing.*"], allow_unused=True)
    assert res.dropped == 2 and res.shards == 2
    _same(_load_set(tmp_path / "out" / index.name), {k: v for k, v in _sd().items() if k.startswith("enc.")})


def test_filter_set_to_one_shard(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """A filter that leaves one shard writes it under the single-file name (model.safetensors), with the index
    still beside it (the output of a set is a set: the same command loads it)."""
    index = _make_set(run_cli, tmp_path, "safetensors")
    ckptool.filter_keys(index, tmp_path / "out", keep="enc.weight")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", index.name]
    _same(_load_set(tmp_path / "out" / index.name), {"enc.weight": _sd()["enc.weight"]})


# ------------------------------------------------------------------------------------------------ DCP
def _state() -> dict[str, Any]:
    optim = {"state": {"0": {"exp_avg": torch.ones(4)}}, "param_groups": [{"lr": 0.1, "params": ["0"]}]}
    return {"model": _sd(), "ema": {k: v * 2 for k, v in _sd().items()}, "optim": optim, "step": 7}


def test_rename_dcp(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """rename on a DCP folder renames the keys of its state_dicts (never optimizer state; --key one of them) as on
    the file dcp_to_torch_save writes of it; the .distcp files are copied byte for byte, dcp.load fills a model
    with the new names."""
    src = save_dcp(_state(), tmp_path / "ckpt")
    r = run_cli("rename", src, "--key", "model", "--rule", r"^enc\.=encoder.")
    assert r.exit_code == 0, r.output
    out = tmp_path / "ckpt.renamed"  # the default: a folder beside the input
    back = dcp_back(out)
    want = {k.replace("enc.", "encoder."): v for k, v in _sd().items()}
    _same(back["model"], want)
    _same(back["ema"], {k: v * 2 for k, v in _sd().items()})
    assert back["step"] == 7 and torch.equal(back["optim"]["state"]["0"]["exp_avg"], torch.ones(4))
    assert {p.name: p.read_bytes() for p in out.glob("*.distcp")} == {
        p.name: p.read_bytes() for p in src.glob("*.distcp")}
    model = {k: torch.zeros_like(v) for k, v in want.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": model}, checkpoint_id=str(out), no_dist=True)
    _same(model, want)


def test_filter_dcp_drops_entries_and_their_bytes(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """filter --drop '*.bias' on a DCP folder: both state_dicts lose their biases (optimizer state and step stay),
    the entries leave .metadata (state_dict_metadata, storage_data, planner_data) and the biases' bytes leave the
    .distcp file; dcp_to_torch_save gives back the rest bit for bit."""
    src = save_dcp(_state(), tmp_path / "ckpt")
    r = run_cli("filter", src, "--drop", "*.bias", "-o", tmp_path / "out")
    assert r.exit_code == 0, r.output
    out = tmp_path / "out"
    back = dcp_back(out)
    _same(back["model"], {k: v for k, v in _sd().items() if k.endswith("weight")})
    _same(back["ema"], {k: v * 2 for k, v in _sd().items() if k.endswith("weight")})
    assert back["step"] == 7 and "optim" in back
    md = FileSystemReader(str(out)).read_metadata()
    assert not [k for k in md.state_dict_metadata if k.endswith(".bias")]
    assert not [i.fqn for i in md.storage_data if i.fqn.endswith(".bias")]
    assert not [k for k in md.planner_data if k.endswith(".bias")]
    data = b"".join(p.read_bytes() for p in out.glob("*.distcp"))
    assert _sd()["head.bias"].numpy().tobytes() not in data
    assert _sd()["head.weight"].numpy().tobytes() in data


def test_filter_dcp_key_extracts_and_leaves_emptied_files(tmp_path: Path) -> None:
    """--key ema --keep 'enc.*' writes that state_dict alone (FQNs enc.weight, as the file command writes the
    state_dict itself); a .distcp file holding none of the kept records is not written."""
    src = save_dcp(_state(), tmp_path / "ckpt", thread_count=2)
    assert len(list(src.glob("*.distcp"))) == 2
    res = ckptool.filter_keys(src, tmp_path / "out", key="ema", keep="enc.*")
    assert res.extracted and res.changes[0].dropped == ["head.weight", "head.bias"]
    _same(dcp_back(tmp_path / "out"), {k: v * 2 for k, v in _sd().items() if k.startswith("enc.")})
    md = FileSystemReader(str(tmp_path / "out")).read_metadata()
    assert sorted(md.state_dict_metadata) == ["enc.bias", "enc.weight"]
    files = {i.relative_path for i in md.storage_data.values()}
    assert sorted(p.name for p in (tmp_path / "out").glob("*.distcp")) == sorted(files)


def test_filter_dcp_and_remap_in_one_pass(tmp_path: Path) -> None:
    """--to cpu with filter, as with rename: a non-tensor entry tagged cuda:0 is re-tagged while the biases are
    dropped (torch reads the output without a GPU); a folder with nothing to re-tag is filtered all the same."""
    extra = (torch.arange(3.0),)
    src = save_dcp({"model": _sd(), "extra": extra}, tmp_path / "ckpt", cuda=extra)
    res = ckptool.filter_keys(src, tmp_path / "out", drop="*.bias", to="cpu")
    assert res.retagged == {("cuda:0", "cpu"): 1}
    back = dcp_back(tmp_path / "out")
    _same(back["model"], {k: v for k, v in _sd().items() if k.endswith("weight")})
    assert torch.equal(back["extra"][0], extra[0])
    ckptool.filter_keys(tmp_path / "out", tmp_path / "again", drop="enc.*", to="cpu")
    _same(dcp_back(tmp_path / "again")["model"], {"head.weight": _sd()["head.weight"]})


def test_dcp_refusals_write_nothing(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """On a DCP folder, as on a file: unused rule or glob, collision, every key dropped, a dry run: nothing
    written (no staging folder left)."""
    src = save_dcp(_state(), tmp_path / "ckpt")
    with pytest.raises(PrefixNotFoundError, match="matches no key"):
        ckptool.rename(src, tmp_path / "out", rules=[r"^nothing\.="])
    with pytest.raises(KeyCollisionError):
        ckptool.rename(src, tmp_path / "out", rules=[r"^enc\.=head."])
    with pytest.raises(PrefixNotFoundError, match="matches no key"):
        ckptool.filter_keys(src, tmp_path / "out", drop="nothing.*")
    with pytest.raises(UsageError, match="drop every key"):
        ckptool.filter_keys(src, tmp_path / "out", drop="*")
    r = run_cli("filter", src, "--drop", "*.bias", "--dry-run")
    assert r.exit_code == 0 and "would drop 2" in r.output, r.output
    r = run_cli("rename", src, "--rule", r"^enc\.=encoder.", "--dry-run", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["dry_run"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
