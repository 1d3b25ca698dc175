"""One verdict: ``inspect``, ``scan``, ``report`` and ``sanitize`` give every global the same level (``safe``,
``needs-trust``, ``dangerous``: :data:`ckptool.model.allowlist.LEVELS`) on the repository's real fixtures
(``fixtures/real``), the generated ones (``tests/conftest.py``) and the adversarial corpus (``fuzz/adversarial.py``).

``scan`` rates a global in the context of the pickle that names it (a TorchScript archive, a DCP ``.metadata``), so
a name may carry two levels in one file (``pathlib.PosixPath`` is data in ``.metadata``, needs trust in a record);
every other command's level for it must be one of scan's. ``inspect`` and ``report`` must also agree with scan on
the whole file (its worst level), and ``inspect``'s table must name the levels in scan's words.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

import pytest

import ckptool
from ckptool.errors import CkptError
from ckptool.model.allowlist import DANGEROUS, LEVELS, NEEDS_TRUST, SAFE
from ckptool.ops.diff.report import render_html
from ckptool.ops.sanitize import sanitize
from ckptool.readers import FORMATS, open_checkpoint
from ckptool.scanning.entry import ScanResult, scan_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))

import adversarial


def _scan_levels(res: ScanResult) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for g in res.globals:
        out.setdefault(g.name, set()).add(g.level)
    return out


def _report_levels(page: str) -> tuple[str, dict[str, str]]:
    """The file's verdict and the level of each global the report's safety row names."""
    verdict = re.search(r'data-verdict="([^"]+)"', page)
    assert verdict is not None
    named: dict[str, str] = {}
    for level, label in ((DANGEROUS, "dangerous"), (NEEDS_TRUST, "needs trust")):
        listed = re.search(rf"{label}: <code>(.*?)</code>", page, re.S)
        for name in html.unescape(listed.group(1)).split(", ") if listed else []:
            named.setdefault(name, level)
    return verdict.group(1), named


def _check(path: Path, tmp_path: Path) -> list[str]:
    """Every disagreement between scan and the other commands on ``path`` (empty: one verdict)."""
    res = scan_file(str(path))
    scan = _scan_levels(res)
    bad: list[str] = []
    try:
        info = ckptool.inspect(path)
    except CkptError:
        return bad  # inspect refuses the file (scan then says why)
    for g in info.globals:
        assert g.level in LEVELS
        if g.name in scan and g.level not in scan[g.name]:
            bad.append(f"inspect rates {g.name} {g.level}, scan {sorted(scan[g.name])}")
    if info.scan is not None and info.security()["verdict"] != info.scan.verdict:
        bad.append(f"inspect's verdict {info.security()['verdict']} is not scan's {info.scan.verdict}")
    verdict, named = _report_levels(render_html(info))
    if info.scan is not None and verdict != info.scan.verdict:
        bad.append(f"report says {verdict}, scan {info.scan.verdict}")
    for name, levels in scan.items():
        shown = named.get(name, SAFE)
        if shown not in levels and max(levels, key=LEVELS.index) != shown:
            bad.append(f"report rates {name} {shown}, scan {sorted(levels)}")
    if FORMATS[open_checkpoint(path).format].tensors and FORMATS[open_checkpoint(path).format].pickled:
        try:
            done = sanitize(path, tmp_path / f"{path.name}.sanitized.pt", drop_unknown=True)
        except CkptError:
            return bad
        bad += [f"sanitize rates {c.source} {c.level}, scan {sorted(scan[c.source])}" for c in done.dropped
                if c.level and c.source in scan and c.level not in scan[c.source]]
    return bad


def test_real_fixtures(real_dir: Path, tmp_path: Path) -> None:
    bad = {p.name: _check(p, tmp_path) for p in sorted(real_dir.iterdir()) if p.suffix != ".md"}
    assert not {k: v for k, v in bad.items() if v}


def test_generated_fixtures(generated: dict[str, Path], tmp_path: Path) -> None:
    bad = {name: _check(p, tmp_path) for name, p in generated.items()}
    assert not {k: v for k, v in bad.items() if v}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("adversarial")
    return [(case.name, path) for case, path in adversarial.write(root)]


def test_adversarial_corpus(corpus: list[tuple[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(adversarial.MARKER_ENV, str(tmp_path / "marker"))
    bad = {name: _check(p, tmp_path) for name, p in corpus}
    assert not {k: v for k, v in bad.items() if v}
    assert not (tmp_path / "marker").exists()


def test_inspect_names_scan_levels_for_wrapped_and_script_classes(tmp_path: Path, run_cli) -> None:
    """DataParallel and a class of ``__main__`` need trust in inspect as in scan (not "unknown"), and a DCP folder's
    record classes are refused by torch.load(weights_only=True) although scan calls them safe in ``.metadata``."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

    Net.__module__, Net.__qualname__ = "__main__", "Net"
    sys.modules["__main__"].Net = Net  # type: ignore[attr-defined]  # so that torch.save pickles it by name
    try:
        torch.save(torch.nn.DataParallel(Net()), tmp_path / "dp.pt")
    finally:
        del sys.modules["__main__"].Net  # type: ignore[attr-defined]
    info = ckptool.inspect(tmp_path / "dp.pt")
    levels = {g.name: g.level for g in info.globals}
    assert levels["torch.nn.parallel.data_parallel.DataParallel"] == NEEDS_TRUST
    assert levels["__main__.Net"] == NEEDS_TRUST
    out = run_cli("inspect", tmp_path / "dp.pt").output
    row = next(line for line in out.splitlines() if line.startswith("__main__.Net"))
    assert row.split()[-1] == "needs-trust" and "unknown" not in out

    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(3), "step": 3}, checkpoint_id=str(tmp_path / "dcp"))
    info = ckptool.inspect(tmp_path / "dcp")
    rows = {g.name: (g.allowed, g.level) for g in info.globals}
    assert rows["torch.distributed.checkpoint.metadata.Metadata"] == (False, SAFE)
    if "pathlib.PosixPath" in rows:
        assert rows["pathlib.PosixPath"] == (False, SAFE)
    out = run_cli("inspect", tmp_path / "dcp").output
    assert "refuses this file" not in out  # DCP reads .metadata with pickle.load, not torch.load


