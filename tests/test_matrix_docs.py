"""``docs/formats.md`` shows the support matrix of ``ckptool/ops/matrix.py``, as ``docs/generate.py`` renders it."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptool.ops.matrix import FORMATS, MATRIX, OPERATIONS, Cell

pytestmark = pytest.mark.torchfree

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def generate() -> Any:
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_generate"] = module
    spec.loader.exec_module(module)
    return module


def test_formats_page_matches_table(generate: Any) -> None:
    """The `<!-- matrix -->` block of docs/formats.md is what the table renders to (`python docs/generate.py`)."""
    page = (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")
    assert generate.MATRIX_BLOCK.search(page), "docs/formats.md lost its <!-- matrix --> block"
    assert generate.render_matrix(page) == page, "docs/formats.md is stale: run python docs/generate.py"


def test_a_changed_cell_makes_the_page_stale(generate: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    page = (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")
    monkeypatch.setitem(MATRIX, ("torch-zip", "remap"), Cell("refused", "no", "elsewhere"))
    assert generate.render_matrix(page) != page


def test_every_cell_is_on_the_page() -> None:
    """Each format has one row with a symbol per operation, and each refusal its reason and route."""
    page = (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")
    for fmt in FORMATS:
        (row,) = [line for line in page.splitlines() if line.startswith(f"| `{fmt}`:")]
        assert len(re.findall("[✓✗⚠]", row)) == len(OPERATIONS), row
    for cell in MATRIX.values():
        if cell.status != "works":
            assert f'"{cell.reason}"; instead: {cell.route}' in page
