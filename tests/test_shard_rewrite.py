"""``remap`` and the prefix commands on sharded sets (issue 26): the output is a set of the same layout with its
index, renames planned over the whole set, written atomically as a set (nothing written on a refusal).

Sets are made with ``ckptool convert ... --max-shard-size 1KB`` (one 16x16 float32 tensor per shard); outputs are
checked with torch and safetensors themselves (``torch.load`` of every shard, ``safe_open``), not with ckptool.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import location_tags
from safetensors import safe_open
from safetensors.torch import load_file

import ckptool
from ckptool.errors import CorruptCheckpointError, KeyCollisionError, PrefixNotFoundError, UnsupportedError


def _state_dict(keys: list[str]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(26)
    return {k: torch.randn(16, 16, generator=g) for k in keys}


def _make_set(run_cli: Callable[..., Any], tmp_path: Path, sd: dict[str, torch.Tensor], fmt: str,
              *extra: str) -> Path:
    """Save ``sd`` and convert it to a set of ``fmt`` shards in ``tmp_path/set``; returns the index path."""
    src = tmp_path / "model.pth"
    torch.save(sd, src)
    r = run_cli("convert", src, "-o", f"{tmp_path / 'set'}/", "--format", fmt, "--max-shard-size", "1KB", *extra)
    assert r.exit_code == 0, r.output
    index = next((tmp_path / "set").glob("*.index.json"))
    assert len(set(json.loads(index.read_text())["weight_map"].values())) == len(sd)  # one tensor per shard
    return index


def _index(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def test_remap_torch_set_cuda_to_cpu(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """A torch-shard set tagged cuda:0 is remapped to cpu: same layout, every tag cpu, and the printed hint
    (ckptool.load_into of the folder) gives back every tensor bit-exactly."""
    sd = _state_dict([f"layers.{i}.weight" for i in range(4)])
    index = _make_set(run_cli, tmp_path, sd, "torch", "--to", "cuda:0")
    shards = sorted(p.name for p in index.parent.glob("*.bin"))
    assert {t for s in shards for t in location_tags(index.parent / s)} == {"cuda:0"}
    r = run_cli("remap", index.parent, "--to", "cpu")
    assert r.exit_code == 0, r.output
    out = tmp_path / "set.cpu"  # the default: the folder beside the set's, named as model.cpu.pth is
    assert sorted(p.name for p in out.glob("*.bin")) == shards
    assert _index(out / index.name) == _index(index)  # weight_map and metadata unchanged
    assert {t for s in shards for t in location_tags(out / s)} == {"cpu"}
    hint = next(line for line in r.output.splitlines() if line.startswith("Load it with: "))
    assert hint == f"Load it with: ckptool.load_into(model, {str(out)!r})"  # the loader, not the shard paths
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(4))
    eval(hint.removeprefix("Load it with: "), {"ckptool": ckptool, "model": model})
    got = model.state_dict()
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
        assert got[k].device.type == "cpu" and got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_strip_dataparallel_safetensors_set(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """strip-dataparallel on a safetensors set: no key of any shard nor of the index keeps ``module.``; the index's
    metadata is kept as it was; every tensor reads back unchanged."""
    sd = _state_dict([f"module.layers.{i}.weight" for i in range(3)])
    index = _make_set(run_cli, tmp_path, sd, "safetensors")
    doc = _index(index)
    doc["metadata"]["format"] = "pt"  # an entry ckptool does not write itself: it must survive
    index.write_text(json.dumps(doc))
    r = run_cli("strip-dataparallel", index, "-o", tmp_path / "bare")
    assert r.exit_code == 0, r.output
    out_index = tmp_path / "bare" / index.name
    new = _index(out_index)
    assert new["metadata"] == doc["metadata"]
    assert new["weight_map"] == {k.removeprefix("module."): v for k, v in doc["weight_map"].items()}
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(new["weight_map"].values())):
        with safe_open(str(tmp_path / "bare" / shard), "pt") as f:
            names = set(f.keys())
        assert all(not k.startswith("module.") for k in names)
        assert {k for k, v in new["weight_map"].items() if v == shard} == names
        got.update(load_file(tmp_path / "bare" / shard))
    assert sorted(got) == sorted(k.removeprefix("module.") for k in sd)
    for k, v in sd.items():
        assert torch.equal(got[k.removeprefix("module.")], v), k


def test_prefix_in_one_shard_is_found_across_the_set(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """A prefix carried by the keys of one shard only is stripped there; the other shards are kept as they are
    (a per-shard check would have refused them)."""
    sd = _state_dict(["enc.a.weight", "dec.b.weight"])
    index = _make_set(run_cli, tmp_path, sd, "safetensors")
    res = ckptool.strip_prefix(index, "enc.", tmp_path / "out")
    assert res.renamed == 1
    assert set(_index(tmp_path / "out" / index.name)["weight_map"]) == {"a.weight", "dec.b.weight"}


def test_collision_across_shards_refused(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """``module.fc.weight`` in one shard would become the ``fc.weight`` of another: refused, nothing written."""
    sd = _state_dict(["module.fc.weight", "fc.weight"])
    index = _make_set(run_cli, tmp_path, sd, "torch")
    r = run_cli("strip-dataparallel", index.parent, "-o", tmp_path / "out")
    assert r.exit_code != 0 and r.output.startswith("Error: ") and "fc.weight" in r.output, r.output
    with pytest.raises(KeyCollisionError):
        ckptool.strip_dataparallel(index, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "set.stripped").exists()


def test_prefix_matching_nothing_refused(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """A prefix that no key of any shard carries is an error; nothing is written."""
    sd = _state_dict(["a.weight", "b.weight"])
    index = _make_set(run_cli, tmp_path, sd, "safetensors")
    r = run_cli("strip-prefix", index, "model.", "-o", tmp_path / "out")
    assert r.exit_code != 0 and r.output.startswith("Error: "), r.output
    with pytest.raises(PrefixNotFoundError):
        ckptool.strip_prefix(index, "model.", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_remap_safetensors_set_refused_as_a_file_is(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """safetensors stores no device: remap of a safetensors set is refused as remap of one safetensors file is,
    and --to with a renaming is a usage error as for one file; nothing is written."""
    index = _make_set(run_cli, tmp_path, _state_dict(["module.a", "module.b"]), "safetensors")
    with pytest.raises(UnsupportedError, match="no device tags"):
        ckptool.remap(index, tmp_path / "out", to="cpu")
    r = run_cli("strip-dataparallel", index, "--to", "cpu", "-o", tmp_path / "out")
    assert r.exit_code == 2 and "no location tags" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_existing_set_needs_force(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """A second run onto a folder that holds the first run's set is refused without --force (as convert refuses),
    and with --force replaces it whole."""
    index = _make_set(run_cli, tmp_path, _state_dict(["module.a", "module.b"]), "safetensors")
    assert run_cli("strip-dataparallel", index, "-o", tmp_path / "out").exit_code == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    r = run_cli("strip-dataparallel", index, "-o", tmp_path / "out")
    assert r.exit_code == 2 and "--force" in r.output, r.output
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    r = run_cli("strip-dataparallel", index, "-o", tmp_path / "out", "--force")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(before)


def test_key_in_two_shards_refused(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """Two shards holding a tensor of one name (an inconsistent set): refused by name, nothing written."""
    index = _make_set(run_cli, tmp_path, _state_dict(["module.a", "module.b"]), "torch")
    shards = sorted(index.parent.glob("*.bin"))
    torch.save({"module.a": torch.zeros(2)}, shards[1])  # the second shard now holds module.a too
    doc = _index(index)
    doc["weight_map"] = {"module.a": shards[0].name, "module.b": shards[1].name}
    index.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match=r"both hold 'module\.a'"):
        ckptool.remap(index, tmp_path / "out", to="cpu")
    assert not (tmp_path / "out").exists()
