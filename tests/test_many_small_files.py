"""Many small files (issue 52 item 3): ``scan DIR`` and ``inspect DIR`` cost per file one open, a bounded number of
``stat`` calls and the walk, and ``--jobs 2`` of small local work (run in this process, :mod:`ckptool.cli._many`)
does no more per file than ``--jobs 1``: the structural property behind "``--jobs 2`` is not slower", pinned as
counts of system calls rather than as a timing.

Each ``os`` call that names one of the files (``stat``, ``lstat``, ``access``, ``open``) is counted in-process
while the CLI runs; the files are plain pickles of small dicts (no torch).
"""

from __future__ import annotations

import collections
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from test_startup_imports import loaded_modules

from ckptool.formats.detect import check_readable

pytestmark = pytest.mark.torchfree

N = 20


def _folder(tmp_path: Path, name: str = "small") -> Path:
    """``N`` small pickles in a new folder ``name`` (new files: no cache of an earlier run knows them)."""
    folder = tmp_path / name
    folder.mkdir()
    for i in range(N):
        (folder / f"f{i:03d}.pkl").write_bytes(pickle.dumps({"a": i, "b": [1, 2, 3], "c": "x" * 20}))
    return folder


def _counted(monkeypatch: pytest.MonkeyPatch, folder: Path) -> collections.Counter[tuple[str, str]]:
    """A counter of (os function, file name) for every call on a file of ``folder``, filled while the test runs."""
    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    prefix = str(folder) + os.sep

    def wrap(name: str) -> None:
        orig = getattr(os, name)

        def counting(p: Any, *a: Any, **k: Any) -> Any:
            if isinstance(p, (str, os.PathLike)) and os.fspath(p).startswith(prefix):
                calls[(name, os.path.basename(os.fspath(p)))] += 1
            return orig(p, *a, **k)

        monkeypatch.setattr(os, name, counting)

    for name in ("stat", "lstat", "access", "open"):
        wrap(name)
    return calls


def _per_file(calls: collections.Counter[tuple[str, str]], folder: Path) -> dict[str, set[int]]:
    """Each os function -> the set of its call counts over the files (one count when every file costs the same)."""
    names = sorted(p.name for p in folder.iterdir())
    return {fn: {calls[(fn, n)] for n in names} for fn in ("stat", "lstat", "access", "open")}


def _run(run_cli: Any, monkeypatch: pytest.MonkeyPatch, folder: Path, *args: str) -> dict[str, set[int]]:
    with monkeypatch.context() as m:
        calls = _counted(m, folder)
        r = run_cli(*args)
    assert r.exit_code == 0, r.output
    return _per_file(calls, folder)


def test_scan_of_many_small_files_opens_each_once_and_jobs_2_does_no_more(
        tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _folder(tmp_path)
    one = _run(run_cli, monkeypatch, folder, "scan", str(folder))
    two = _run(run_cli, monkeypatch, folder, "scan", str(folder), "--jobs", "2")
    jsonl = _run(run_cli, monkeypatch, folder, "scan", str(folder), "--jsonl")
    for counts in (one, two, jsonl):
        assert counts["open"] == {1}, counts
        assert counts["access"] == {1}, counts  # the walk: can this file be read (else a row says why)
        assert counts["lstat"] == {3}, counts  # the walk: a link?, its real path, a dangling link?
    # per file: the walk's folder test, check_readable's one stat, the open's FIFO/device guard (was 6: issue 52)
    assert one["stat"] == {3}, one
    # --jobs 2 of small local work runs in this process: the same scan, plus one stat for the file's size (the
    # pool's choice and the progress bar), which is where isfile + getsize used to be two
    assert two["stat"] == {4} and jsonl["stat"] == {4}, (two, jsonl)


def test_inspect_of_many_small_files_opens_each_once_and_jobs_2_does_no_more(
        tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # a folder each: inspect remembers each file's format per version (readers.format_of), a second run of the
    # same files would open them once less
    first, second = _folder(tmp_path, "one"), _folder(tmp_path, "two")
    one = _run(run_cli, monkeypatch, first, "inspect", str(first), "--jsonl")
    two = _run(run_cli, monkeypatch, second, "inspect", str(second), "--jsonl", "--jobs", "2")
    assert one == two, (one, two)
    # today three opens a file: the format's first bytes, the pickle read, the scan of it (issue 52 item 3 asks
    # for one; not done yet): pinned so that more is a decision
    assert one["open"] == {3}, one
    # the folder's size stat, the format's (folder? version), per open its check and FIFO/device guard, the scan's
    # folder test, inspect's quantization-config folder test: 11 (one less since per_version took a file's version
    # from its regular-file test's stat)
    assert one["stat"] == {11}, one


def test_check_readable_stats_a_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "small" / "a.pkl"
    path.parent.mkdir()
    path.write_bytes(pickle.dumps({"a": 1}))
    size = path.stat().st_size
    with monkeypatch.context() as m:
        calls = _counted(m, path.parent)
        assert check_readable(str(path)) == size
    assert dict(calls) == {("stat", "a.pkl"): 1}


def test_scan_of_many_small_files_imports_no_cache_pool_or_sarif(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    proc, mods = loaded_modules(["scan", str(folder), "--jobs", "2"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{N} files: {N} safe" in proc.stdout
    assert not {"sqlite3", "ckptool.ops.scan.cache", "concurrent.futures", "ckptool.ops.scan.sarif"} & mods


def _legacy_stream(inner_global: bytes) -> bytes:
    """A legacy ``torch.save`` stream as ``torch.storage`` writes one into ``_load_from_bytes`` (magic number,
    protocol, sys-info, a main pickle naming ``inner_global``, storage keys), written byte by byte (no torch)."""
    magic = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."
    protocol = b"\x80\x02M\xe9\x03."
    sys_info = b"\x80\x02}q\x00."
    main = b"\x80\x02c" + inner_global + b"\nq\x00)Rq\x01."
    keys = b"\x80\x02]q\x00."
    return magic + protocol + sys_info + main + keys


def test_load_from_bytes_stream_is_walked_and_its_gadget_named(tmp_path: Path, run_cli: Any) -> None:
    # docs/performance.md, "The streams inside torch.storage._load_from_bytes": the outer global makes the file
    # dangerous, and the inner stream (here one naming os.system) is walked as the legacy stream it is: its five
    # pickles listed, its gadget named with its where (tests/test_nested_streams.py has the rest)
    inner = _legacy_stream(b"os\nsystem")
    outer = (b"\x80\x02ctorch.storage\n_load_from_bytes\nq\x00B" + len(inner).to_bytes(4, "little") + inner
             + b"q\x01\x85q\x02Rq\x03.")
    path = tmp_path / "t.pkl"
    path.write_bytes(outer)
    r = run_cli("scan", "--json", str(path))
    assert r.exit_code == 1, r.output
    f = json.loads(r.output)["files"][0]
    assert f["verdict"] == "dangerous"
    assert [p["globals"] for p in f["pickles"]] == [["torch.storage._load_from_bytes"], [], [], [], ["os.system"], []]
    assert {g["name"]: g["where"] for g in f["globals"]} == {
        "torch.storage._load_from_bytes": ["pickle at byte 0"],
        "os.system": ["pickle at byte 0!_load_from_bytes call 1!legacy main pickle"]}
