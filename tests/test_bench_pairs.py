"""``benchmarks/pairs.py`` records the load average around every alternating pair, and a comparison during which it
went over ``QUIET_LOAD`` is marked not valid for claims (issue 41: speed claims come from a quiet machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import pairs  # benchmarks/ is no package: its folder is put on sys.path above

pytestmark = pytest.mark.torchfree


def test_each_pair_reads_the_load_before_and_after(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([0.5, 0.7, 0.9, 1.1, 1.2, 1.4])
    monkeypatch.setattr(pairs, "load_average", lambda: next(readings))
    p = pairs.alternate(pairs.Pair("x", "A", "B"), lambda: 1.0, lambda: 2.0, 3, lambda _msg: None)
    assert p.a == [1.0] * 3 and p.b == [2.0] * 3
    assert p.loads == [0.5, 0.7, 0.9, 1.1, 1.2, 1.4]
    assert p.valid and p.row()[-1] == "0.50-1.40 valid"


def test_a_loaded_machine_makes_the_comparison_not_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([0.5, 0.7, 2.4, 1.1])
    monkeypatch.setattr(pairs, "load_average", lambda: next(readings))
    p = pairs.alternate(pairs.Pair("x", "A", "B"), lambda: 1.0, lambda: 2.0, 2, lambda _msg: None)
    assert not p.valid
    assert p.row()[-1] == f"0.50-2.40 NOT VALID for claims (load > {pairs.QUIET_LOAD})"


def test_nothing_measured_is_not_valid() -> None:
    p = pairs.Pair("x", "A", "B", error="tool missing")
    assert not p.valid and p.row()[-1] == "-"
