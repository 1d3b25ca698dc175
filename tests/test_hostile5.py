"""Hostile inputs, round 5 (issue 50): what a scan did not see is never called safe, the scan cache is a hint and
never an authority, and the numbers the merge commands take are finite."""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ckptool.ops.scan.many import ScanRun

pytestmark = pytest.mark.torchfree
#: the few cases that merge (merge-lora, average --method need the torch extra): skipped by the torch-free jobs only
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="merges: needs the torch extra")

EVIL = b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03."


def _folder(top: Path) -> Path:
    (top / "ok").mkdir(parents=True)
    (top / "hidden").mkdir()
    (top / "ok" / "good.pt").write_bytes(pickle.dumps({"a": 1}, protocol=2))
    (top / "hidden" / "evil.pt").write_bytes(EVIL)
    return top


@pytest.fixture
def unlistable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder whose subfolder ``hidden`` cannot be listed (``os.scandir`` refuses it, as for a mode-000 folder of
    another user: the test may run as root, who reads everything)."""
    top = _folder(tmp_path / "d")
    real = os.scandir

    def scandir(path: Any = ".") -> Any:
        if os.fspath(path).endswith("hidden"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    return top


@pytest.mark.parametrize("args", [("scan",), ("scan", "--jsonl"), ("scan", "--json"), ("inspect", "--jsonl")])
def test_an_unlistable_subfolder_is_an_error_row(unlistable: Path, run_cli, args: tuple[str, ...]) -> None:
    res = run_cli(*args, unlistable)
    assert res.exit_code != 0, res.output
    assert str(unlistable / "hidden") in res.output
    assert "cannot be listed" in res.output


def test_an_unreadable_file_is_an_error_row(tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    top = _folder(tmp_path / "d")
    shutil.rmtree(top / "hidden")
    (top / "locked.bin").write_bytes(EVIL)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p).endswith("locked.bin")
                        else real(p, mode, **kw))
    res = run_cli("scan", "--jsonl", top)
    assert res.exit_code == 2, res.output
    rows = [json.loads(line) for line in res.output.splitlines()]
    locked = [r for r in rows if r["path"].endswith("locked.bin")]
    assert locked and locked[0]["verdict"] == "error" and "cannot be opened" in locked[0]["error"]


class _BrokenPool(cf.Executor):
    """An executor whose workers cannot start: every submit raises, as a broken process pool does."""

    _max_workers = 2

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        raise BrokenProcessPool("A child process terminated abruptly")


def test_a_pool_that_cannot_start_gives_error_rows(tmp_path: Path) -> None:
    top = _folder(tmp_path / "d")
    shutil.rmtree(top / "hidden")
    rows = list(ScanRun([str(top)], executor=_BrokenPool()))
    assert len(rows) == 1
    _t, res = rows[0]
    assert res is not None and res.verdict == "error" and "BrokenProcessPool" in (res.error or "")


def _second_user() -> Iterator[tuple[int, int]]:
    """A second user's (uid, gid) that can run this interpreter, or a skip."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("the unprivileged run needs root to switch to a second user (the unlistable fixture covers it)")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv to run as a second user")
    if subprocess.run(["id", "ckptool-test"], check=False, capture_output=True).returncode != 0:
        useradd = shutil.which("useradd")
        if useradd is None or subprocess.run([useradd, "-M", "-r", "-s", "/usr/sbin/nologin", "ckptool-test"],
                                             check=False, capture_output=True).returncode != 0:
            pytest.skip("cannot make a second user")
    uid = int(subprocess.run(["id", "-u", "ckptool-test"], check=False, capture_output=True, text=True).stdout)
    gid = int(subprocess.run(["id", "-g", "ckptool-test"], check=False, capture_output=True, text=True).stdout)
    probe = subprocess.run([setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable, "-c",
                            "import ckptool"], check=False, capture_output=True,
                           env={**os.environ, "PYTHONPATH": _repo()})
    if probe.returncode != 0:
        pytest.skip("the second user cannot run this interpreter or import ckptool (a home folder it may not read)")
    yield uid, gid


def _repo() -> str:
    return str(Path(__file__).resolve().parent.parent)


@pytest.fixture
def second_user() -> Iterator[tuple[int, int]]:
    yield from _second_user()


