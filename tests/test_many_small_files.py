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
from hypothesis import given, settings
from hypothesis import strategies as st
from test_startup_imports import loaded_modules

from ckptool.formats.detect import check_readable
from ckptool.model.units import text_table

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
        # the walk: one lstat (a link?), which answers its real path (its folder's, resolved once a folder, and its
        # name) and whether it is a dangling link (three lstat a file before, and realpath's of each folder above)
        assert counts["lstat"] == {1}, counts
    # per file: one stat, which answers scan_file's folder test, check_readable and the open's FIFO/device guard
    # (6 before issue 52, then 3)
    assert one["stat"] == {1}, one
    # --jobs 2 of small local work runs in this process: the same scan, plus one stat for the file's size (the
    # pool's choice and the progress bar), which is where isfile + getsize used to be two
    assert two["stat"] == {2} and jsonl["stat"] == {2}, (two, jsonl)


def test_inspect_of_many_small_files_opens_each_once_and_jobs_2_does_no_more(
        tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # a folder each: inspect remembers each file's format per version (readers.format_of), a second run of the
    # same files would open them once less
    first, second = _folder(tmp_path, "one"), _folder(tmp_path, "two")
    one = _run(run_cli, monkeypatch, first, "inspect", str(first), "--jsonl")
    two = _run(run_cli, monkeypatch, second, "inspect", str(second), "--jsonl", "--jobs", "2")
    assert one == two, (one, two)
    # one open a file (issue 52 item 3): inspect reads a file of source.READ_WHOLE_BYTES or less whole inside a
    # source.local_reads block, and its format's first bytes, its pickle read and its scan share those bytes (three
    # opens a file before)
    assert one["open"] == {1}, one
    # the folder's size stat, the format's (folder? version), the one open's check and FIFO/device guard, the scan's
    # folder test, inspect's quantization-config folder test...: 8 (11 before: the two later opens' checks and guards;
    # 9 before the scan's folder test and check_readable shared one stat)
    assert one["stat"] == {8}, one


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
    # nor tarfile (and its shutil, bz2, lzma): a pickle's first bytes fail a tar header's checksum without it
    assert "tarfile" not in mods


def _tar_header(name: str, fmt: int) -> bytes:
    import io
    import tarfile

    bio = io.BytesIO()
    with tarfile.open(fileobj=bio, mode="w", format=fmt) as t:
        info = tarfile.TarInfo(name)
        info.size = 3
        t.addfile(info, io.BytesIO(b"abc"))
    return bio.getvalue()[:512]


def _with_checksum(block: bytearray, signed: bool, how: int) -> bytes:
    """``block`` with its checksum field set to its unsigned or signed sum, written one of three ways."""
    block[148:156] = b" " * 8
    value = sum(b - 256 if signed and b > 127 else b for b in block)
    block[148:156] = ((b"%06o\0 ", b"%07o\0", b" %o\0")[how] % value)[:8].ljust(8, b"\0")
    return bytes(block)


@given(st.sampled_from(["a", "\u00e9" * 30, "x" * 99, ""]), st.sampled_from([0, 1, 2]),
       st.lists(st.tuples(st.integers(0, 511), st.integers(0, 255)), max_size=3),
       st.sampled_from(["as is", "unsigned", "signed", "zeros", "random"]), st.integers(0, 2), st.binary(max_size=40))
@settings(max_examples=400, deadline=None)
def test_is_tar_answers_as_tarfile_does(name: str, fmt: int, edits: list[tuple[int, int]], checksum: str, how: int,
                                        tail: bytes) -> None:
    # detect._surely_not_tar repeats tarfile's first checks so that a file that is no tar need not import it: the
    # classifier's answer is tarfile's own on real, mutated and random headers
    import tarfile

    from ckptool.formats.detect import is_tar

    if checksum == "random":
        block = bytearray((tail * 13)[:512].ljust(512, b"\x80"))
    elif checksum == "zeros":
        block = bytearray(512)
    else:
        block = bytearray(_tar_header(name or "n", (tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT)[fmt]))
    for at, value in edits:
        block[at] = value
    if checksum in ("unsigned", "signed"):
        data = _with_checksum(block, checksum == "signed", how)
    else:
        data = bytes(block)
    data = data if name else data[:len(tail)]  # "": a short head (a file under 512 bytes)
    try:
        tarfile.TarInfo.frombuf(data, "utf-8", "surrogateescape")
        want = True
    except tarfile.HeaderError as e:
        want = type(e).__name__ == "EOFHeaderError"
    assert is_tar(data) == want


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


# -- the text report's tables without tabulate (issue 52: a table a file of a folder's scan) --------------------
_CELL_TEXT = st.text(alphabet="abcXYZ0123456789.,_-+ eE\u00e9\n\x1b[m", max_size=10) | st.sampled_from(
    ["True", "False", "nan", "inf", "1,000", "1_0", "0x1", "", " a", "a ", "1e5", "-3", "DANGEROUS",
     "torch.storage._load_from_bytes", "pickle at byte 0"])


@given(st.integers(1, 5).flatmap(lambda n: st.tuples(
    st.lists(_CELL_TEXT, min_size=n, max_size=n),
    st.lists(st.lists(_CELL_TEXT, min_size=n, max_size=n).map(tuple), min_size=1, max_size=4))),
    st.booleans())
@settings(max_examples=400, deadline=None)
def test_text_table_is_tabulates_table(table: tuple[list[str], list[tuple[str, ...]]], numparse: bool) -> None:
    from tabulate import tabulate

    headers, rows = table
    assert text_table(rows, headers, numparse=numparse) == tabulate(rows, headers=headers,
                                                                    disable_numparse=not numparse)


def test_text_table_writes_plain_text_columns_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    import tabulate

    rows = [("DANGEROUS", "os.system", "runs a shell command", "pickle at byte 0"), ("needs-trust", "a.B", "c", "12")]
    want = tabulate.tabulate(rows, headers=["level", "global", "why", "in"])
    monkeypatch.setattr(tabulate, "tabulate", None)  # the plain table does not call it
    assert text_table(rows, ["level", "global", "why", "in"]) == want


def test_text_table_remembers_a_small_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # a folder of like files prints the same table of globals for each: its cells are tested once (issue 52)
    from ckptool.model import units

    rows = [("DANGEROUS", "torch.storage._load_from_bytes", "unpickles bytes", "pickle at byte 0")]
    first = text_table(rows, ["level", "global", "why", "in"])

    def tested(cell: object) -> bool:
        raise AssertionError("a remembered table is not written again")

    monkeypatch.setattr(units, "_is_plain_cell", tested)
    assert text_table([list(r) for r in rows], ["level", "global", "why", "in"]) == first
    with pytest.raises(AssertionError):  # another table is written
        text_table(rows, ["level", "global", "why", "where"])


def test_scan_of_many_dangerous_small_files_imports_no_tabulate(tmp_path: Path) -> None:
    # a table a file (each file names os.system) and the folder's table, all of plain text: written without tabulate
    folder = tmp_path / "bad"
    folder.mkdir()
    for i in range(3):
        (folder / f"f{i}.pkl").write_bytes(b"\x80\x02cos\nsystem\nq\x00.")
    proc, mods = loaded_modules(["scan", str(folder)], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "3 files: 0 safe, 0 need trust, 3 dangerous" in proc.stdout
    assert "DANGEROUS  os.system" in proc.stdout
    assert "tabulate" not in mods


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_text_report_does_not_look_for_key_paths_json_does(tmp_path: Path, run_cli: Any,
                                                           monkeypatch: pytest.MonkeyPatch, jobs: str) -> None:
    # key paths (where in each pickle's object a global not allowed is used) are in --json, --jsonl and SARIF, not
    # in the text report: its scan does not walk the object graphs for them (issue 52), and says the same
    import ckptool.scanning.pickles as pickles

    folder = tmp_path / "bad"
    folder.mkdir()
    for i in range(2):
        (folder / f"f{i}.pkl").write_bytes(pickle.dumps({"cmd": os.system}, protocol=2))
    real = pickles.key_paths
    walked: list[int] = []

    def counted(root: Any, names: set[str]) -> dict[str, list[str]]:
        walked.append(1)
        return real(root, names)

    monkeypatch.setattr(pickles, "key_paths", counted)
    text = run_cli("scan", str(folder), "--jobs", jobs)
    assert text.exit_code == 1 and "DANGEROUS  posix.system" in text.output, text.output
    assert walked == []
    js = run_cli("scan", str(folder), "--json", "--jobs", jobs)
    assert [f["pickles"][0]["key_paths"] for f in json.loads(js.output)["files"]] == [{"posix.system": ["cmd"]}] * 2
    assert len(walked) == 2


def test_whole_view_reads_a_small_file_and_maps_a_big_one(tmp_path: Path) -> None:
    # a scan of many small files maps none of them (a read costs about half a map and unmap: issue 52)
    import mmap

    from ckptool import _source as source

    small, big = tmp_path / "small.pkl", tmp_path / "big.pkl"
    small.write_bytes(b"\x80\x04K\x01." + b"\x00" * 100)
    big.write_bytes(b"\x80\x04K\x01." + b"\x00" * source.READ_WHOLE_BYTES)
    for path, kind in ((small, bytes), (big, mmap.mmap)):
        with source.open_binary(str(path)) as f, source.whole_view(f) as buf:
            assert type(buf) is kind
            assert bytes(buf[:5]) == b"\x80\x04K\x01." and len(buf) == path.stat().st_size


@pytest.mark.parametrize("seconds, most", [(60.0, 5), (0.0, N + 4)])
def test_rows_of_many_files_are_written_together_yet_as_they_come(
        tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch, seconds: float, most: int) -> None:
    # --jobs 2 prints each file's row as it finishes; rows that finish within FLUSH_SECONDS of the last write go out
    # in one write (was a flushed write a row: issue 52); with FLUSH_SECONDS 0, one write a row as before
    import click

    from ckptool.cli import _many

    folder = _folder(tmp_path)
    want = run_cli("scan", str(folder)).output
    writes: list[str] = []
    real = click.echo

    def echo(message: Any = None, *a: Any, **k: Any) -> None:
        writes.append(str(message))
        real(message, *a, **k)

    monkeypatch.setattr(_many, "FLUSH_SECONDS", seconds)
    monkeypatch.setattr(click, "echo", echo)
    r = run_cli("scan", str(folder), "--jobs", "2")
    assert r.output == want  # the same text as --jobs 1
    assert len(writes) <= most and (seconds or len(writes) == most), len(writes)


# -- --jobs N of many small local files: shared with children forked from this process (issue 52 item 2) ---------
@pytest.fixture
def only_this_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork tests see this process as running one thread: an earlier test may leave a daemon thread that waits
    (fsspec's IO loop, ``fsspecIO``), and --jobs then scans in one process (ManyRun._forked), which is right for a
    run but would make these tests depend on the order they run in. The children scan local files only."""
    import threading

    monkeypatch.setattr(threading, "active_count", lambda: 1)


@pytest.mark.usefixtures("only_this_thread")
def test_jobs_3_where_the_second_fork_fails_scans_every_file(tmp_path: Path, run_cli: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # a child that cannot be started leaves its slice to this process, after the started children's, in order
    from ckptool import _fork

    if not hasattr(os, "fork"):
        pytest.skip("no os.fork on this platform: --jobs runs small local work in this process")
    folder = _folder(tmp_path)
    want = run_cli("scan", str(folder)).output
    monkeypatch.setattr(_fork, "FORK_FILES_PER_JOB", 5)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    real_fork, calls = os.fork, []

    def fork() -> int:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("no more processes")
        return real_fork()

    monkeypatch.setattr(os, "fork", fork)
    got = run_cli("scan", str(folder), "--jobs", "3")
    assert len(calls) == 2 and got.exit_code == 0
    assert got.output == want and f"{N} files: {N} safe" in got.output


def test_jobs_chooses_this_process_forked_children_or_a_pool_by_the_work(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool._fork import FORK_FILES_PER_JOB
    from ckptool.cli import _many
    from ckptool.ops.scan.many import ScanRun

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    few, many = tmp_path / "few", tmp_path / "many"
    for folder, n in ((few, FORK_FILES_PER_JOB * 2 - 1), (many, FORK_FILES_PER_JOB * 2)):
        folder.mkdir()
        for i in range(n):
            (folder / f"f{i:03d}.pkl").write_bytes(pickle.dumps({"a": i}))

    def choice(folder: Path, jobs: int, **kw: Any) -> tuple[Any, int]:
        run = ScanRun([str(folder)], **kw)
        pool = _many._executor(run, jobs)
        if pool is not None:
            pool.shutdown()
        return type(pool).__name__ if pool is not None else None, run.forks

    assert choice(many, 1) == (None, 1)  # --jobs 1: this process
    assert choice(few, 2) == (None, 1)  # too few files to repay a fork
    assert choice(many, 2) == (None, 2)  # many small files: this process and one forked child
    assert choice(many, 8) == (None, 2)  # each process gets FORK_FILES_PER_JOB files at least
    from ckptool.ops.scan.cache import ScanCache

    cache = ScanCache(str(tmp_path / "cache.db"))
    try:
        assert choice(many, 2, cache=cache) == (None, 1)  # the cache is read and written by this process only
    finally:
        cache.close()
    monkeypatch.setattr(_many, "PROCESS_BYTES_PER_JOB", 1)  # big local work: a pool of processes, no forks
    assert choice(many, 2) == ("ProcessPoolExecutor", 1)


def _counted_forks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pids of the children ``os.fork`` starts from now on (in this process, the parent), appended as they are."""
    forks: list[int] = []
    real_fork = os.fork

    def fork() -> int:
        pid = real_fork()
        if pid:
            forks.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", fork)
    return forks


@pytest.mark.parametrize("child_fails", [False, True])
@pytest.mark.usefixtures("only_this_thread")
def test_jobs_2_shares_many_small_files_with_a_forked_child_and_prints_as_jobs_1(
        tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch, child_fails: bool) -> None:
    from ckptool import _fork

    if not hasattr(os, "fork"):
        pytest.skip("no os.fork on this platform: --jobs runs small local work in this process")
    folder = _folder(tmp_path)
    (folder / "z_evil.pkl").write_bytes(b"\x80\x02cos\nsystem\nq\x00.")  # dangerous, last: the child's slice
    want = [run_cli("scan", str(folder), *args) for args in ((), ("--json",))]
    monkeypatch.setattr(_fork, "FORK_FILES_PER_JOB", 5)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    forks = _counted_forks(monkeypatch)
    if child_fails:  # a child that fails sends nothing: its slice is scanned in this process, nothing is lost
        def fail(task: Any, targets: Any) -> bytes:
            raise RuntimeError("the child failed")

        monkeypatch.setattr(_fork, "_slice_results", fail)
    got = [run_cli("scan", str(folder), "--jobs", "2", *args) for args in ((), ("--json",))]
    assert len(forks) == 2  # one child a run
    assert [r.exit_code for r in got] == [r.exit_code for r in want] == [1, 1]
    assert got[0].output == want[0].output
    assert json.loads(got[1].output) == json.loads(want[1].output)


@pytest.mark.usefixtures("only_this_thread")
def test_scan_without_jobs_shares_many_files_among_the_usable_cpus_and_prints_as_jobs_1(
        tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 52: without --jobs, a folder of many local files is shared among forked processes, one per usable CPU
    # (the text report, --json and SARIF as with --jobs 1); --jobs 1, a single file and a few files are not
    from ckptool import _fork
    from ckptool.cli import scan as scan_cli

    if not hasattr(os, "fork"):
        pytest.skip("no os.fork on this platform: a scan runs in this process")
    folder = _folder(tmp_path)
    (folder / "z_evil.pkl").write_bytes(b"\x80\x02cos\nsystem\nq\x00.")  # dangerous, last: a child's slice
    args = [(), ("--json",), ("--format", "sarif")]
    want = [run_cli("scan", str(folder), "--jobs", "1", *a) for a in args]
    monkeypatch.setattr(_fork, "FORK_FILES_PER_JOB", 5)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    monkeypatch.setattr(scan_cli, "usable_cpus", lambda: 3)
    forks = _counted_forks(monkeypatch)
    got = [run_cli("scan", str(folder), *a) for a in args]
    assert len(forks) == 2 * len(args)  # this process and two children a run
    assert [r.exit_code for r in got] == [r.exit_code for r in want] == [1, 1, 1]
    assert got[0].output == want[0].output
    assert json.loads(got[1].output) == json.loads(want[1].output)
    assert json.loads(got[2].output)["runs"][0]["results"] == json.loads(want[2].output)["runs"][0]["results"]
    forks.clear()
    run_cli("scan", str(folder), "--jobs", "1")
    run_cli("scan", str(folder / "f000.pkl"))
    assert not forks


def test_local_reads_share_one_open_of_a_small_file_and_not_of_a_big_one(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool import _source as source

    small, big = tmp_path / "small.pkl", tmp_path / "big.pkl"
    small.write_bytes(b"\x80\x04K\x01.")
    big.write_bytes(b"\x80\x04K\x01." + b"\x00" * source.READ_WHOLE_BYTES)
    calls = _counted(monkeypatch, tmp_path)
    for path in (small, big):
        with source.local_reads(str(path)):
            for _ in range(3):
                with source.open_binary(str(path)) as f:
                    assert f.read(5) == b"\x80\x04K\x01." and f.name == str(path)
                    f.seek(0, os.SEEK_END)
                    assert f.tell() == path.stat().st_size
        with source.open_binary(str(path)) as f:  # after the block: its own open
            assert f.read(2) == b"\x80\x04"
    assert calls[("open", "small.pkl")] == 2 and calls[("open", "big.pkl")] == 4
    assert not source._held_files  # nothing held after the blocks


def test_a_global_named_by_many_files_is_rated_once(tmp_path: Path, run_cli: Any) -> None:
    # rate_global reads fixed tables only: its answer for a name is remembered (issue 52), long names excepted
    from ckptool.model import allowlist

    folder = tmp_path / "bad"
    folder.mkdir()
    for i in range(4):
        (folder / f"f{i}.pkl").write_bytes(b"\x80\x02cos\nsystem\nq\x00.")
    allowlist._rate_remembered.cache_clear()
    assert run_cli("scan", str(folder)).exit_code == 1
    info = allowlist._rate_remembered.cache_info()
    assert info.misses == 1 and info.hits == 3, info
    long_name = "pkg." + "a" * allowlist.RATED_NAME_CHARS
    assert allowlist.rate_global(long_name) == allowlist._rate(long_name, True, False, False)
    assert allowlist._rate_remembered.cache_info().currsize == 1  # not remembered


@pytest.mark.parametrize("head", [
    pickle.dumps(0x1950A86A20F9469CFC6C, protocol=3), pickle.dumps(0x1950A86A20F9469CFC6C, protocol=4),
    pickle.dumps(0x1950A86A20F9469CFC6C, protocol=5),
    b"\x80\x04I119547037146038801333356\n.", b"\x80\x03L119547037146038801333356L\n.",
    b"\x80\x04I0x1950A86A20F9469CFC6C\n.", b"\x80\x04I1_19547037146038801333356\n.",
    b"\x80\x04\x8b\x0c\x00\x00\x00l\xfc\x9cF\xf9 j\xa8P\x19\x00\x00.", b"\x80\x05N0\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.",
])
def test_the_legacy_magic_number_is_found_in_any_spelling(head: bytes) -> None:
    from ckptool.formats.detect import is_legacy_stream

    assert is_legacy_stream(head + b"\x80\x02}q\x00.")


def test_a_plain_pickle_is_no_legacy_stream_without_being_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # no INT/LONG/LONG1/LONG4 opcode byte in its first 64 bytes: it makes no int as large as the magic number
    from ckptool.formats import detect

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("read")

    head = pickle.dumps({"step": 1, "w": "x" * 60}, protocol=4)
    monkeypatch.setattr(detect, "load_pickle_at", refuse)
    assert not detect.is_legacy_stream(head)
    with pytest.raises(AssertionError):
        detect.is_legacy_stream(pickle.dumps(7, protocol=4) + b"L")  # a LONG byte in the head: read
