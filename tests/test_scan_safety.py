"""One safety model: ``inspect``'s security verdict is ``scan``'s, from the same analysis of every pickle-bearing
part of the file (zip members, nested zips, duplicate names, data after the end, legacy sub-pickles), and says
where a pickle that ``torch.load`` does not read today sits; the analysis reads no tensor bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ckptool.scanning.pickles as scan_pickles
from ckptool.errors import CkptError
from ckptool.model.allowlist import DANGEROUS, NEEDS_TRUST, SAFE
from ckptool.ops.inspect.entry import inspect
from ckptool.scanning.entry import scan_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))
import hostile_corpus as hc

pytestmark = pytest.mark.torchfree  # needs no torch: .ci/run also runs it where torch is not installed


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[hc.Entry, Path]]:
    return {e.name: (e, p) for e, p in hc.write(tmp_path_factory.mktemp("hostile"))}


def test_inspect_and_scan_give_one_verdict_on_every_hostile_file(corpus) -> None:
    """Every hostile file inspect reads gets scan's verdict, level and dangerous globals in inspect's security
    section; the gadgets torch.load does not read today (``scan_only`` files) included."""
    read = hidden_flagged = 0
    for name, (entry, path) in corpus.items():
        try:
            info = inspect(path)
        except CkptError:
            continue  # refused with a clear error: nothing is called safe
        read += 1
        sec = info.to_dict()["security"]
        res = scan_file(path)
        assert sec["verdict"] == res.verdict and not {"level", "scan_verdict"} & set(sec), name
        assert sec["exit_code"] == res.exit_code, name
        assert {d["name"] for d in sec["dangerous"]} == {g.name for g in res.globals if g.status == DANGEROUS}
        if entry.expect:
            assert sec["verdict"] == DANGEROUS, name
        if entry.scan_only and entry.expect:
            hidden_flagged += 1
            assert any(set(h["globals"]) & entry.expect and h["level"] == DANGEROUS
                       for h in sec["hidden_pickles"]), (name, sec["hidden_pickles"])
    assert read > 200 and hidden_flagged >= 6


@pytest.mark.parametrize(("name", "where"), [
    ("zip-extra-pkl-member.pt", "archive/extra.pkl"),
    ("zip-hidden-pickle-member.pt", "archive/weights.bin"),
    ("zip-pkl-elsewhere.pt", "other/data.pkl"),
    ("zip-nested.pt", "archive/inner.zip!archive/data.pkl"),
    ("zip-nested-twice.pt", "archive/a.zip!archive/b.zip!archive/data.pkl"),
    ("zip-then-gadget-pickle.pt", "data after the last pickle, byte "),
    ("benign-then-gadget.pt", "data after the last pickle, byte 17"),
    ("zip-data-pkl-trailing-pickle.pt", "archive/data.pkl (pickle 2 in a row, byte 17)"),
])
def test_inspect_says_where_the_hidden_pickle_sits(corpus, run_cli, name: str, where: str) -> None:
    _entry, path = corpus[name]
    info = inspect(path)
    hidden = info.to_dict()["security"]["hidden_pickles"]
    assert [h["where"] for h in hidden if h["globals"]] and all(h["where"].startswith(where) for h in hidden if
                                                                 h["globals"]), hidden
    assert info.globals == [] or all(g.status != DANGEROUS for g in info.globals)  # torch.load's own pickle is benign
    r = run_cli("inspect", path)
    assert r.exit_code == 0
    assert "Pickles torch.load does not read today" in r.output and where in r.output
    assert "DANGEROUS: " in r.output and "a pickle torch.load does not read today, names os." in r.output


def test_pickles_torch_reads_are_not_hidden(corpus) -> None:
    for name in ("gadget-os.system-zip.pth", "legacy-sys-info-gadget.pt", "legacy-main-gadget.pt",
                 "gadget-os.system-p2.pt", "torchscript-like-gadget.pt"):
        res = scan_file(corpus[name][1])
        assert res.pickles and not res.hidden, (name, res.pickles)
    res = scan_file(corpus["legacy-tar.pt"][1])
    assert {p.where for p in res.pickles if not p.hidden} >= {"tar member pickle", "tar member sys_info"}


def test_benign_real_files_agree(real_dir: Path) -> None:
    for p in sorted(real_dir.iterdir()):
        if p.suffix not in (".pt", ".pth", ".jit", ".safetensors"):
            continue
        sec = inspect(p).to_dict()["security"]
        want = "needs-trust" if p.suffix == ".jit" else SAFE  # TorchScript code/ needs trust (test_scan_code.py)
        assert sec["verdict"] == scan_file(p).verdict == want and sec["hidden_pickles"] == [], p


def test_the_analysis_reads_no_tensor_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scan (and inspect's scan) reads the pickles and headers, never a ``data/<key>`` storage record; inspect's
    scan does not unpickle data.pkl a second time."""
    path = tmp_path / "big.pt"
    path.write_bytes(hc.torch_zip(hc.benign_pickle(), extra={f"data/{i}": b"\0" * 4096 for i in range(8)}))
    touched: list[str] = []
    parsed: list[str] = []
    for fn in ("read_member", "read_member_head"):
        orig = getattr(scan_pickles, fn)
        monkeypatch.setattr(scan_pickles, fn, lambda f, e, *a, _o=orig, **k: (
            touched.append(e.name), _o(f, e, *a, **k))[1])
    orig_load = scan_pickles.load_pickle_at
    monkeypatch.setattr(scan_pickles, "load_pickle_at", lambda buf, pos=0, what="", **k: (
        parsed.append(what), orig_load(buf, pos, what, **k))[1])
    assert scan_file(path).verdict == SAFE
    assert touched and not [n for n in touched if n.startswith("archive/data/")], touched
    assert parsed == ["archive/data.pkl"]
    touched.clear()
    parsed.clear()
    assert inspect(path).to_dict()["security"]["verdict"] == SAFE
    assert not [n for n in touched if n.startswith("archive/data/")] and parsed == [], (touched, parsed)


def test_needs_trust_only_in_a_hidden_pickle(tmp_path: Path, run_cli) -> None:
    """A class on no list in an extra member: inspect's own globals are allowed, but the file needs trust."""
    path = tmp_path / "extra.pt"
    path.write_bytes(hc.torch_zip(hc.benign_pickle(), extra={"extra.pkl": hc.gadget_pickle("mypkg.models", "Net",
                                                                                             "x", 2)}))
    sec = inspect(path).to_dict()["security"]
    assert sec["verdict"] == NEEDS_TRUST and sec["unknown"] == ["mypkg.models.Net"] and sec["exit_code"] == 4
    r = run_cli("inspect", path)
    assert "Needs trust: a pickle torch.load does not read today" in r.output