@pytest.mark.parametrize("args", [("scan",), ("scan", "--jsonl"), ("inspect", "--jsonl")])
def test_a_mode_000_subfolder_as_a_second_user(second_user: tuple[int, int], args: tuple[str, ...]) -> None:
    uid, gid = second_user
    top = Path(tempfile.mkdtemp(prefix="ckptool-i50-"))
    try:
        top.chmod(0o755)
        _folder(top)
        for p in (top / "ok", top / "ok" / "good.pt"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        (top / "hidden").chmod(0)
        res = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable, "-m",
                              "ckptool", *args, str(top)], check=False, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": _repo()})
        assert res.returncode not in (0, 3), res.stdout + res.stderr
        assert str(top / "hidden") in res.stdout + res.stderr
    finally:
        (top / "hidden").chmod(stat.S_IRWXU)
        shutil.rmtree(top)


def test_an_s3_key_ending_in_a_slash_with_content_is_an_object(s3: Any, run_cli) -> None:
    s3.pipe("ckpt/slash/ok.pt", pickle.dumps({"a": 1}, protocol=2))
    s3.pipe("ckpt/slash/u/evil/", EVIL)
    res = run_cli("scan", "--jsonl", "s3://ckpt/slash/")
    rows = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    evil = [r for r in rows if r["path"].rstrip("/").endswith("u/evil")]
    assert res.exit_code != 0, res.output
    assert evil and evil[0]["verdict"] in ("dangerous", "error"), rows



# ------------------------------------------------------------------------------------------------ the scan cache
def _cached_folder(tmp_path: Path, run_cli) -> tuple[Path, Path, Path]:
    folder = tmp_path / "m"
    folder.mkdir()
    good = folder / "good.pt"
    good.write_bytes(pickle.dumps({"a": "x" * 64}, protocol=2))
    (folder / "evil.pt").write_bytes(EVIL)
    db = tmp_path / "scans.sqlite"
    first = run_cli("scan", "--jsonl", "--cache", db, folder)
    assert first.exit_code == 1, first.output
    return folder, good, db


def _rows(db: Path) -> list[tuple[str, str]]:
    import sqlite3

    with sqlite3.connect(db) as con:
        return list(con.execute("SELECT key, result FROM scans"))


def _set_rows(db: Path, fn: Any) -> None:
    import sqlite3

    con = sqlite3.connect(db)
    try:
        for key, result in _rows(db):
            con.execute("UPDATE scans SET result = ? WHERE key = ?", (fn(key, result), key))
        con.commit()
    finally:
        con.close()


