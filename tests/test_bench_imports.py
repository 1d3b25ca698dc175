"""``benchmarks/bench.py``'s ``imports`` figure reads ``python -X importtime``: the start-up's import time (every
module's own time added up), ``ckptool.cli``'s cumulative time and the modules imported (issue 41)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench  # benchmarks/ is no package: its folder is put on sys.path above

pytestmark = pytest.mark.torchfree

_STDERR = """\
import time: self [us] | cumulative | imported package
import time:       100 |        100 |   _io
import time:      1500 |       2000 | click
import time:       200 |        200 |     ckptool.errors
import time:       300 |        500 |   ckptool
import time:      2500 |       9000 | ckptool.cli
import time:       400 |        400 |   ckptool.scanning.entry
some other line on stderr
"""


def test_importtime_adds_up_own_times_and_counts_modules() -> None:
    total, cli, (ours, every) = bench._importtime(_STDERR)
    assert total == pytest.approx((100 + 1500 + 200 + 300 + 2500 + 400) / 1000)
    assert cli == pytest.approx(9.0)
    assert (ours, every) == (4, 6)


def test_importtime_of_nothing_is_zero() -> None:
    assert bench._importtime("") == (0, 0, (0, 0))
