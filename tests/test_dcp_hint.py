"""The load hint of a DCP folder runs as printed (issue 37, item 2): ``dcp.load`` is given ``model.state_dict()``
wrapped in the nesting the folder was saved with (``{'model': model.state_dict()}`` for ``dcp.save({"model": sd})``),
since DCP matches the flattened keys (``model.fc.weight``); a bare ``model.state_dict()`` raises "Missing key".

Each printed line runs in the subprocess of tests/test_load_hints.py, into a real ``nn.Module`` of the expected
keys, and what it loads must equal the expected state_dict bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dcp_craft import save_dcp
from test_load_hints import hint_line, run_hints

from ckptool.ops.hints import load_hint


def _sd(prefix: str = "") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"{prefix}{k}": torch.randn(*s, generator=g) for k, s in
            (("enc.weight", (4, 3)), ("enc.bias", (4,)), ("head.weight", (2, 4)))} | {
        f"{prefix}bn.num_batches_tracked": torch.tensor(5)}


def _ref(tmp_path: Path, sd: dict[str, torch.Tensor]) -> str:
    p = tmp_path / f"ref{len(list(tmp_path.glob('ref*.pt')))}.pt"
    torch.save(sd, p)
    return str(p)


def _optim() -> dict[str, Any]:
    return {"state": {"0": {"exp_avg": torch.ones(4, 3)}}, "param_groups": [{"lr": 0.1, "params": ["0"]}]}


@pytest.fixture()
def folders(tmp_path: Path) -> dict[str, Path]:
    """DCP folders: DataParallel keys nested under ``model`` (with a step), with an optimizer beside them, nested
    two deep, and at the top level."""
    return {
        "nested": save_dcp({"model": _sd("module."), "step": 3}, tmp_path / "nested"),
        "optim": save_dcp({"model": _sd("module."), "optim": _optim(), "step": 7}, tmp_path / "optim"),
        "deep": save_dcp({"train": {"net": _sd("module.")}}, tmp_path / "deep"),
        "flat": save_dcp(_sd("module."), tmp_path / "flat"),
    }


def test_dcp_hints_load_into_the_model(folders: dict[str, Path], run_cli: Callable[..., Any],
                                       tmp_path: Path) -> None:
    """strip-dataparallel, strip-prefix and rename of nested and flat DCP folders: the printed line (and the
    ``--json`` hint with exactly its imports) fills a model whose keys are the renamed ones."""
    bare = _sd()
    cases = []
    for name, folder in folders.items():
        for i, argv in enumerate((["strip-dataparallel", str(folder)], ["strip-prefix", str(folder), "module."])):
            out = tmp_path / f"{name}_out{i}"
            r = run_cli(*argv, "-o", str(out))
            assert r.exit_code == 0, (argv, r.output)
            cases.append({"code": hint_line(r.output), "ref": _ref(tmp_path, bare), "argv": argv})
            hint = load_hint(out)
            cases.append({"code": hint.code, "imports": hint.imports, "ref": _ref(tmp_path, bare), "argv": argv})
    failures = run_hints(cases)
    assert not failures, json.dumps(failures, indent=1)


def test_dcp_hint_names_the_nesting(folders: dict[str, Path], run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """The line wraps model.state_dict() in the folder's nesting; the note says so and names the entries left
    unloaded; a flat folder gets model.state_dict() itself."""
    r = run_cli("strip-dataparallel", str(folders["optim"]), "-o", str(tmp_path / "o"))
    assert hint_line(r.output) == (
        f"torch.distributed.checkpoint.load({{'model': model.state_dict()}}, checkpoint_id='{tmp_path / 'o'}')")
    assert ("the line passes model.state_dict() in the nesting the folder was saved with (under 'model'), which "
            "fills model; the folder's other entries (optim, step) stay unloaded") in r.output
    deep = load_hint(folders["deep"])
    assert deep.code.startswith("torch.distributed.checkpoint.load({'train': {'net': model.state_dict()}}, ")
    assert "(under 'train' -> 'net')" in deep.notes[0]
    flat = load_hint(folders["flat"])
    assert flat.code == f"torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id='{folders['flat']}')"
    assert flat.imports == ["import torch.distributed.checkpoint"]


def test_the_flat_line_fails_on_a_nested_folder(folders: dict[str, Path], tmp_path: Path) -> None:
    """What the hint said before issue 37 (a bare model.state_dict()) does not load a nested folder: the runner
    reports DCP's missing keys, so the cases above would catch it."""
    line = f"torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id='{folders['nested']}')"
    failures = run_hints([{"code": line, "ref": _ref(tmp_path, _sd("module."))}])
    assert len(failures) == 1 and "Missing key" in failures[0]["error"], failures