def test_a_same_size_file_with_its_mtime_set_back_is_scanned_again(tmp_path: Path, run_cli) -> None:
    folder, good, db = _cached_folder(tmp_path, run_cli)
    st = good.stat()
    replacement = folder / "swap.tmp"
    replacement.write_bytes(EVIL.ljust(st.st_size, b"\0"))
    os.replace(replacement, good)
    assert good.stat().st_size == st.st_size
    os.utime(good, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = run_cli("scan", "--jsonl", "--cache", db, folder)
    rows = {Path(json.loads(line)["path"]).name: json.loads(line) for line in res.output.splitlines()}
    assert rows["good.pt"]["verdict"] == "dangerous", rows["good.pt"]


@pytest.mark.parametrize("edit", ["no-globals", "null", "not-json", "no-path", "bogus-pickle", "wrong-status"])
def test_an_edited_cache_row_is_a_miss(tmp_path: Path, run_cli, edit: str) -> None:
    folder, _good, db = _cached_folder(tmp_path, run_cli)

    def change(key: str, result: str) -> str:
        if "evil.pt" not in key:
            return result
        d = json.loads(result)
        if edit == "no-globals":
            d["globals"] = []
        elif edit == "null":
            return "null"
        elif edit == "not-json":
            return "{not json"
        elif edit == "no-path":
            del d["path"]
        elif edit == "bogus-pickle":
            d["pickles"] = [{"bogus": 1}]
        elif edit == "wrong-status":
            for g in d["globals"]:
                g["status"] = "fine"
        return json.dumps(d)

    _set_rows(db, change)
    res = run_cli("scan", "--jsonl", "--cache", db, folder, catch_exceptions=True)
    assert res.exit_code == 1, res.output
    rows = {Path(json.loads(line)["path"]).name: json.loads(line) for line in res.output.splitlines()}
    assert rows["evil.pt"]["verdict"] == "dangerous"


def test_a_damaged_cache_file_is_a_miss_or_one_error_line(tmp_path: Path, run_cli) -> None:
    folder, _good, db = _cached_folder(tmp_path, run_cli)
    for p in (Path(str(db) + "-wal"), Path(str(db) + "-shm")):
        assert not p.exists() or p.stat().st_size >= 0
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big") or 65536
    for i in range(page, len(data)):  # every page after the header page: B-tree pages
        data[i] = 0xA5
    db.write_bytes(bytes(data))
    res = run_cli("scan", "--jsonl", "--cache", db, folder, catch_exceptions=True)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    if res.exit_code == 1:
        rows = {Path(json.loads(line)["path"]).name: json.loads(line) for line in res.output.splitlines()}
        assert rows["evil.pt"]["verdict"] == "dangerous"
    else:
        assert res.output.startswith("Error:") and len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.parametrize("where", ["dangling", "outside"])
def test_the_cache_path_is_not_followed_out(tmp_path: Path, run_cli, where: str) -> None:
    (tmp_path / "a.pt").write_bytes(pickle.dumps({"a": 1}, protocol=2))
    out = tmp_path / "elsewhere"
    out.mkdir()
    target = out / "made.sqlite"
    if where == "outside":
        target.write_bytes(b"")
    inside = tmp_path / "here"
    inside.mkdir()
    link = inside / "scans.sqlite"
    link.symlink_to(target)
    res = run_cli("scan", "--cache", link, tmp_path / "a.pt")
    assert res.exit_code != 0 and res.output.startswith("Error:") and "symbolic link" in res.output, res.output
    assert (not target.exists()) if where == "dangling" else target.stat().st_size == 0


# ------------------------------------------------------------------------------------------------ HTTP listings
class _Hostile(BaseHTTPRequestHandler):
    """Index pages that lead out of their prefix (``../``, ``/secret/``), to themselves (``./``, ``#fragment``,
    ``?query``) or down an endless chain of ``sub/`` folders; ``/secret/evil.pt`` is a malicious pickle and the
    ``requests`` list names every path asked for."""

    requests: ClassVar[list[str]] = []
    SAFE = pickle.dumps({"a": 1}, protocol=2)

    def log_message(self, *args: Any) -> None:
        pass

    def _body(self) -> tuple[bytes, str]:
        path = self.path
        type(self).requests.append(path)
        clean = path.split("?")[0].split("#")[0]
        if clean == "/escape/":
            links = ["../../secret/evil.pt", "/secret/evil.pt", "../secret/", "./", "ok.pt", "ok.pt#a", "ok.pt?x=1",
                     *(f"#f{i}" for i in range(50)), "http://127.0.0.2:1/far.pt"]
            return "".join(f'<a href="{h}">{h}</a>\n' for h in links).encode(), "text/html"
        if clean == "/mixed/":
            return b'<a href="ok.pt">ok.pt</a>\n<a href="slow.pt">slow.pt</a>\n', "text/html"
        if clean.startswith("/chain/"):
            return b'<a href="sub/">sub/</a>\n<a href="ok.pt">ok.pt</a>\n', "text/html"
        if clean.endswith("evil.pt"):
            return EVIL, "application/octet-stream"
        if clean.endswith("ok.pt"):
            return self.SAFE, "application/octet-stream"
        return b"", ""

    #: bytes the endless body sent before the client hung up
    endless_sent: ClassVar[list[int]] = [0]
    #: GETs of /noetag.pt so far (the first is answered from version A, the later ones from version B)
    noetag_gets: ClassVar[list[int]] = [0]
    NOETAG_A = pickle.dumps({"w": b"a" * 100_000}, protocol=4)
    NOETAG_B = pickle.dumps({"w": b"b" * 100_000}, protocol=4)

    def do_HEAD(self) -> None:
        clean = self.path.split("?")[0]
        type(self).requests.append("HEAD " + clean)
        if clean.endswith(("endless.pt", "gzip.pt", "slow.pt")):
            self._head(1000, etag=True)
            return
        if clean.endswith("noetag.pt"):
            self._head(len(self.NOETAG_A), etag=False)
            return
        body, kind = self._body()
        self.send_response(200 if kind else 404)
        self.send_header("Content-Length", str(len(body)))
        if kind:
            self.send_header("Content-Type", kind)
            self.send_header("ETag", '"v1"')
        self.end_headers()

    def _head(self, n: int, etag: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        if etag:
            self.send_header("ETag", '"v1"')
        self.end_headers()

    def _special(self, clean: str) -> bool:
        """The misbehaving objects: an endless body, a gzip bomb on a range answer, a byte every half second, two
        versions without ETag or Last-Modified."""
        if clean == "/bomb/":
            import gzip

            page = gzip.compress(b'<a href="ok.pt">ok.pt</a>\n' + b" " * (64 << 20))
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
            return True
        if clean.endswith("endless.pt"):
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("ETag", '"v1"')
            self.end_headers()
            piece = b"\x80\x02" + b"\0" * (1 << 20)
            try:
                for _ in range(128):
                    self.wfile.write(piece)
                    type(self).endless_sent[0] += len(piece)
            except OSError:
                pass
            return True
        if clean.endswith("gzip.pt"):
            import gzip

            bomb = gzip.compress(b"\0" * (32 << 20))
            self.send_response(206)
            self.send_header("Content-Range", "bytes 0-999/1000")
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(bomb)))
            self.send_header("ETag", '"v1"')
            self.end_headers()
            self.wfile.write(bomb)
            return True
        if clean.endswith("slow.pt"):
            self.send_response(206)
            self.send_header("Content-Range", "bytes 0-999/1000")
            self.send_header("Content-Length", "1000")
            self.send_header("ETag", '"v1"')
            self.end_headers()
            try:
                for _ in range(60):
                    self.wfile.write(b"\x80")
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                pass
            return True
        if clean.endswith("noetag.pt"):
            type(self).noetag_gets[0] += 1
            body = self.NOETAG_A if type(self).noetag_gets[0] == 1 else self.NOETAG_B
            rng = self.headers.get("Range")
            if rng:
                lo, hi = (int(x) if x else None for x in rng.split("=")[1].split("-"))
                hi = len(body) - 1 if hi is None or hi >= len(body) else hi
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {lo}-{hi}/{len(body)}")
                body = body[lo: hi + 1]
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return True
        return False

    def do_GET(self) -> None:
        if self._special(self.path.split("?")[0]):
            type(self).requests.append(self.path)
            return
        body, kind = self._body()
        if not kind:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        rng = self.headers.get("Range")
        if rng and kind != "text/html":
            lo, hi = (int(x) if x else None for x in rng.split("=")[1].split("-"))
            hi = len(body) - 1 if hi is None or hi >= len(body) else hi
            part = body[lo: hi + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {lo}-{hi}/{len(body)}")
            body = part
        else:
            self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("ETag", '"v1"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def hostile_http() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Hostile.requests = []
    _Hostile.endless_sent = [0]
    _Hostile.noetag_gets = [0]
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_http_links_are_followed_only_inside_the_prefix(hostile_http: str, run_cli) -> None:
    res = run_cli("scan", "--jsonl", f"{hostile_http}/escape/", catch_exceptions=True)
    assert not any(r.startswith("/secret") for r in _Hostile.requests), _Hostile.requests
    rows = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    assert [r["path"] for r in rows] == [f"{hostile_http}/escape/ok.pt"], res.output
    assert res.exit_code == 0, res.output
    assert _Hostile.requests.count("/escape/") <= 2, _Hostile.requests


def test_an_endless_http_folder_chain_fails_loudly(hostile_http: str, run_cli) -> None:
    res = run_cli("scan", f"{hostile_http}/chain/", catch_exceptions=True)
    assert res.exit_code == 2, res.output
    assert "deeper than 64 folder levels" in res.output, res.output


def test_an_endless_body_behind_a_small_head_is_read_to_its_size_only(hostile_http: str, run_cli) -> None:
    res = run_cli("scan", f"{hostile_http}/endless.pt", catch_exceptions=True)
    assert res.exit_code == 2, res.output
    assert "more than the 1000 bytes" in res.output, res.output
    time.sleep(0.5)
    assert _Hostile.endless_sent[0] < 64 << 20, _Hostile.endless_sent[0]


def test_content_encoding_on_a_range_answer_is_refused(hostile_http: str, run_cli) -> None:
    res = run_cli("scan", f"{hostile_http}/gzip.pt", catch_exceptions=True)
    assert res.exit_code == 2 and "Content-Encoding 'gzip'" in res.output, res.output


def test_a_slow_object_times_out_alone(hostile_http: str, run_cli) -> None:
    start = time.monotonic()
    res = run_cli("--timeout", "1", "scan", "--jsonl", "--jobs", "4", f"{hostile_http}/mixed/", catch_exceptions=True)
    took = time.monotonic() - start
    rows = {r["path"].rsplit("/", 1)[1]: r for r in map(json.loads, res.output.splitlines())}
    assert took < 15, took
    assert rows["ok.pt"]["verdict"] == "safe" and rows["slow.pt"]["verdict"] == "error", rows
    assert res.exit_code == 2


def test_without_etag_every_byte_comes_from_one_response(hostile_http: str, run_cli) -> None:
    res = run_cli("scan", "--json", f"{hostile_http}/noetag.pt", catch_exceptions=True)
    gets = [r for r in _Hostile.requests if r.endswith("noetag.pt") and not r.startswith("HEAD")]
    assert len(gets) == 1, _Hostile.requests
    assert res.exit_code == 0, res.output


# ------------------------------------------------------------------------------------------------ adapter configs
_BAD_CONFIGS = {
    "r-string": '{"peft_type": "LORA", "r": "abc", "lora_alpha": 8}',
    "r-list": '{"peft_type": "LORA", "r": [4], "lora_alpha": 8}',
    "r-zero": '{"peft_type": "LORA", "r": 0, "lora_alpha": 8}',
    "r-zero-rslora": '{"peft_type": "LORA", "r": 0, "lora_alpha": 8, "use_rslora": true}',
    "alpha-string": '{"peft_type": "LORA", "r": 4, "lora_alpha": "x"}',
    "alpha-401-digits": '{"peft_type": "LORA", "r": 4, "lora_alpha": ' + "9" * 401 + "}",
    "alpha-nan": '{"peft_type": "LORA", "r": 4, "lora_alpha": NaN}',
    "alpha-1e999": '{"peft_type": "LORA", "r": 4, "lora_alpha": 1e999}',
    "alpha-pattern-null": '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "alpha_pattern": {"q": null}}',
    "alpha-pattern-huge": '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "alpha_pattern": {"q": 1e300}}',
    "rank-pattern-list": '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "rank_pattern": [4]}',
    "rank-pattern-paren": '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "rank_pattern": {"(": 4}}',
    "array": "[" + "1," * 1000 + "1]",
}


def _safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    """A float32 safetensors file of ``tensors`` (name -> shape), every element 1.0 (no torch needed)."""
    import struct

    header: dict[str, Any] = {}
    data = b""
    for name, shape in tensors.items():
        n = 1
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + 4 * n]}
        data += struct.pack(f"<{n}f", *([1.0] * n))
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _lora(tmp_path: Path, config: str) -> tuple[Path, Path]:
    base = tmp_path / "base.safetensors"
    _safetensors(base, {"q.weight": [2, 2]})
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    _safetensors(adapter / "adapter_model.safetensors",
                 {"base_model.model.q.lora_A.weight": [4, 2], "base_model.model.q.lora_B.weight": [2, 4]})
    (adapter / "adapter_config.json").write_text(config)
    return base, adapter