def test_sanitize_names_the_level(tmp_path: Path) -> None:
    import os

    import torch

    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, ("echo never",))

    torch.save({"w": torch.ones(1), "cmd": Evil()}, tmp_path / "h.pt")
    with pytest.raises(CkptError, match=r"cmd: (os|posix)\.system \(DANGEROUS: runs processes"):
        sanitize(tmp_path / "h.pt", tmp_path / "o.pt")


def test_load_hint_names_levels_and_never_advises_running_a_dangerous_file(tmp_path: Path) -> None:
    """The load hint's note (:func:`ckptool.ops.hints.load_hint`) says each refused global's scan level, and for a
    dangerous one says not to load it with weights_only=False (it advised exactly that for every refused file)."""
    import argparse
    import os

    import torch

    from ckptool.ops.hints import load_hint

    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, ("echo never",))

    torch.save({"w": torch.ones(1), "cmd": Evil()}, tmp_path / "h.pt")
    notes = " ".join(load_hint(tmp_path / "h.pt").notes)
    assert "system (DANGEROUS)" in notes and "Do not load it with weights_only=False" in notes, notes
    torch.save({"w": torch.ones(1), "args": argparse.Namespace(lr=0.1)}, tmp_path / "ns.pt")
    notes = " ".join(load_hint(tmp_path / "ns.pt").notes)
    assert "argparse.Namespace (needs-trust)" in notes and "ckptool sanitize" in notes, notes
    torch.save({"w": torch.ones(1)}, tmp_path / "ok.pt")
    assert not any("refuses" in n for n in load_hint(tmp_path / "ok.pt").notes)

