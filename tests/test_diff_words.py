"""``ckptool diff``'s words agree with its rows (issue 37, item 5): one closing line that says what differs, each
part counted from the result ("keys differ by a `module.` prefix; 11 of 11 matched tensors equal", never
"different: 11 of 11 matched tensors equal" alone); a prefix's count taken from that side's keys ("on every key"
when every key has it, even where some have no match); a shape change shown in its row's changes column, never
folded into a line that leaves the row a "-"; and the ``-v`` help naming the device the docs' example shows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptool.ops.diff.compare import diff


def _sd(n: int = 11) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"l{i}.weight": torch.randn(3, generator=g) for i in range(n)}


@pytest.fixture
def a(tmp_path: Path) -> Path:
    torch.save(_sd(), tmp_path / "a.pth")
    return tmp_path / "a.pth"


def _save(tmp_path: Path, name: str, sd: dict[str, torch.Tensor]) -> Path:
    torch.save(sd, tmp_path / name)
    return tmp_path / name


def _last(output: str) -> str:
    return output.strip().splitlines()[-1]


def test_a_prefix_alone_is_named_in_the_closing_line(a: Path, tmp_path: Path, run_cli: Any) -> None:
    b = _save(tmp_path, "dp.pth", {f"module.{k}": v for k, v in _sd().items()})
    r = run_cli("diff", a, b)
    assert r.exit_code == 1
    assert _last(r.output) == "different: keys differ by a `module.` prefix; 11 of 11 matched tensors equal (bit-exact)"
    res = diff(a, b)
    assert res.prefixes == ["module."] and res.differences() == ["keys differ by a `module.` prefix"]
    got = json.loads(run_cli("diff", a, b, "--json").output)
    assert got["summary"] == res.summary() and got["prefixes"] == ["module."]
    same = run_cli("diff", a, a)
    assert same.exit_code == 0 and _last(same.output) == "identical: 11 of 11 matched tensors equal (bit-exact)"


def test_prefix_counts_come_from_the_keys(a: Path, tmp_path: Path, run_cli: Any) -> None:
    """Every key of B has ``module.``, 4 of them with no match in A: "on every key" (it said "on 7 of 11 keys");
    where only 7 of B's keys have it, "on 7 of 11 keys"."""
    sd = _sd()
    every = {f"module.{k}": v for k, v in sd.items()}
    for i in range(4):
        every[f"module.x{i}.weight"] = every.pop(f"module.l{i}.weight")
    r = run_cli("diff", a, _save(tmp_path, "every.pth", every))
    assert "keys: B has `module.` on every key, A has none; keys matched without it" in r.output
    assert _last(r.output) == ("different: keys differ by a `module.` prefix; 4 keys only in A, 4 only in B; "
                               "7 of 7 matched tensors equal (bit-exact)")
    some = {(f"module.{k}" if i >= 4 else k): v for i, (k, v) in enumerate(sd.items())}
    r = run_cli("diff", a, _save(tmp_path, "some.pth", some))
    assert "keys: B has `module.` on 7 of 11 keys, A has none; keys matched without it" in r.output
    assert _last(r.output).endswith("; 11 of 11 matched tensors equal (bit-exact)")


def test_a_shape_change_is_shown_in_its_row(a: Path, tmp_path: Path, run_cli: Any) -> None:
    """Two tensors with the same shape change: each row's changes column names it (it showed "-" under a folded
    "2 tensors: shape [3] -> [4]" line) and the closing line counts them."""
    sd = _sd()
    b = _save(tmp_path, "shape.pth", {**sd, "l5.weight": torch.zeros(4), "l6.weight": torch.zeros(4)})
    r = run_cli("diff", a, b)
    rows = [ln for ln in r.output.splitlines() if ln.startswith(("l5.weight", "l6.weight"))]
    assert len(rows) == 2 and all("shape [3] -> [4]" in ln and "not compared (shapes differ)" in ln for ln in rows)
    assert "2 tensors: shape" not in r.output
    assert _last(r.output) == ("different: 2 tensors change shape; 9 of 11 matched tensors equal (bit-exact), "
                               "2 not compared")


def test_every_difference_is_in_the_closing_line(a: Path, tmp_path: Path, run_cli: Any) -> None:
    """Keys on one side, a dtype change, values that differ and plain values, each named and counted."""
    sd = _sd()
    torch.save({"model": sd, "epoch": 1}, tmp_path / "t1.pth")
    changed = {**sd, "l1.weight": sd["l1.weight"] + 1, "l2.weight": sd["l2.weight"].double()}
    del changed["l10.weight"]
    torch.save({"model": changed, "epoch": 2}, tmp_path / "t2.pth")
    r = run_cli("diff", tmp_path / "t1.pth", tmp_path / "t2.pth")
    assert _last(r.output) == (
        "different: 1 key only in A; 1 tensor changes dtype; values differ in 1 tensor; 1 plain value differs; "
        "8 of 10 matched tensors equal (bit-exact), 1 not compared, 1 plain value compared")


def test_verbose_help_names_cuda0(run_cli: Any) -> None:
    r = run_cli("diff", "--help", terminal_width=200)
    assert "'72 tensors: device cuda:0 -> cpu'" in r.output and "cuda:1" not in r.output
    doc = (Path(__file__).resolve().parent.parent / "docs" / "commands" / "diff.md").read_text(encoding="utf-8")
    assert "72 tensors: device cuda:0 -> cpu" in doc and "cuda:1" not in doc