@pytest.mark.parametrize("name", sorted(_BAD_CONFIGS))
def test_a_bad_adapter_config_is_one_error_line(tmp_path: Path, run_cli, name: str) -> None:
    base, adapter = _lora(tmp_path, _BAD_CONFIGS[name])
    res = run_cli("merge-lora", base, adapter, "-o", tmp_path / "out.safetensors", catch_exceptions=True)
    assert res.exit_code in (1, 2), (res.exit_code, res.output)
    assert res.output.count("Error:") == 1 and "Traceback" not in res.output, res.output
    assert "adapter_config.json" in res.output, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base.safetensors"]


@needs_torch
def test_a_good_adapter_config_still_merges(tmp_path: Path, run_cli) -> None:
    base, adapter = _lora(tmp_path, '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "rank_pattern": {"q": 4}}')
    res = run_cli("merge-lora", base, adapter, "-o", tmp_path / "out.safetensors", catch_exceptions=True)
    assert res.exit_code == 0, res.output


def test_a_huge_sparse_adapter_config_is_refused_by_its_size(tmp_path: Path, run_cli) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    with open(adapter / "adapter_config.json", "wb") as f:
        f.write(b"[")
        f.truncate(1 << 30)
    res = run_cli("merge-lora", tmp_path / "base", adapter, "-o", tmp_path / "out.safetensors",
                  catch_exceptions=True)
    assert res.exit_code == 2 and "larger than" in res.output, res.output


