"""The regression check of ``benchmarks/bench.py --against REF`` (``benchmarks/regression.py``).

The end-to-end tests build a small git repository in ``tmp_path`` holding a stand-in ``ckptool`` package (its
``__main__`` sleeps, allocates or fails on purpose), so that a known slowdown, a known extra allocation and a known
failure must show up as REGRESSION / n/a, and a faster current side as no regression; the real checkpoints and
torch are not needed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import regression  # benchmarks/ is no package: its folder is put on sys.path above

_NO_TOOLS = shutil.which("git") is None or shutil.which("tar") is None
pytestmark = [pytest.mark.torchfree, pytest.mark.skipif(_NO_TOOLS, reason="needs git and tar")]

WRITE = "if 'remap' in sys.argv:\n    open(sys.argv[sys.argv.index('-o') + 1], 'wb').write(b'x')\n"
FAIL = "if 'remap' in sys.argv:\n    print('Error: remap broke on purpose', file=sys.stderr)\n    raise SystemExit(1)\n"
FAST = "import sys\n" + WRITE
#: 0.5 s and 96 MiB more than FAST (every page of the buffer written)
SLOW = "import sys, time\nblob = bytearray(96 << 20)\nblob[::4096] = b'x' * len(blob[::4096])\ntime.sleep(0.5)\n"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def _repo(tmp_path: Path, *mains: str) -> Path:
    """A git repository with one commit per entry of ``mains`` (the stand-in ``ckptool/__main__.py``)."""
    repo = tmp_path / "repo"
    (repo / "ckptool").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "ckptool" / "__init__.py").write_text("")
    for i, main in enumerate(mains):
        (repo / "ckptool" / "__main__.py").write_text(main)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"commit {i}")
    return repo


def _files(tmp_path: Path) -> dict[str, dict[str, object]]:
    big, many = tmp_path / "big.pt", tmp_path / "many.pt"
    big.write_bytes(b"b" * 4096)
    many.write_bytes(b"m" * 100)
    return {"1": {"path": str(big), "tensors": 1, "rows": 1, "cols": 1024, "bytes": 4096},
            "2": {"path": str(many), "tensors": 5, "bytes": 100}}


#: runs the comparison in a fresh process: a child's ``ru_maxrss`` starts at its parent's peak (see bench.py), and
#: pytest's own, after other tests imported torch, would hide the stand-in's allocation
_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
import regression
ref, files, work, repo = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
doc = regression.run(ref, files, work, 1, 1.10, 1.05, lambda _m: None, figures=("inspect", "remap"), repo=repo,
                     current_root=repo)
print(json.dumps(doc))
"""


def _run(tmp_path: Path, repo: Path, ref: str = "HEAD~1") -> dict[str, Any]:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    p = subprocess.run([sys.executable, "-c", _RUN, str(BENCH), ref, json.dumps(_files(tmp_path)), str(work),
                        str(repo)], capture_output=True, text=True, check=True, timeout=120)
    doc: dict[str, Any] = json.loads(p.stdout)
    return doc


def _row(doc: dict[str, Any], start: str) -> dict[str, Any]:
    (row,) = [r for r in doc["rows"] if r["figure"].startswith(start)]
    return row


def test_verdict_against_the_tolerance() -> None:
    assert regression.verdict(1.10, 1.0, 1.10) == pytest.approx((1.10, "no regression"))
    assert regression.verdict(1.2, 1.0, 1.10) == (pytest.approx(1.2), "REGRESSION")
    assert regression.verdict(0.5, 1.0, 1.10) == (0.5, "no regression")
    assert regression.verdict(None, 1.0, 1.10) == (None, "n/a")
    assert regression.verdict(1.0, 0.0, 1.10) == (None, "n/a")


