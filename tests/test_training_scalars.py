"""A training checkpoint's plain top-level values (``epoch``, ``global_step``) survive ``convert`` into every output
format that can hold them without changing how the output loads (issue 47): safetensors' ``__metadata__`` as
strings, a DCP folder's state; a torch state_dict file cannot (``load_state_dict`` would reject the keys), and the
note says which were left out and why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from dcp_craft import dcp_back
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ckptool.ops.convert import convert
from ckptool.writers import WRITERS


def _train(tmp_path: Path, **extra: Any) -> tuple[nn.Module, Path]:
    """A real training checkpoint: ``{'epoch': 3, 'global_step': 120, 'model': sd, 'optimizer': ...}``."""
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    path = tmp_path / "train.pt"
    torch.save({"epoch": 3, "global_step": 120, **extra, "model": model.state_dict(),
                "optimizer": opt.state_dict()}, path)
    return model, path


def _fresh() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_safetensors_output_keeps_epoch_in_metadata(tmp_path: Path, run_cli) -> None:
    model, src = _train(tmp_path, best_acc=0.75, done=False, tag="run-1")
    out = tmp_path / "m.safetensors"
    r = run_cli("convert", src, "-o", out)
    assert r.exit_code == 0, r.output
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert {k: meta[k] for k in ("epoch", "global_step", "best_acc", "done", "tag")} == {
        "epoch": "3", "global_step": "120", "best_acc": "0.75", "done": "False", "tag": "run-1"}
    assert "Note: the training entries epoch, global_step, best_acc, done, tag were written into __metadata__" \
        in r.output
    assert "epoch: int 3" not in r.output  # no longer listed as not carried
    assert "optimizer: optimizer state" in r.output
    back = _fresh()
    back.load_state_dict(load_file(out))  # strict: the metadata changes nothing of how it loads
    for a, b in zip(back.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_safetensors_shards_each_keep_epoch(tmp_path: Path) -> None:
    _, src = _train(tmp_path)
    res = convert(src, tmp_path / "out", max_shard_size=64)
    shards = sorted((tmp_path / "out").glob("*.safetensors"))
    assert len(shards) > 1 and res.shards == len(shards)
    for s in shards:
        with safe_open(str(s), "pt") as f:
            assert f.metadata()["epoch"] == "3"


def test_name_the_header_uses_is_left_out_and_named(tmp_path: Path) -> None:
    _, src = _train(tmp_path, format="other")
    res = convert(src, tmp_path / "m.safetensors")
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["epoch"] == "3"
    assert "the training entry format was not written: __metadata__ already uses the name" in res.notes
    assert any(x.startswith("format: str") for x in res.left_out)


def test_torch_output_leaves_them_out_with_a_note(tmp_path: Path, run_cli) -> None:
    model, src = _train(tmp_path)
    out = tmp_path / "m.pt"
    r = run_cli("convert", src, "-o", out)
    assert r.exit_code == 0, r.output
    notes = [line for line in r.output.splitlines() if "training entries" in line]
    assert notes == [("Note: the training entries epoch, global_step were not written: a torch state_dict file "
                      "holds them only as extra keys, which model.load_state_dict would reject as unexpected")]
    back = _fresh()
    back.load_state_dict(torch.load(out, weights_only=True))  # strict: no extra keys
    for a, b in zip(back.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_dcp_output_keeps_them_in_its_state(tmp_path: Path) -> None:
    model, src = _train(tmp_path)
    convert(src, tmp_path / "ck", format="dcp")
    back = dcp_back(tmp_path / "ck")
    assert back["epoch"] == 3 and back["global_step"] == 120
    assert torch.equal(back["model"]["0.weight"], model.state_dict()["0.weight"])


def test_registry_says_where_each_format_holds_them() -> None:
    assert WRITERS["safetensors"].scalars == "metadata"
    assert WRITERS["dcp"].scalars == "state"
    assert WRITERS["torch"].scalars == "" and "load_state_dict" in WRITERS["torch"].scalars_why


def test_extract_state_dict_carries_them_like_convert(tmp_path: Path, run_cli) -> None:
    model = _fresh()
    torch.save({"epoch": 3, "global_step": 120, "model": model}, tmp_path / "whole.pt")
    r = run_cli("extract-state-dict", tmp_path / "whole.pt", "-o", tmp_path / "sd.safetensors")
    assert r.exit_code == 0, r.output
    with safe_open(str(tmp_path / "sd.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta == {"epoch": "3", "global_step": "120", "format": "pt"}
    _fresh().load_state_dict(load_file(tmp_path / "sd.safetensors"))
    r = run_cli("extract-state-dict", tmp_path / "whole.pt", "-o", tmp_path / "sd.pt")
    assert r.exit_code == 0, r.output
    assert "Note: the training entries epoch, global_step were not written: a torch state_dict file" in r.output
    _fresh().load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