def test_rank_pattern_keys_match_in_linear_time() -> None:
    from ckptool.ops.merge.adapter import scaling_of

    start = time.monotonic()
    assert scaling_of({"r": 4, "lora_alpha": 8, "rank_pattern": {"(a+)+b": 2}}, "a" * 100_000 + "!", 4) == 2.0
    assert time.monotonic() - start < 2


# ------------------------------------------------------------------------------------------------ finite numbers
_BAD_NUMBERS = {
    "weights-overflow": ["--weights", "1e308,1e308"],
    "weights-overflow-ties": ["--method", "ties", "--base", "{base}", "--weights", "1e308,1e308"],
    "seed-huge": ["--method", "dare-ties", "--base", "{base}", "--seed", "1180591620717411303424"],
    "seed-negative": ["--method", "dare-linear", "--base", "{base}", "--seed", "-1"],
    "t-nan": ["--method", "slerp", "--t", "nan"],
    "t-inf": ["--method", "slerp", "--t", "inf"],
    "density-nan": ["--method", "ties", "--base", "{base}", "--density", "nan"],
    "density-2": ["--method", "ties", "--base", "{base}", "--density", "2"],
}


@pytest.mark.parametrize("name", sorted(_BAD_NUMBERS))
def test_merge_numbers_are_finite_and_in_range(tmp_path: Path, run_cli, name: str) -> None:
    for n in ("a", "b", "base"):
        _safetensors(tmp_path / f"{n}.safetensors", {"w": [2, 2]})
    args = [a.format(base=tmp_path / "base.safetensors") for a in _BAD_NUMBERS[name]]
    res = run_cli("average", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "-o", tmp_path / "out.safetensors",
                  *args, catch_exceptions=True)
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert res.output.count("Error:") == 1 and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out.safetensors").exists()


