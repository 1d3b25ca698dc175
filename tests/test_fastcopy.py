"""The copy path of rewrites: ckptool._fileio.copy_range / copy_range_crc / WriteBehind and TorchZipWriter.copy_record.

Windows and record thresholds are shrunk with monkeypatch so that chunk boundaries are crossed with small files.
"""

from __future__ import annotations

import errno
import io
import itertools
import os
import sys
import zipfile
import zlib
from pathlib import Path

import pytest

from ckptool import _fileio
from ckptool._fileio import WriteBehind, atomic_output, copy_range, copy_range_crc
from ckptool.errors import CorruptCheckpointError
from ckptool.formats import torchzip
from ckptool.formats.torchzip import ALIGNMENT, TorchZipWriter
from ckptool.ops.rewrite.remap import remap

WINDOW = 4096
SIZES = [0, 1, WINDOW - 1, WINDOW, WINDOW + 1, 3 * WINDOW + 17]


@pytest.fixture
def small_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fileio, "WRITEBACK_WINDOW", WINDOW)


@pytest.fixture
def src_file(tmp_path: Path) -> Path:
    p = tmp_path / "src.bin"
    p.write_bytes(os.urandom(5 * WINDOW + 333))
    return p


class SfrRecorder:
    """Stands in for sync_file_range: records (offset, length, flags)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, fd: int, offset: int, length: int, flags: int) -> int:
        os.fstat(fd)  # a real descriptor
        self.calls.append((offset, length, flags))
        return 0


def _copy(src: Path, dst: Path, offset: int, size: int, lead: bytes = b"hdr", **kw: object) -> bytes:
    with open(src, "rb") as s, open(dst, "w+b") as d:
        d.write(lead)
        copy_range(s, d, offset, size, **kw)  # type: ignore[arg-type]
        assert d.tell() == len(lead) + size
        d.write(b"tail")
    return dst.read_bytes()


@pytest.mark.usefixtures("small_window")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", [0, 7, WINDOW + 1])
def test_copy_range_byte_identical_across_window_boundaries(src_file: Path, tmp_path: Path, size: int,
                                                             offset: int) -> None:
    data = src_file.read_bytes()
    seen: list[int] = []
    out = _copy(src_file, tmp_path / "out", offset, size, progress=seen.append)
    assert out == b"hdr" + data[offset:offset + size] + b"tail"
    assert sum(seen) == size
    assert all(0 < n <= WINDOW for n in seen)


@pytest.mark.usefixtures("small_window")
def test_copy_range_without_copy_file_range(src_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "copy_file_range", raising=False)
    data = src_file.read_bytes()
    seen: list[int] = []
    assert _copy(src_file, tmp_path / "out", 5, 3 * WINDOW + 17, progress=seen.append) == (
        b"hdr" + data[5:5 + 3 * WINDOW + 17] + b"tail")
    assert sum(seen) == 3 * WINDOW + 17


@pytest.mark.usefixtures("small_window")
@pytest.mark.parametrize("good_calls", [0, 1, 2])
def test_copy_range_falls_back_when_copy_file_range_fails(src_file: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, good_calls: int) -> None:
    """copy_file_range raising EXDEV/ENOSYS (at once or after some pieces, copying only part of a piece): the rest
    is copied by hand, and the kernel is not asked again."""
    real = os.copy_file_range
    calls = []

    def flaky(sfd: int, dfd: int, n: int, soff: int, doff: int) -> int:
        calls.append(n)
        if len(calls) > good_calls:
            raise OSError(errno.EXDEV, "cross-device")
        return real(sfd, dfd, min(n, 1000), soff, doff)  # short copies: the loop must continue them

    monkeypatch.setattr(os, "copy_file_range", flaky)
    data = src_file.read_bytes()
    size = 4 * WINDOW + 5
    assert _copy(src_file, tmp_path / "out", 3, size) == b"hdr" + data[3:3 + size] + b"tail"
    assert len(calls) == good_calls + 1


@pytest.mark.usefixtures("small_window")
@pytest.mark.parametrize("kernel", [True, False])
def test_copy_range_truncated_source(src_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     kernel: bool) -> None:
    if not kernel:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    total = src_file.stat().st_size
    with open(src_file, "rb") as s, open(tmp_path / "out", "w+b") as d, pytest.raises(CorruptCheckpointError):
        copy_range(s, d, total - 100, 2 * WINDOW)


@pytest.mark.usefixtures("small_window")
def test_copy_range_without_sync_file_range(src_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fileio, "sync_file_range", None)
    data = src_file.read_bytes()
    assert _copy(src_file, tmp_path / "out", 1, 3 * WINDOW) == b"hdr" + data[1:1 + 3 * WINDOW] + b"tail"


@pytest.mark.usefixtures("small_window")
def test_write_back_requests_cover_the_copy(src_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each window is handed to write-back once (WRITE, no waiting), in order, without gaps; a partial last window
    is left to the final fsync."""
    rec = SfrRecorder()
    monkeypatch.setattr(_fileio, "sync_file_range", rec)
    size = 3 * WINDOW + 17
    _copy(src_file, tmp_path / "out", 0, size)
    assert rec.calls == [(3, WINDOW, 2), (3 + WINDOW, WINDOW, 2), (3 + 2 * WINDOW, WINDOW, 2)]


