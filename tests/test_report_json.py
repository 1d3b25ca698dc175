"""``ckptool report --json`` (issue 37, item 4): the page is written and what it summarises is printed as one JSON
object (``"schema": "ckptool.report/2"``), the same figures the page shows; ``report --help`` names the default
output as it is made (``model.pth -> model.report.html``)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_report import _blocks, _parse

from ckptool.cli import cli
from ckptool.cli.report import default_output


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A state_dict and a DataParallel copy with one tensor moved, one key gone and one new."""
    sd = _blocks()
    torch.save(sd, tmp_path / "base.v2.pth")
    tuned = {f"module.{k}": v for k, v in sd.items()}
    tuned["module.layers.2.attn.q.weight"] = tuned["module.layers.2.attn.q.weight"] * 1.5
    del tuned["module.head.weight"]
    tuned["module.head2.weight"] = torch.zeros(4, 8)
    torch.save(tuned, tmp_path / "tuned.pth")
    return tmp_path / "base.v2.pth", tmp_path / "tuned.pth"


def test_report_json_prints_the_figures_of_the_page(pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = pair
    out = tmp_path / "cmp.html"
    r = CliRunner().invoke(cli, ["report", str(a), str(b), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert got["schema"] == "ckptool.report/2" and got["dst"] == str(out) and got["compared"] is True
    assert got["bytes_written"] == out.stat().st_size
    sd = _blocks()
    side = got["a"]
    assert side["format"] == "torch-zip" and side["kind"] == "state_dict" and side["verdict"] == "safe"
    assert side["size"] == a.stat().st_size and side["tensors"] == len(sd)
    assert side["params"] == sum(v.numel() for v in sd.values())
    assert side["by_dtype"]["float16"]["params"] == sum(v.numel() for v in sd.values() if v.dtype == torch.float16)
    assert side["bytes"] == sum(row["bytes"] for row in side["by_device"].values())
    assert got["b"]["state_dicts"] == [{"path": "", "tensors": len(sd), "prefixes": ["module."],
                                        "fix": "ckptool strip-dataparallel"}]
    cmp = got["comparison"]
    assert cmp["counts"] == {"equal": len(sd) - 2, "value change": 1, "shape or dtype change": 0, "only in A": 1,
                             "only in B": 1}
    assert "module." in cmp["prefix"] and cmp["norms"] is True and cmp["changed_left"] == 0
    assert {(c["key"], c["status"]) for c in cmp["changed"]} == {
        ("layers.2.attn.q.weight", "value change"), ("head.weight", "only in A"), ("module.head2.weight", "only in B")}
    # the page shows the same figures: counts, relative change per module, keys that differ
    html = out.read_text(encoding="utf-8")
    page = _parse(html)
    counts = dict(re.findall(r'data-status="([^"]+)"><b>(\d+)</b>', html))
    assert {k: int(v) for k, v in counts.items()} == cmp["counts"]
    shown = {x["data-path"]: x["data-rel"] for t, x in page.tags if t == "tr" and x.get("class") == "change"}
    assert shown == {m["path"]: f"{m['rel']:.3g}" for m in cmp["modules"]}
    assert shown["layers.2.attn"] != "0" and shown["embed"] == "0"
    rows = [x["data-status"] for t, x in page.tags if t == "tr" and x.get("data-status")]
    assert sorted(rows) == sorted(c["status"] for c in cmp["changed"])
    assert f"{side['params']:,} elements" in html


def test_report_json_of_one_checkpoint_and_quiet(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """Without B ``b`` and ``comparison`` are null; with --quiet the JSON alone is printed."""
    a, _ = pair
    r = CliRunner().invoke(cli, ["report", str(a), "-o", str(tmp_path / "one.html"), "--json", "-q"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert got["b"] is None and got["comparison"] is None and got["compared"] is False
    assert got["a"]["state_dicts"] == [{"path": "", "tensors": len(_blocks()), "prefixes": [], "fix": None}]
    r = CliRunner().invoke(cli, ["report", str(a), "-o", str(tmp_path / "two.html"), "-q"])
    assert r.exit_code == 0 and r.output == ""


def test_report_help_names_the_default_output_as_made(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """The help's default (A's name up to its first dot + .report.html) is the file written without -o."""
    r = CliRunner().invoke(cli, ["report", "--help"], terminal_width=200)
    assert "A's name up to its first dot + .report.html" in r.output
    assert "model.pth -> model.report.html" in r.output and "--json" in r.output
    assert default_output("model.pth") == "model.report.html"
    a, _ = pair
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        r = CliRunner().invoke(cli, ["report", str(a), "--json"])
    finally:
        os.chdir(cwd)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["dst"] == "base.report.html" and (tmp_path / "base.report.html").is_file()
