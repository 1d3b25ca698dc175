"""Segments that lie end to end in one file are read with one read and scattered from memory (issue 40): a DCP
chunk split on a later dimension is one segment per row, and gathering such a tensor row by row made about 82,000
reads of 2 KiB for a 1 GiB Megatron folder. The bytes are those of the segment-by-segment reading; bytes between
segments are never read; one read takes at most ``limit`` bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptool.errors import CorruptCheckpointError
from ckptool.formats.segments import ConcatenatedFile, file_runs, read_segments
from ckptool.formats.tensors import Segment, Storage
from ckptool.readers.data import FileRanges, read_storage

pytestmark = pytest.mark.torchfree

ROWS, A, B = 64, 6, 10  # a [64, 16] tensor split on dim 1 into a [64, 6] and a [64, 10] chunk, 1-byte elements


def _split_rows(tmp_path: Path) -> tuple[list[Segment], bytes]:
    """Two chunk files (with a 3-byte header each, as a record's offset) and the segments that gather the whole
    tensor row by row: row r of chunk a, then row r of chunk b; and the tensor's bytes."""
    full = bytes((7 * i + 3) % 251 for i in range(ROWS * (A + B)))
    rows = [full[r * (A + B):(r + 1) * (A + B)] for r in range(ROWS)]
    (tmp_path / "a").write_bytes(b"HDR" + b"".join(row[:A] for row in rows) + b"TAIL")
    (tmp_path / "b").write_bytes(b"HDR" + b"".join(row[A:] for row in rows) + b"TAIL")
    segs = []
    for r in range(ROWS):
        segs += [Segment(str(tmp_path / "a"), 3 + r * A, A), Segment(str(tmp_path / "b"), 3 + r * B, B)]
    return segs, full


class _Counting:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.files = FileRanges()

    def __call__(self, path: str, offset: int, n: int) -> bytearray:
        self.calls.append((Path(path).name, offset, n))
        return self.files.read(path, offset, n)


def test_a_row_split_chunk_is_read_once_per_file(tmp_path: Path) -> None:
    segs, full = _split_rows(tmp_path)
    read = _Counting()
    f = ConcatenatedFile(segs, read)
    assert f.read() == full
    assert sorted(read.calls) == [("a", 3, ROWS * A), ("b", 3, ROWS * B)]  # not 128 reads; no header or tail
    read.calls.clear()
    f.seek(5 * (A + B) + 2)  # a range that starts and ends inside rows
    buf = bytearray(7 * (A + B))
    assert f.readinto(buf) == len(buf) and bytes(buf) == full[5 * (A + B) + 2:12 * (A + B) + 2]
    assert len(read.calls) == 2
    assert read_segments(segs, read) == full


def test_runs_are_bounded_and_never_bridge_a_gap() -> None:
    pieces = [("f", 0, 4, 0), ("f", 4, 4, 4), ("f", 8, 4, 8), ("f", 20, 4, 12), ("g", 24, 4, 16)]
    assert file_runs(pieces) == [("f", 0, 12, [(0, 4, 0), (4, 4, 4), (8, 4, 8)]), ("f", 20, 4, [(0, 4, 12)]),
                                 ("g", 24, 4, [(0, 4, 16)])]
    assert [r[:3] for r in file_runs(pieces, limit=8)] == [("f", 0, 8), ("f", 8, 4), ("f", 20, 4), ("g", 24, 4)]
    assert [r[:3] for r in file_runs([("f", 0, 100, 0)], limit=8)] == [("f", 0, 100)]  # one big piece: whole


def test_read_storage_gathers_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    segs, full = _split_rows(tmp_path)
    st = Storage(str(tmp_path / "a"), 0, len(full), "uint8", segments=segs)
    calls: list[int] = []
    real = FileRanges.readinto

    def counting(self: FileRanges, path: str, offset: int, buf: memoryview) -> None:
        calls.append(len(buf))
        real(self, path, offset, buf)

    monkeypatch.setattr(FileRanges, "readinto", counting)
    assert bytes(read_storage(st)) == full
    assert sorted(calls) == [ROWS * A, ROWS * B]


def test_a_truncated_file_is_an_error(tmp_path: Path) -> None:
    segs, _full = _split_rows(tmp_path)
    (tmp_path / "b").write_bytes(b"HDR" + bytes(10))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        ConcatenatedFile(segs, FileRanges().read).read()