def test_write_behind_small_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fileio, "WRITEBACK_WINDOW", 100)
    rec = SfrRecorder()
    monkeypatch.setattr(_fileio, "sync_file_range", rec)
    with open(tmp_path / "f", "wb") as f:
        wb = WriteBehind(f.fileno(), 10)
        wb.written(60)
        assert rec.calls == []
        wb.written(130)
        wb.written(130)  # nothing new
        wb.written(229)
        wb.written(230)
    assert rec.calls == [(10, 120, 2), (130, 100, 2)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux only")
def test_real_sync_file_range_is_found_and_works(tmp_path: Path) -> None:
    assert _fileio.sync_file_range is not None
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * 10000)
        f.flush()
        assert _fileio.sync_file_range(f.fileno(), 0, 10000, 7) == 0


@pytest.mark.usefixtures("small_window")
@pytest.mark.parametrize("size", SIZES)
def test_copy_range_crc_matches_zlib(src_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     size: int) -> None:
    monkeypatch.setattr(_fileio, "CHUNK", 1000)  # pieces smaller than the window: several per write-back
    rec = SfrRecorder()
    monkeypatch.setattr(_fileio, "sync_file_range", rec)
    data = src_file.read_bytes()
    seen: list[int] = []
    with open(src_file, "rb") as s, open(tmp_path / "out", "w+b") as d:
        crc = copy_range_crc(s, d, 11, size, progress=seen.append)
        d.flush()
    assert crc == zlib.crc32(data[11:11 + size])
    assert (tmp_path / "out").read_bytes() == data[11:11 + size]
    assert sum(seen) == size
    started = [(o, n) for o, n, fl in rec.calls if fl == 2]
    if size <= WINDOW:
        assert not rec.calls  # too small to bother: left to the final fsync
    else:  # windows of at least WINDOW bytes, from the start, without gaps; less than a window left over
        assert started[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(started))
        assert all(n >= WINDOW for _, n in started) and 0 <= size - sum(n for _, n in started) < WINDOW


def test_copy_range_crc_to_a_memory_sink(src_file: Path) -> None:
    """A sink without a file descriptor (verify's CRC check) gets no write-back."""
    sink = io.BytesIO()
    with open(src_file, "rb") as s:
        crc = copy_range_crc(s, sink, 0, 20000)
    assert crc == zlib.crc32(src_file.read_bytes()[:20000]) and len(sink.getvalue()) == 20000