# ------------------------------------------------------------------------------------------------ Megatron trees
_MEGATRON = Path(__file__).resolve().parents[1] / "fixtures" / "megatron-ckpts" / "legacy-gpt"


def _tree(tmp_path: Path) -> Path:
    dst = tmp_path / "tree"
    shutil.copytree(_MEGATRON, dst)
    return dst


def test_tp_dim_digits_are_ascii(tmp_path: Path, run_cli) -> None:
    tree = _tree(tmp_path)
    res = run_cli("convert", tree, "-o", tmp_path / "m.safetensors", "--tp-dim", "x.weight=\u00b2",
                  catch_exceptions=True)
    assert res.exit_code == 2 and res.output.count("Error:") == 1 and "--tp-dim" in res.output, res.output


def test_latest_iteration_digits_are_ascii(tmp_path: Path, run_cli) -> None:
    tree = _tree(tmp_path)
    (tree / "latest_checkpointed_iteration.txt").write_text("\u00b2")
    res = run_cli("inspect", tree, catch_exceptions=True)
    assert res.exit_code in (1, 2) and res.output.count("Error:") == 1, res.output


def test_parallel_sizes_are_checked_against_the_ranks_that_exist(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    tree = _tree(tmp_path)
    rank = tree / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(rank, weights_only=False)  # our own fixture
    state["args"].tensor_model_parallel_size = 10**6
    state["args"].pipeline_model_parallel_size = 10**6
    torch.save(state, rank)
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "ckptool", "inspect", str(tree)], check=False, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": _repo()})
    assert time.monotonic() - start < 20
    assert res.returncode == 1 and "is missing" in res.stdout + res.stderr, res.stdout + res.stderr