def test_a_slower_current_side_is_a_regression_and_its_failure_is_reported(tmp_path: Path) -> None:
    repo = _repo(tmp_path, FAST, SLOW + FAIL)  # HEAD~1 is fast, the working tree (= HEAD) is slow, its remap fails
    doc = _run(tmp_path, repo)
    assert doc["skipped"] is None and doc["identical"] is False
    time_row, rss_row = _row(doc, "inspect --json, 5 tensors: wall s"), _row(doc, "inspect --json, 5 tensors: peak")
    assert time_row["verdict"] == "REGRESSION" and time_row["ratio"] > 1.10
    assert rss_row["verdict"] == "REGRESSION" and rss_row["current"] > rss_row["ref"] + 64
    remap = _row(doc, "remap --to cpu, 0.00 GiB: wall s")
    assert remap["verdict"] == "n/a (current failed: Error: remap broke on purpose)"
    assert doc["regression"] and doc["current_failed"]
    assert regression.exit_status(doc, fail_on_regression=True) == 1
    assert regression.exit_status(doc, fail_on_regression=False) == 0  # reported, not failed
    text = regression.report_text(doc, lambda rows, headers, _align: "\n".join(map(str, [headers, *rows])))
    assert "HEAD~1 (" in text and "REGRESSION" in text


def test_a_faster_current_side_is_no_regression(tmp_path: Path) -> None:
    repo = _repo(tmp_path, SLOW + WRITE, FAST)
    doc = _run(tmp_path, repo)
    assert {r["verdict"] for r in doc["rows"]} == {"no regression"}
    assert not doc["regression"] and not doc["current_failed"]
    assert regression.exit_status(doc, fail_on_regression=True) == 0


def test_the_ref_side_runs_the_exported_package(tmp_path: Path) -> None:
    repo = _repo(tmp_path, FAST)
    (repo / "ckptool" / "__main__.py").write_text(SLOW + WRITE)  # uncommitted: only the current side sees it
    doc = _run(tmp_path, repo, ref="HEAD")
    assert doc["current"].endswith("+ uncommitted changes to ckptool/)") and doc["identical"] is False
    assert _row(doc, "inspect --json, 5 tensors: wall s")["verdict"] == "REGRESSION"
    assert not list((tmp_path / "work").iterdir())  # the export is removed afterwards


def test_an_unresolvable_ref_is_skipped_with_the_reason(tmp_path: Path) -> None:
    repo = _repo(tmp_path, FAST)  # one commit: HEAD~1 does not exist
    doc = _run(tmp_path, repo)
    assert doc["skipped"] == f"'HEAD~1' names no commit in {repo}"
    assert regression.exit_status(doc, fail_on_regression=True) == 0  # the default ref: skip, do not fail
    assert regression.exit_status(_run(tmp_path, repo, ref="nope"), fail_on_regression=False) == 2  # a named one
    assert "skipped ('HEAD~1' names no commit" in regression.report_text(doc, lambda *a: "")


def test_the_remap_figure_needs_an_output(tmp_path: Path) -> None:
    repo = _repo(tmp_path, FAST, "import sys\n")  # the current remap exits 0 and writes nothing
    doc = _run(tmp_path, repo)
    assert _row(doc, "remap --to cpu, 0.00 GiB: wall s")["verdict"].startswith(
        "n/a (current failed: remap exited 0 but wrote no ")


def test_no_git_checkout_is_skipped(tmp_path: Path) -> None:
    plain = tmp_path / "copy"
    (plain / "ckptool").mkdir(parents=True)  # like .ci/run's copy: the files, no .git
    with pytest.raises(regression.Skipped, match="is not a git checkout"):
        regression.resolve_ref("HEAD~1", str(plain))


def test_a_copy_inside_another_repository_is_no_checkout(tmp_path: Path) -> None:
    repo = _repo(tmp_path, FAST, SLOW + WRITE)
    copy = repo / "copy"  # a copy of the files inside another checkout: that one's history is not this copy's
    (copy / "ckptool").mkdir(parents=True)
    with pytest.raises(regression.Skipped, match=r"is not a git checkout .*the enclosing one is"):
        regression.resolve_ref("HEAD~1", str(copy))
