"""Bytes gathered from byte ranges of several files, read as one file: a tensor whose data is split across files.

A DeepSpeed ZeRO parameter lives in pieces of the ranks' flat fp32 partitions (one file per rank); its consolidated
bytes are those pieces in order (:mod:`ckptool.model.zero`). A :class:`Segment` names one piece: ``nbytes`` at
``offset`` of file ``path``. A segment may also *widen* 16-bit floats to float32 as it is read (``widen`` is the
dtype in the file, ``"float16"`` or ``"bfloat16"``; ``nbytes`` is then the size once widened, twice the bytes
read), which is exact for both (every float16 and bfloat16 value is a float32 value): DeepSpeed's
``zero_to_fp32`` returns floating buffers as float32 (``v.float()``). A segment may instead *swap* the bytes of
each ``swap``-byte element as it is read (:func:`byteswap`): the storage of a torch file saved on a big-endian
machine (its ``byteorder`` record says ``big``), read as the little-endian values ckptool writes and compares.

:class:`ConcatenatedFile` reads the concatenation through ``seek`` / ``read`` / ``readinto``, so copying it needs no
more memory than the copy's buffer (and as much again for the reads). The segments a call reaches that lie end to
end in one file are read with one read (up to :data:`MAX_RUN` bytes) and scattered from memory
(:func:`file_runs`): a DCP chunk split on a later dimension is one segment per row, its rows adjacent in its
``torch.save`` record, so a copy of the gathered tensor reads each record's part in one call, not row by row
(issue 40: 82,000 reads of 2 KiB for a 1 GiB Megatron folder before). Nothing here imports torch.
"""

from __future__ import annotations

import array
import bisect
import struct
from collections.abc import Callable, Sequence

from ckptool.errors import CorruptCheckpointError
from ckptool.formats.tensors import Segment

__all__ = ["MAX_RUN", "ConcatenatedFile", "Run", "byteswap", "file_runs", "read_segments", "widen_to_float32"]

#: ``read(path, offset, nbytes)``: the bytes of a file range (raises when the file ends first)
ReadRange = Callable[[str, int, int], bytes | bytearray]


#: the most bytes one read of adjacent segments takes (:func:`file_runs`)
MAX_RUN = 64 << 20
#: ``(path, offset, nbytes, parts)``: one read of ``nbytes`` at ``offset`` of ``path``, and where its bytes go:
#: ``parts`` = ``[(offset in the run, nbytes, position in the output)]``
Run = tuple[str, int, int, list[tuple[int, int, int]]]

_SWAP_CODES = {n: c for c in "HILQ" if (n := array.array(c).itemsize) in (2, 4, 8)}


def byteswap(data: bytes | bytearray | memoryview, size: int) -> bytes:
    """``data`` with the bytes of each ``size``-byte element reversed (``size`` 2, 4 or 8; 0 or 1: unchanged), as
    torch's ``UntypedStorage._byteswap`` does; ``len(data)`` must be a multiple of ``size``.

    Raises:
        ValueError: another size, or a length that is not a multiple of it.
    """
    if size <= 1:
        return bytes(data)
    code = _SWAP_CODES.get(size)
    if code is None or len(data) % size:
        raise ValueError(f"cannot byte-swap {len(data)} bytes in elements of {size} bytes")
    a = array.array(code)
    a.frombytes(data)
    a.byteswap()
    return a.tobytes()


def widen_to_float32(data: bytes | bytearray | memoryview, dtype: str) -> bytes:
    """Little-endian ``float16`` / ``bfloat16`` elements as little-endian float32 (exact: torch's ``.float()``).

    Raises:
        ValueError: another dtype.
    """
    n = len(data) // 2
    if dtype == "bfloat16":  # bfloat16 is the high half of a float32
        out = bytearray(4 * n)
        mv = memoryview(data)
        for i in range(2):  # bytes 2 and 3 of each float32; bytes 0 and 1 stay zero
            out[2 + i::4] = mv[i::2]
        return bytes(out)
    if dtype == "float16":
        return struct.pack(f"<{n}f", *struct.unpack(f"<{n}e", data))
    raise ValueError(f"cannot widen {dtype} to float32")


