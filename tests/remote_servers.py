"""Local servers for the remote tests, on 127.0.0.1 only, started and stopped by session fixtures (no torch here).

A pytest plugin (``pytest_plugins`` in ``conftest.py``): the fixtures ``s3``, ``http`` and ``plain_http`` exist
once per session for every test module.

* ``s3``: moto's S3 server (``ThreadedMotoServer``, fake credentials from the environment, s3fs pointed at it
  through ``AWS_ENDPOINT_URL``); yields an s3fs filesystem with the bucket ``ckpt``.
* ``http``: an HTTP server that serves the files of its ``root`` folder, honours ``Range`` and counts the body
  bytes it sends (``sent``). The first path component picks a misbehaviour (:data:`MODES`), so one server serves
  every case: ``/drop/`` answers large ranges with a few bytes and closes the connection (the body is cut),
  ``/badrange/`` answers 206 with a ``Content-Range`` (and the bytes) one byte past what was asked,
  ``/short/`` sends 10 bytes fewer than asked with a matching ``Content-Length``, ``/replace/`` serves
  ``NAME.v2`` (its own ETag) from the ``replace_after``-th GET on: an object replaced while it is read. A GET of a
  folder answers an index page linking its files and subfolders (what fsspec's HTTP ``ls`` / ``find`` read);
  ``delay`` seconds are added to every request (the latency of a distant object store, for benchmarks);
  ``log`` lists every request (method, path, ``Range``).
* ``plain_http``: the standard library's ``http.server.SimpleHTTPRequestHandler`` (``python -m http.server``),
  which ignores ``Range`` and answers every GET with the whole file.
"""

from __future__ import annotations

import functools
import hashlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

MB = 1 << 20
MODES = ("drop", "badrange", "short", "replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session", name="s3")
def s3_server() -> Iterator[Any]:
    """A moto S3 server on a free local port; yields an s3fs filesystem with bucket ``ckpt`` made."""
    import fsspec
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("ckpt")
        try:
            yield fs
        finally:
            server.stop()
            fsspec.filesystem("s3").clear_instance_cache()


@functools.lru_cache(maxsize=4096)  # a benchmark bucket of 500 objects hashes each once
def _etag_of(path: Path, size: int, mtime_ns: int) -> str:
    return f'"{hashlib.md5(path.read_bytes()).hexdigest()}"'


def _etag(path: Path) -> str:
    """A strong ETag of the file at ``path`` (MD5 of its bytes, as S3 gives for a one-part upload)."""
    st = path.stat()
    return _etag_of(path, st.st_size, st.st_mtime_ns)


class Files(ThreadingHTTPServer):
    daemon_threads = True
    #: the listen backlog (``http.server``'s default, 5, drops the connections of a burst of concurrent requests,
    #: which then wait a second for the SYN to be sent again: no object store behaves so)
    request_queue_size = 128
    root: Path
    sent: int = 0
    gets: int = 0  # GET requests under /replace/ so far
    replace_after: int = 2
    delay: float = 0.0  # seconds added to every request
    lock = threading.Lock()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: every request so far: (method, path, Range header or "")
        self.log: list[tuple[str, str, str]] = []

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet: a client that drops a connection mid-body (ckptool refusing an answer) is what some tests do, and a
        traceback on stderr would land in the output of the command a test runs in-process."""


class RangeHandler(BaseHTTPRequestHandler):
    server: Files
    #: the body bytes of the last answer (a file's bytes, an index page)
    body_bytes = 0

    def log_message(self, *args: Any) -> None:
        pass

    def _file(self, count: bool = False) -> tuple[Path | None, str]:
        with self.server.lock:
            self.server.log.append((self.command, self.path, self.headers.get("Range", "")))
        if self.server.delay:
            time.sleep(self.server.delay)
        rel = self.path.split("?", 1)[0].lstrip("/")
        mode, _, rest = rel.partition("/")
        if mode not in MODES:
            mode, rest = "", rel
        p = self.server.root / rest
        if mode == "replace":
            with self.server.lock:
                self.server.gets += count
                if self.server.gets >= self.server.replace_after:
                    p = p.with_name(p.name + ".v2")
        return (p if p.is_file() else None), mode

    def _head(self, p: Path, code: int, n: int) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(n))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", _etag(p))

    def do_HEAD(self) -> None:
        p, _ = self._file()
        if p is None:
            self.send_error(404)
            return
        self._head(p, 200, p.stat().st_size)
        self.end_headers()

    def _index(self) -> bool:
        """Answer a GET of a folder with a page linking its entries (folders end with ``/``); False if no folder."""
        rel = self.path.split("?", 1)[0].lstrip("/")
        folder = self.server.root / rel
        if not folder.is_dir():
            return False
        base = "/" + rel.rstrip("/") + "/" if rel.strip("/") else "/"
        links = [f'<a href="{base}{c.name}{"/" if c.is_dir() else ""}">{c.name}</a>' for c in sorted(folder.iterdir())
                 if not c.name.endswith(".v2")]
        body = ("<html><body>" + "\n".join(links) + "</body></html>").encode()
        self.body_bytes = len(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return True

    def do_GET(self) -> None:
        p, mode = self._file(count=True)
        if p is None and self._index():
            return
        if p is None:
            self.send_error(404)
            return
        size = p.stat().st_size
        start, end = 0, size - 1
        m = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
            if mode == "badrange":  # a proxy or cache that answers with other bytes than asked
                start, end = min(start + 1, size - 1), min(end + 1, size - 1)
        n = end - start + 1
        self._head(p, 206 if m else 200, n - 10 if mode == "short" and n > 10 else n)
        if m:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        with open(p, "rb") as f:
            f.seek(start)
            data = f.read(n)
        if mode == "short" and n > 10:
            data = data[:-10]
        if mode == "drop" and n > MB:  # the connection drops mid-body
            data = data[:4096]
            self.close_connection = True
        with self.server.lock:  # counted before the write: the client may finish reading before this thread runs on
            self.server.sent += len(data)
        self.body_bytes = len(data)
        self.wfile.write(data)


def _serve(server: ThreadingHTTPServer) -> Iterator[Any]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session", name="http")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Files]:
    """The HTTP server of :class:`RangeHandler` serving the files of its ``root`` folder; ``sent`` counts body
    bytes."""
    server = Files(("127.0.0.1", 0), RangeHandler)
    server.root = tmp_path_factory.mktemp("http")
    yield from _serve(server)


@pytest.fixture(scope="session", name="plain_http")
def plain_http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``python -m http.server`` (``SimpleHTTPRequestHandler``, which ignores ``Range``) serving its ``root``."""
    root = tmp_path_factory.mktemp("plain")

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a client that closes the connection once it sees a 200 (ckptool does) is expected

    server = Server(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    server.daemon_threads = True
    server.root = root  # type: ignore[attr-defined]
    yield from _serve(server)


def url(server: Any, name: str, mode: str = "") -> str:
    """The URL of ``name`` on ``server``, under the misbehaviour ``mode`` (one of :data:`MODES`, or none)."""
    return f"http://127.0.0.1:{server.server_address[1]}/{mode + '/' if mode else ''}{name}"
