"""scan of a file cut short is ``incomplete``, never ``safe`` (issue 36 item 8): its own verdict, between needs
trust and safe, exit status 5 (``--strict`` too), ``"incomplete"`` in ``--json``, SARIF rule ``CKPT005``."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from hostile_inputs import make_case

from ckptool.scanning.entry import scan_file
from ckptool.scanning.results import EXIT_CODES, INCOMPLETE, STRICT_EXIT_CODES, exit_status


def _saved(legacy: bool) -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(10_000.0), "b": torch.ones(3)}, buf, _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


@pytest.mark.parametrize("name", ["truncated.pth", "truncated.pt", "dcp_offset"])
def test_cut_short_is_incomplete(tmp_path: Path, name: str) -> None:
    res = scan_file(make_case(name, tmp_path))
    assert res.verdict == INCOMPLETE and res.exit_code == EXIT_CODES[INCOMPLETE] == 5
    assert res.strict_exit_code == STRICT_EXIT_CODES[INCOMPLETE] == 5
    assert res.cut_short and res.to_dict()["incomplete"] == res.cut_short
    assert res.report().startswith(f"{res.path}: INCOMPLETE (") and "incomplete" in res.report()


@pytest.mark.parametrize("name", ["truncated.pth", "truncated.pt", "dcp_offset"])
def test_a_cached_result_stays_incomplete(tmp_path: Path, name: str) -> None:
    """``--cache`` rebuilds a result from its JSON: what is cut short comes back with it (before, a file whose
    container was cut short came back ``safe`` from the cache; issue 46: never safe)."""
    from ckptool.ops.scan.cache import result_from_dict

    res = scan_file(make_case(name, tmp_path))
    again = result_from_dict(json.loads(json.dumps(res.to_dict())))
    assert again.verdict == res.verdict == INCOMPLETE and again.cut_short == res.cut_short


@pytest.mark.parametrize("cut", [0.5, 0.9, 0.99])
def test_a_legacy_file_cut_in_its_storage_data(tmp_path: Path, cut: float) -> None:
    """The five pickles are whole; the storage blocks after them are not: torch.load fails, scan said safe."""
    data = _saved(legacy=True)
    p = tmp_path / "cut.pth"
    p.write_bytes(data[:int(len(data) * cut)])
    res = scan_file(p)
    assert res.verdict == INCOMPLETE, res.report()
    assert any("legacy storage" in why and "truncated" in why for why in res.incomplete)
    with pytest.raises(Exception):  # noqa: B017  # torch agrees: it cannot load it
        torch.load(p, weights_only=True)


def test_every_cut_of_a_small_file_is_never_safe(tmp_path: Path) -> None:
    """A torch zip and a legacy file cut at every 97th byte: never safe, never a crash (a plain pickle's cut too)."""
    for label, data in (("zip", _saved(False)), ("legacy", _saved(True)),
                        ("pickle", pickle.dumps({"a": list(range(300))}, protocol=4))):
        p = tmp_path / f"cut.{label}"
        for n in range(1, len(data) - 1, 97):
            p.write_bytes(data[:n])
            res = scan_file(p)
            assert res.verdict in (INCOMPLETE, "error"), (label, n, res.report())


def test_a_pickle_cut_short_is_incomplete_but_a_hostile_length_is_unreadable(tmp_path: Path) -> None:
    whole = pickle.dumps({"a": "x" * 5000}, protocol=2)
    cut = tmp_path / "cut.pkl"
    cut.write_bytes(whole[:len(whole) // 2])
    assert scan_file(cut).verdict == INCOMPLETE
    huge = tmp_path / "huge.pkl"  # BINUNICODE8 of 2^62 bytes in a 14-byte file: no cut explains it
    huge.write_bytes(b"\x80\x04\x8d" + (1 << 62).to_bytes(8, "little") + b"abc.")
    assert scan_file(huge).verdict == "error"


def test_needs_trust_and_dangerous_come_before_incomplete(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save(torch.nn.Linear(100, 100), buf, _use_new_zipfile_serialization=False)  # a module: needs trust
    p = tmp_path / "module.pth"
    p.write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])
    res = scan_file(p)
    assert res.verdict == "needs-trust" and res.cut_short, res.report()
    safe = tmp_path / "safe.pt"
    safe.write_bytes(_saved(False))
    cut = make_case("truncated.pt", tmp_path)
    assert exit_status([scan_file(safe), scan_file(cut)]) == 5
    assert exit_status([scan_file(p), scan_file(cut)]) == 4


def test_dcp_folder_with_a_record_file_cut_or_missing(tmp_path: Path) -> None:
    from dcp_craft import save_dcp

    folder = save_dcp({"w": torch.ones(1000), "b": torch.zeros(5)}, tmp_path / "dcp")
    files = sorted(folder.glob("*.distcp"))
    data = files[0].read_bytes()
    files[0].write_bytes(data[:len(data) // 3])
    assert scan_file(folder).verdict == INCOMPLETE
    files[0].unlink()
    res = scan_file(folder)
    assert res.verdict == INCOMPLETE and any("missing" in why for why in res.incomplete)
    meta = folder / ".metadata"  # .metadata cut short: incomplete too
    copy = tmp_path / "dcp2"
    shutil.copytree(folder, copy)
    whole = meta.read_bytes()
    (copy / ".metadata").write_bytes(whole[:len(whole) // 2])
    assert scan_file(copy).verdict in (INCOMPLETE, "error")  # never safe


def test_cli_json_and_sarif(tmp_path: Path, run_cli) -> None:
    cut = make_case("truncated.pth", tmp_path)
    r = run_cli("scan", cut)
    assert r.exit_code == 5 and ": INCOMPLETE (" in r.output and "  incomplete: legacy storage" in r.output
    doc = json.loads(run_cli("scan", "--json", cut).output)
    assert doc["exit_code"] == 5 and doc["files"][0]["verdict"] == INCOMPLETE and doc["files"][0]["incomplete"]
    assert run_cli("scan", "--strict", cut).exit_code == 5
    log = json.loads(run_cli("scan", "--format", "sarif", cut).output)
    assert {x["ruleId"] for x in log["runs"][0]["results"]} == {"CKPT005"}
    r = run_cli("scan", "--help")
    assert "5  a file is incomplete" in r.output