def _read(read: ReadRange, seg: Segment, lo: int, hi: int) -> bytes | bytearray:
    """Bytes ``[lo, hi)`` of segment ``seg`` (offsets within the segment, after widening or swapping)."""
    if seg.swap > 1:
        w = seg.swap
        first, last = lo // w * w, -(-hi // w) * w  # the whole elements that hold the range
        return byteswap(read(seg.path, seg.offset + first, last - first), w)[lo - first:hi - first]
    if seg.widen is None:
        return read(seg.path, seg.offset + lo, hi - lo)
    first, last = lo // 4, -(-hi // 4)  # the float32 elements that hold the range
    wide = widen_to_float32(read(seg.path, seg.offset + 2 * first, 2 * (last - first)), seg.widen)
    return wide[lo - 4 * first:hi - 4 * first]


class ConcatenatedFile:
    """A read-only, seekable binary file over the concatenation of ``segments`` (no ``fileno``: copy it through a
    buffer). ``read(path, offset, nbytes)`` reads a file range, e.g. ``ckptool.ops.convert.write.Files.read``."""

    def __init__(self, segments: Sequence[Segment], read: ReadRange, name: str = "the gathered tensor") -> None:
        self.segments = list(segments)
        self._read = read
        self.name = name
        self._starts: list[int] = []
        pos = 0
        for s in self.segments:
            self._starts.append(pos)
            pos += s.nbytes
        self.size = pos
        self._pos = 0

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        out = bytearray(max(0, end - self._pos))
        self.readinto(out)
        return bytes(out)

    def readinto(self, buf: bytearray | memoryview) -> int:
        """Fill ``buf`` from the current position (as much as is left), reading the plain segments that lie end to
        end in one file with one read each (:func:`file_runs`); the number of bytes written.

        Raises:
            CorruptCheckpointError: a file ends first (from ``read``).
        """
        mv = memoryview(buf).cast("B")
        pos, end = self._pos, min(self.size, self._pos + len(mv))
        plain: list[tuple[str, int, int, int]] = []
        i = max(0, bisect.bisect_right(self._starts, pos) - 1)  # the first segment the range reaches
        while i < len(self.segments) and self._starts[i] < end:
            seg, start = self.segments[i], self._starts[i]
            lo, hi = max(pos, start), min(end, start + seg.nbytes)
            if lo < hi and seg.widen is None and seg.swap <= 1:
                plain.append((seg.path, seg.offset + lo - start, hi - lo, lo - pos))
            elif lo < hi:
                mv[lo - pos:hi - pos] = _exact(_read(self._read, seg, lo - start, hi - start), seg.path, hi - lo)
            i += 1
        for path, offset, nbytes, parts in file_runs(plain):
            data = memoryview(_exact(self._read(path, offset, nbytes), path, nbytes))
            for at, k, to in parts:
                mv[to:to + k] = data[at:at + k]
        self._pos = max(pos, end)
        return max(0, end - pos)


def file_runs(pieces: Sequence[tuple[str, int, int, int]], limit: int = MAX_RUN) -> list[Run]:
    """Group ``pieces`` (``(path, file offset, nbytes, position in the output)``) into reads: pieces of one file
    that lie end to end (one starts where another ends) are one :data:`Run`, up to ``limit`` bytes (a piece larger
    than that is a run of its own). Bytes between pieces are never read."""
    runs: list[Run] = []
    for path, offset, nbytes, to in sorted(pieces):
        last = runs[-1] if runs else None
        if last is not None and last[0] == path and last[1] + last[2] == offset and last[2] + nbytes <= limit:
            last[3].append((last[2], nbytes, to))
            runs[-1] = (path, last[1], last[2] + nbytes, last[3])
        else:
            runs.append((path, offset, nbytes, [(0, nbytes, to)]))
    return runs


def _exact(data: bytes | bytearray, path: str, nbytes: int) -> bytes | bytearray:
    """``data``, checked to be the ``nbytes`` asked of ``path``.

    Raises:
        CorruptCheckpointError: fewer (the file ended first).
    """
    if len(data) != nbytes:
        raise CorruptCheckpointError(f"{path} is truncated: {nbytes} bytes expected, {len(data)} found; "
                                     "re-download it")
    return data


def read_segments(segments: Sequence[Segment], read: ReadRange) -> bytearray:
    """The whole concatenation of ``segments`` in one buffer (segments end to end in one file read at once:
    :meth:`ConcatenatedFile.readinto`).

    Raises:
        CorruptCheckpointError: a file ends before its segment (from ``read``).
    """
    f = ConcatenatedFile(segments, read)
    out = bytearray(f.size)
    f.readinto(out)
    return out