# -------------------------------------------------------------------------------------------------- TorchZipWriter
@pytest.mark.usefixtures("small_window")
@pytest.mark.parametrize("with_crc", [True, False])
@pytest.mark.parametrize("kernel", [True, False])
def test_torchzip_copy_record_identical_with_crc(src_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 with_crc: bool, kernel: bool) -> None:
    monkeypatch.setattr(torchzip, "SMALL_RECORD", 2 * WINDOW)
    monkeypatch.setattr(_fileio, "CHUNK", 1000)
    if not kernel:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    rec = SfrRecorder()
    monkeypatch.setattr(_fileio, "sync_file_range", rec)
    data = src_file.read_bytes()
    spans = {"a": (0, 1), "b": (1, 2 * WINDOW), "c": (9, 2 * WINDOW + 1), "d": (5, 3 * WINDOW + 17), "e": (0, 0)}
    seen: list[int] = []
    out = tmp_path / "out.pt"
    with atomic_output(str(out)) as f, open(src_file, "rb") as s:
        w = TorchZipWriter(f, "archive", progress=seen.append)
        w.begin_torch_save(b"pickle")
        for name, (off, n) in spans.items():
            w.copy_record(f"data/{name}", s, off, n, zlib.crc32(data[off:off + n]) if with_crc else None)
        w.end_torch_save()
    assert sum(seen) == sum(n for _, n in spans.values())
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None  # every CRC matches its bytes
        for name, (off, n) in spans.items():
            info = z.getinfo(f"archive/data/{name}")
            assert z.read(info) == data[off:off + n]
            assert info.compress_type == zipfile.ZIP_STORED
    raw = out.read_bytes()
    for name, (off, n) in spans.items():  # data start on a 64-byte boundary, as torch.load(mmap=True) needs
        i = raw.index(f"archive/data/{name}".encode())
        start = i + len(f"archive/data/{name}") + int.from_bytes(raw[i - 2:i], "little")
        assert start % ALIGNMENT == 0 and raw[start:start + n] == data[off:off + n]
    started = sorted((o, n) for o, n, fl in rec.calls if fl == 2)
    assert started and all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(started))  # contiguous, no overlap


def test_torchzip_writer_to_memory(src_file: Path) -> None:
    buf = io.BytesIO()
    seen: list[int] = []
    with open(src_file, "rb") as s:
        w = TorchZipWriter(buf, "m", progress=seen.append)
        w.copy_record("data/0", s, 3, 1000)
        w.close()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        assert z.read("m/data/0") == src_file.read_bytes()[3:1003]
    assert seen == [1000]


def test_torchzip_output_loads_in_torch(src_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A remap of a multi-window tensor through the real write-back path stays loadable and equal."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(_fileio, "WRITEBACK_WINDOW", 1 << 16)
    sd = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(3)}
    torch.save(sd, tmp_path / "in.pt")
    seen: list[int] = []
    real = TorchZipWriter.__init__

    def spy(self: TorchZipWriter, *a: object, **kw: object) -> None:
        real(self, *a, **kw)  # type: ignore[arg-type]
        self.progress = seen.append

    monkeypatch.setattr(TorchZipWriter, "__init__", spy)
    remap(str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), to="cpu")
    back = torch.load(tmp_path / "out.pt", mmap=True)
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["b"], sd["b"])
    with zipfile.ZipFile(tmp_path / "in.pt") as z:  # every record but the pickle is copied from the input
        copied = sum(i.file_size for i in z.infolist() if not i.filename.endswith("/data.pkl"))
    assert sum(seen) == copied and max(seen) == 1 << 16


# -------------------------------------------------------------------------------------------------- convert
@pytest.mark.usefixtures("small_window")
@pytest.mark.parametrize("verify", [True, False])
def test_convert_to_safetensors_starts_write_back_across_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 verify: bool) -> None:
    """Tensors each smaller than the write-back window add up: the safetensors writer keeps one WriteBehind for
    its whole data block, so the write-back of the output starts while it is written (every byte, once, in order),
    not only at the final fsync. Before, each tensor's copy had its own window and none was ever full."""
    import torch
    from safetensors.torch import load_file

    from ckptool.ops.convert import convert

    sd = {f"t{i}": torch.arange(i * 300, i * 300 + 300, dtype=torch.float32) for i in range(40)}  # 1200 B each
    torch.save(sd, tmp_path / "m.pt")
    rec = SfrRecorder()
    monkeypatch.setattr(_fileio, "sync_file_range", rec)
    convert(tmp_path / "m.pt", tmp_path / "m.safetensors", verify=verify)
    started = [(o, n) for o, n, fl in rec.calls if fl == 2]
    size = (tmp_path / "m.safetensors").stat().st_size
    assert len(started) >= 40 * 1200 // WINDOW - 1
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(started)) and started[-1][0] + started[-1][1] <= size
    out = load_file(tmp_path / "m.safetensors")
    assert out.keys() == sd.keys() and all(torch.equal(out[k], v) for k, v in sd.items())
