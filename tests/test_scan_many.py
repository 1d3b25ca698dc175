"""Scanning many checkpoints in one run (issue 38): ``ckptool scan`` of folders and URL prefixes with ``--jobs``,
``--jsonl`` and ``--cache``, and :func:`ckptool.scan_many` on any executor (threads, processes, a Dask cluster).

The checkpoints are plain pickles written here byte by byte (no torch): a safe one names no global, the malicious
one names ``os.system`` (never run: scanning imports nothing). The servers (moto's S3, the HTTP server that lists
folders) are the fixtures of ``remote_servers.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import ckptool
from ckptool.ops.scan.cache import ScanCache, local_version, result_from_dict

pytestmark = pytest.mark.torchfree

ROOT = Path(__file__).resolve().parent.parent
#: a pickle whose load would call os.system("true")
EVIL = b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03."


def _safe(i: int) -> bytes:
    return pickle.dumps({"step": i, "weights": [float(i)] * (i % 7)}, protocol=2)


def _bucket(folder: Path, n: int = 200, evil_at: int = 137) -> dict[str, bytes]:
    """``n`` checkpoints (one malicious, at ``evil_at``), one damaged, a README and an unnamed pickle; written to
    ``folder``; name -> bytes."""
    files = {f"m{i:03d}/model.pt": EVIL if i == evil_at else _safe(i) for i in range(n)}
    files["broken.pt"] = b"\x80\x02}q\x00(X\x01\x00\x00"  # cut short
    files["README.md"] = b"# not a checkpoint\n"
    files["weights"] = _safe(999)  # no suffix: a checkpoint by its content
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return files


def _lines(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def _verdicts(rows: list[dict[str, Any]]) -> dict[str, str]:
    return {r["path"].rsplit("/", 2)[-2] if r["path"].endswith("model.pt") else r["path"].rsplit("/", 1)[-1]:
            r["verdict"] for r in rows}


def _check_bucket(rows: list[dict[str, Any]], n: int = 200, evil_at: int = 137) -> None:
    v = _verdicts(rows)
    assert v.pop(f"m{evil_at:03d}") == "dangerous"
    assert v.pop("broken.pt") == "incomplete"  # cut short: scan's incomplete verdict (issue 36)
    assert v.pop("weights") == "safe"
    assert len(v) == n - 1 and set(v.values()) == {"safe"}, v


# ------------------------------------------------------------------------------------------------ local folders
def test_folder_with_jobs_jsonl_finds_the_one_malicious_file(tmp_path: Path, run_cli: Any) -> None:
    _bucket(tmp_path)
    r = run_cli("scan", str(tmp_path), "--jobs", "2", "--jsonl")
    assert r.exit_code == 1, r.output
    rows = _lines(r.output)
    assert len(rows) == 202 and all(set(row) >= {"path", "verdict", "globals", "pickles"} for row in rows)
    _check_bucket([row for row in rows if not row["path"].endswith("README.md")])


def test_missing_path_is_a_row_and_the_rest_is_scanned(tmp_path: Path, run_cli: Any) -> None:
    (tmp_path / "a.pt").write_bytes(_safe(1))
    r = run_cli("scan", str(tmp_path / "a.pt"), str(tmp_path / "gone.pt"), "--jsonl")
    rows = {Path(row["path"]).name: row for row in _lines(r.output)}
    assert rows["a.pt"]["verdict"] == "safe"
    assert rows["gone.pt"]["verdict"] == "error" and "no such file" in rows["gone.pt"]["error"]
    assert r.exit_code == 2


def test_text_mode_streams_reports_then_table_and_counts(tmp_path: Path, run_cli: Any) -> None:
    (tmp_path / "a.pt").write_bytes(_safe(1))
    (tmp_path / "b.pt").write_bytes(EVIL)
    r = run_cli("scan", str(tmp_path), "--jobs", "2")
    assert r.exit_code == 1
    assert "b.pt: DANGEROUS" in r.output and "a.pt: safe" in r.output
    assert r.output.rstrip().endswith("2 files: 1 safe, 0 need trust, 1 dangerous, 0 unreadable")
    sarif = json.loads(run_cli("scan", str(tmp_path), "--jobs", "2", "--format", "sarif").output)
    assert [x["ruleId"] for x in sarif["runs"][0]["results"]].count("CKPT001") >= 1


def test_jsonl_with_json_is_refused(tmp_path: Path, run_cli: Any) -> None:
    (tmp_path / "a.pt").write_bytes(_safe(1))
    r = run_cli("scan", str(tmp_path), "--jsonl", "--json")
    assert r.exit_code == 2 and "--jsonl and --json ask for two outputs" in r.output


def test_one_path_prints_what_it_printed(tmp_path: Path, run_cli: Any) -> None:
    (tmp_path / "a.pt").write_bytes(EVIL)
    plain = run_cli("scan", str(tmp_path / "a.pt"))
    assert plain.exit_code == 1 and plain.output.startswith(f"{tmp_path / 'a.pt'}: DANGEROUS")
    assert "files:" not in plain.output  # no table, no summary for one file


# ------------------------------------------------------------------------------------------------ the API
def test_scan_many_on_threads_matches_the_serial_run(tmp_path: Path) -> None:
    _bucket(tmp_path, n=30, evil_at=7)
    serial = {r.path: r.to_dict() for r in ckptool.scan_many([tmp_path])}
    with ThreadPoolExecutor(4) as pool:
        threaded = {r.path: r.to_dict() for r in ckptool.scan_many([tmp_path], executor=pool)}
    assert serial == threaded and len(serial) == 32
    assert serial[str(tmp_path / "m007" / "model.pt")]["verdict"] == "dangerous"


def test_scan_many_on_a_dask_local_cluster_matches_the_serial_run(tmp_path: Path) -> None:
    distributed = pytest.importorskip("distributed")
    _bucket(tmp_path, n=20, evil_at=3)
    serial = {r.path: r.to_dict() for r in ckptool.scan_many([tmp_path])}
    env = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env]))  # the workers import this ckptool
    try:
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as \
                cluster, distributed.Client(cluster) as client:
            spread = {r.path: r.to_dict() for r in ckptool.scan_many([tmp_path], executor=client.get_executor())}
    finally:
        os.environ["PYTHONPATH"] = env
    assert spread == serial and len(serial) == 22


def test_cached_result_round_trips(tmp_path: Path) -> None:
    (tmp_path / "a.pt").write_bytes(EVIL)
    res = ckptool.scan_file(tmp_path / "a.pt")
    back = result_from_dict(json.loads(json.dumps(res.to_dict())))
    assert back.to_dict() == res.to_dict() and back.verdict == "dangerous" and back.exit_code == 1


# ------------------------------------------------------------------------------------------------ the cache
def test_cache_answers_unchanged_files_and_rescans_a_changed_one(tmp_path: Path, run_cli: Any) -> None:
    folder = tmp_path / "ckpts"
    folder.mkdir()
    for i in range(5):
        (folder / f"{i}.pt").write_bytes(_safe(i))
    db = str(tmp_path / "scans.sqlite")
    first = run_cli("scan", str(folder), "--cache", db)
    assert first.exit_code == 0 and "0 of 5 answered from the cache" in first.output
    second = run_cli("scan", str(folder), "--cache", db)
    assert second.exit_code == 0 and "5 of 5 answered from the cache" in second.output
    (folder / "3.pt").write_bytes(EVIL)  # replaced: another size and modification time
    third = run_cli("scan", str(folder), "--cache", db)
    assert third.exit_code == 1 and "4 of 5 answered from the cache" in third.output
    assert f"{folder / '3.pt'}: DANGEROUS" in third.output


def test_two_concurrent_runs_share_one_cache(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    _bucket(folder, n=60, evil_at=5)
    db = tmp_path / "scans.sqlite"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "ckptool", "scan", str(folder), "--jsonl", "--cache", str(db)]
    runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
            for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in runs]
    for p, (out, err) in zip(runs, outs):
        assert p.returncode == 1, err
        _check_bucket([r for r in _lines(out) if not r["path"].endswith("README.md")], n=60, evil_at=5)
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT count(*) FROM scans").fetchone()[0] == 62
    cache = ScanCache(db)
    try:
        st = (folder / "m005" / "model.pt").stat()
        found, res = cache.get(ScanCache.key(str(folder / "m005" / "model.pt"), st.st_size, local_version(st)))
    finally:
        cache.close()
    assert found and res is not None and res.verdict == "dangerous"


def test_cache_that_is_no_database_is_one_error_line(tmp_path: Path, run_cli: Any) -> None:
    (tmp_path / "a.pt").write_bytes(_safe(1))
    bad = tmp_path / "not.sqlite"
    bad.write_bytes(b"this is not a database, but it is long enough to have a header" * 20)
    r = run_cli("scan", str(tmp_path / "a.pt"), "--cache", str(bad))
    assert r.exit_code != 0 and r.output.startswith("Error:") and "scan cache" in r.output


# ------------------------------------------------------------------------------------------------ buckets
@pytest.fixture
def remote() -> None:
    pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    pytest.importorskip("aiohttp")


def test_s3_bucket_of_200_with_one_malicious_object(remote: None, request: pytest.FixtureRequest,
                                                    run_cli: Any, tmp_path: Path) -> None:
    s3 = request.getfixturevalue("s3")
    files = _bucket(tmp_path)
    s3.pipe({f"ckpt/scan38/{name}": data for name, data in files.items()})
    r = run_cli("scan", "s3://ckpt/scan38/", "--jobs", "8", "--jsonl")
    assert r.exit_code == 1, r.output
    rows = _lines(r.output)
    assert len(rows) == 202  # the README is no checkpoint by its content: skipped
    _check_bucket(rows)
    assert all(row["path"].startswith("s3://ckpt/scan38/") and row["bytes_read"] > 0 for row in rows)
    db = str(tmp_path / "scans.sqlite")
    assert run_cli("scan", "s3://ckpt/scan38/", "--jobs", "8", "--cache", db).exit_code == 1
    again = run_cli("scan", "s3://ckpt/scan38/", "--jobs", "8", "--cache", db, "--jsonl")
    assert again.exit_code == 1 and all(row["bytes_read"] == 0 for row in _lines(again.output))  # the listing only
    text = run_cli("scan", "s3://ckpt/scan38/", "--jobs", "8")
    assert text.output.rstrip().splitlines()[-2:] == [
        "202 files: 200 safe, 0 need trust, 1 dangerous, 0 unreadable, 1 incomplete",
        "skipped 1 object(s) under the prefixes that are no checkpoint by their content"]


def test_http_prefix_cache_reads_nothing_the_second_time(remote: None, request: pytest.FixtureRequest,
                                                        run_cli: Any, tmp_path: Path) -> None:
    from remote_servers import url

    http = request.getfixturevalue("http")
    folder = http.root / "scan38"
    _bucket(folder, n=20, evil_at=4)
    db = str(tmp_path / "scans.sqlite")
    before = http.sent
    first = run_cli("scan", url(http, "scan38/"), "--jobs", "4", "--jsonl", "--cache", db)
    assert first.exit_code == 1
    _check_bucket(_lines(first.output), n=20, evil_at=4)
    read = http.sent - before
    assert read > 0
    before = http.sent
    second = run_cli("scan", url(http, "scan38/"), "--jobs", "4", "--jsonl", "--cache", db)
    assert _lines(second.output) and all(row["bytes_read"] == 0 for row in _lines(second.output))
    _check_bucket(_lines(second.output), n=20, evil_at=4)
    listing = http.sent - before
    assert listing < read // 4  # only the index pages: no object was read
    (folder / "m010" / "model.pt").write_bytes(EVIL + b"\x00" * 3)  # replaced: another size and ETag
    third = run_cli("scan", url(http, "scan38/"), "--jsonl", "--cache", db)
    rows = {row["path"].rsplit("/", 2)[-2]: row for row in _lines(third.output)}
    assert rows["m010"]["verdict"] == "dangerous" and rows["m010"]["bytes_read"] > 0
    assert rows["m011"]["bytes_read"] == 0


def test_progress_bar_counts_files_and_bytes(tmp_path: Path, run_cli: Any) -> None:
    for i in range(3):
        (tmp_path / f"{i}.pt").write_bytes(_safe(i))
    r = run_cli("scan", str(tmp_path), "--jsonl", "--progress")
    assert r.exit_code == 0 and len(_lines(r.stdout)) == 3
    stored = sum(len(_safe(i)) for i in range(3))
    assert "3/3" in r.stderr and f"{stored} B of {stored} B" in r.stderr, r.stderr