# ------------------------------------------------------------------------------------------------ sharded indexes
def test_a_huge_index_is_refused_before_parsing(tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.formats import sharded

    monkeypatch.setattr(sharded, "MAX_INDEX", 10_000)
    _safetensors(tmp_path / "model-00001-of-00001.safetensors", {"w": [2]})
    wm = {f"t{i}": "model-00001-of-00001.safetensors" for i in range(2000)}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": wm}))
    res = run_cli("inspect", index, catch_exceptions=True)
    assert res.exit_code == 1 and "larger than 10000 bytes" in res.output, res.output
    assert res.output.count("Error:") == 1


# ------------------------------------------------------------------------------------------------ companions
def _model_folder(top: Path) -> Path:
    top.mkdir(parents=True)
    _safetensors(top / "model.safetensors", {"transformer.w": [2, 2]})
    (top / "config.json").write_text('{"model_type": "gpt2"}')
    return top


@pytest.mark.parametrize("target", ["/etc/passwd", "/proc/self/environ", "outside", "dangling", "/dev/null"])
def test_a_companion_link_out_of_the_folder_is_refused(tmp_path: Path, run_cli, target: str) -> None:
    src = _model_folder(tmp_path / "m")
    if target == "outside":
        (tmp_path / "secret.txt").write_text("secret")
        target = str(tmp_path / "secret.txt")
    elif target == "dangling":
        target = str(tmp_path / "nothing-here")
    (src / "tokenizer.json").symlink_to(target)
    out = tmp_path / "o"
    res = run_cli("strip-prefix", src, "transformer.", "-o", out, catch_exceptions=True)
    assert res.exit_code == 1 and res.output.count("Error:") == 1, res.output
    assert "tokenizer.json" in res.output and "symbolic link" in res.output, res.output
    assert not out.exists()


def test_companion_links_inside_the_folder_or_to_hf_blobs_are_copied(tmp_path: Path, run_cli) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text('{"vocab": 1}')
    src = _model_folder(repo / "snapshots" / "rev1")
    (src / "tokenizer.json").symlink_to("../../blobs/abc123")
    (src / "real.txt").write_text("r")
    (src / "alias.txt").symlink_to("real.txt")
    out = tmp_path / "o"
    res = run_cli("strip-prefix", src, "transformer.", "-o", out, catch_exceptions=True)
    assert res.exit_code == 0, res.output
    assert (out / "tokenizer.json").read_text() == '{"vocab": 1}' and (out / "alias.txt").read_text() == "r"
    assert not (out / "tokenizer.json").is_symlink()


def test_a_fifo_companion_is_never_opened(tmp_path: Path, run_cli) -> None:
    src = _model_folder(tmp_path / "m")
    os.mkfifo(src / "pipe.txt")
    out = tmp_path / "o"
    res = run_cli("strip-prefix", src, "transformer.", "-o", out, catch_exceptions=True)
    assert res.exit_code == 0, res.output
    assert not (out / "pipe.txt").exists()


def test_a_sparse_companion_keeps_its_holes_and_mode(tmp_path: Path, run_cli) -> None:
    src = _model_folder(tmp_path / "m")
    big = src / "sparse.dat"
    with open(big, "wb") as f:
        f.write(b"head")
        f.seek(256 << 20)
        f.write(b"tail")
    big.chmod(0o640)
    if big.stat().st_blocks * 512 > 16 << 20:
        pytest.skip("this filesystem does not keep holes")
    out = tmp_path / "o"
    res = run_cli("strip-prefix", src, "transformer.", "-o", out, catch_exceptions=True)
    assert res.exit_code == 0, res.output
    copy = out / "sparse.dat"
    assert copy.stat().st_size == big.stat().st_size
    assert copy.stat().st_blocks * 512 < 16 << 20, copy.stat().st_blocks
    assert stat.S_IMODE(copy.stat().st_mode) == 0o640
    with open(copy, "rb") as f:
        assert f.read(4) == b"head"
        f.seek(256 << 20)
        assert f.read() == b"tail"


def test_a_companion_larger_than_the_free_space_is_refused_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    from ckptool.errors import OutputError
    from ckptool.ops.rewrite import companions

    src = tmp_path / "c.txt"
    src.write_bytes(b"x" * 100_000)
    real = os.statvfs

    class Full:
        def __init__(self, st: Any) -> None:
            self.f_frsize, self.f_bavail = st.f_frsize, 1

    monkeypatch.setattr(companions.os, "statvfs", lambda p: Full(real(p)))
    with pytest.raises(OutputError, match="free"):
        companions.copy_companion(str(src), str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("target", ["outside", "/proc/self/environ", "/dev/null"])
def test_follow_links_opts_in_for_regular_files_only(tmp_path: Path, run_cli, target: str) -> None:
    src = _model_folder(tmp_path / "m")
    pseudo = target != "outside"
    if not pseudo:
        (tmp_path / "tok.json").write_text("{}")
        target = str(tmp_path / "tok.json")
    (src / "tokenizer.json").symlink_to(target)
    out = tmp_path / "o"
    res = run_cli("--follow-links", "strip-prefix", src, "transformer.", "-o", out, catch_exceptions=True)
    if pseudo:
        assert res.exit_code == 1 and "symbolic link" in res.output and not out.exists(), res.output
    else:
        assert res.exit_code == 0 and (out / "tokenizer.json").read_text() == "{}", res.output
    res = run_cli("strip-prefix", src, "transformer.", "-o", tmp_path / "o2", catch_exceptions=True)
    assert res.exit_code == 1, "--follow-links must not outlive its run"


@needs_torch
def test_a_merge_that_overflows_the_weight_dtype_is_refused(tmp_path: Path, run_cli) -> None:
    import struct

    base = tmp_path / "base.safetensors"
    text = json.dumps({"q.weight": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    base.write_bytes(struct.pack("<Q", len(text)) + text + struct.pack("<4e", 65000, 65000, 1, 1))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    _safetensors(adapter / "adapter_model.safetensors",
                 {"base_model.model.q.lora_A.weight": [4, 2], "base_model.model.q.lora_B.weight": [2, 4]})
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 4000}')
    out = tmp_path / "out.safetensors"
    res = run_cli("merge-lora", base, adapter, "-o", out, catch_exceptions=True)
    assert res.exit_code == 1 and "inf or NaN" in res.output and res.output.count("Error:") == 1, res.output
    assert not out.exists()


def test_a_compressed_index_page_is_capped(hostile_http: str, run_cli) -> None:
    res = run_cli("scan", f"{hostile_http}/bomb/", catch_exceptions=True)
    assert res.exit_code == 2 and "larger than 33554432 bytes once decoded" in res.output, res.output


@needs_torch
def test_a_merge_that_overflows_from_finite_inputs_is_refused(tmp_path: Path, run_cli) -> None:
    _safetensors(tmp_path / "base.safetensors", {"w": [2, 2]})
    for n in ("a", "b"):
        path = tmp_path / f"{n}.safetensors"
        _safetensors(path, {"w": [2, 2]})
        data = bytearray(path.read_bytes())
        data[-16:] = bytes.fromhex("00000040") * 4  # every element 2.0 (float32 little-endian)
        path.write_bytes(bytes(data))
    out = tmp_path / "out.safetensors"
    res = run_cli("average", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--method", "task-arithmetic",
                  "--base", tmp_path / "base.safetensors", "--weights", "3e38,3e38", "-o", out, catch_exceptions=True)
    assert res.exit_code == 1 and "inf or NaN" in res.output and res.output.count("Error:") == 1, res.output
    assert not out.exists()


def test_a_join_of_millions_of_rows_is_refused_before_allocating() -> None:
    from ckptool.errors import UnsupportedError
    from ckptool.formats.tensors import Storage, Tensor
    from ckptool.model.megatron import join

    rows = 3_000_000
    shards = [Tensor("x.weight", "x.weight", "float32", (rows, 1), (1, 1), 0,
                     Storage(f"/r{i}.pt", 0, rows * 4, "float32")) for i in range(2)]
    start = time.monotonic()
    with pytest.raises(UnsupportedError, match="byte ranges"):
        join("x.weight", shards, "1", "tree")
    assert time.monotonic() - start < 1
    small = [Tensor("x.weight", "x.weight", "float32", (4, 2), (2, 1), 0, Storage(f"/r{i}.pt", 0, 32, "float32"))
             for i in range(2)]
    assert join("x.weight", small, "1", "tree").shape == (4, 4)
