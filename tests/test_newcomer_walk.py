"""A newcomer's walk (issue 37, item 3): the commands README.md and docs/commands/ show, run on what a newcomer has
(a ``torch.save(nn.DataParallel(model))`` full model, a ``torch.distributed.checkpoint`` folder saved from a
DataParallel model), each printed ``Load it with:`` line run as printed into the model the newcomer holds."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn


class Net(nn.Module):  # type: ignore[misc]  # torch is imported by importorskip
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)


def _hint_and_notes(output: str) -> tuple[str, list[str]]:
    lines = output.splitlines()
    hint = [ln.removeprefix("Load it with: ") for ln in lines if ln.startswith("Load it with: ")]
    assert len(hint) == 1, output
    return hint[0], [ln.removeprefix("Note: ") for ln in lines if ln.startswith("Note: ")]


def _same(model: Any, state: dict[str, Any]) -> None:
    got = model.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_extract_state_dict_of_a_dataparallel_model_says_how_the_bare_model_loads_it(
        run_cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.save(nn.DataParallel(model))``: the extracted state_dict keeps ``module.``; the printed line loads it
    into the wrapped model, and a note gives the line that loads it into the bare model (which runs)."""
    import ckptool

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    net = Net()
    torch.save(nn.DataParallel(net), "dp_full.pt")
    r = run_cli("extract-state-dict", "dp_full.pt", "-o", "sd.pt")
    assert r.exit_code == 0, r.output
    hint, notes = _hint_and_notes(r.output)
    assert hint == "model.load_state_dict(torch.load('sd.pt', weights_only=True))"
    wrapped = nn.DataParallel(Net())
    eval(hint, {"torch": torch, "model": wrapped})  # the printed line, into the wrapped model
    _same(wrapped.module, net.state_dict())
    note = next(n for n in notes if n.startswith("every key starts with module. (a wrapper's): the line below loads "
                                                  "it into the wrapped model (nn.DataParallel(model))"))
    bare_line = re.search(r"into the bare model: (ckptool\.load_into\(model, 'sd\.pt'\))", note)
    assert bare_line is not None and "`ckptool strip-dataparallel sd.pt` first" in note, note
    bare = Net()
    eval(bare_line.group(1), {"ckptool": ckptool, "model": bare})
    _same(bare, net.state_dict())
    r = run_cli("strip-dataparallel", "sd.pt", "-o", "bare.pt")  # the command the note names
    assert r.exit_code == 0, r.output
    hint, notes = _hint_and_notes(r.output)
    assert not any("wrapper" in n for n in notes), notes
    bare = Net()
    eval(hint, {"torch": torch, "model": bare})
    _same(bare, net.state_dict())


def test_a_stripped_state_dict_has_no_wrapper_note(run_cli: Any, tmp_path: Path) -> None:
    torch.save(Net().state_dict(), tmp_path / "sd.pt")
    r = run_cli("remap", tmp_path / "sd.pt", "--to", "cpu", "-o", tmp_path / "o.pt")
    assert r.exit_code == 0, r.output
    assert "every key starts with" not in r.output


def test_a_dcp_folder_of_a_dataparallel_model_walks_to_the_bare_model(run_cli: Any, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``dcp.save(nn.DataParallel(model).state_dict())``: inspect names the prefix and the command; that command's
    printed line loads the folder into the bare model; convert's printed line loads the file it writes."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(1)
    net = Net()
    with pytest.warns(UserWarning):  # torch: "torch.distributed is disabled ... assuming ... a single process"
        dcp.save(nn.DataParallel(net).state_dict(), checkpoint_id="ckpt")
    r = run_cli("inspect", "ckpt")
    assert r.exit_code == 0, r.output
    assert re.search(r"\(top level\)\s+4\s+module\.\s+ckptool strip-dataparallel", r.output), r.output
    r = run_cli("strip-dataparallel", "ckpt")
    assert r.exit_code == 0, r.output
    hint, _notes = _hint_and_notes(r.output)
    assert hint.startswith("torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id="), hint
    bare = Net()
    with pytest.warns(UserWarning):
        eval(hint, {"torch": torch, "model": bare})
    _same(bare, net.state_dict())
    r = run_cli("convert", "ckpt.stripped", "-o", "model.safetensors")
    assert r.exit_code == 0, r.output
    hint, _notes = _hint_and_notes(r.output)
    import safetensors.torch

    bare = Net()
    eval(f"model.load_state_dict({hint})", {"safetensors": safetensors, "model": bare})
    _same(bare, net.state_dict())
