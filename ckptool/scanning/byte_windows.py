"""Byte-level pieces of ``ckptool scan`` (:mod:`ckptool.scanning.pickles`): :class:`Window`, a range of a mapped
file seen as a file and as bytes, and where a zip's end record says the zip starts and ends."""

from __future__ import annotations

import io
import struct
from typing import Any, BinaryIO, TypeAlias, cast

from ckptool.formats.pickle_check import PickleBuffer

__all__ = ["ZIP_EOCD", "ZIP_LOCAL", "Container", "Window", "as_file", "end_record", "zip_end", "zip_start"]

#: the signature of a zip local file header (the first bytes of a zip)
ZIP_LOCAL = b"PK\x03\x04"
#: the signature of a zip end of central directory record
ZIP_EOCD = b"PK\x05\x06"


class Window:
    """``length`` bytes at ``start`` of a mapped file, seen as a file (``seek``/``read``/``tell``) and as a byte
    sequence (``len``, an index gives an int, a slice gives bytes): one item of a DCP ``.distcp`` file, read by
    the zip directory reader without copying the rest."""

    def __init__(self, mm: PickleBuffer, start: int, length: int) -> None:
        self.mm, self.start, self.length, self.pos = mm, start, length, 0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            a, b, _ = k.indices(self.length)
            return bytes(self.mm[self.start + a:self.start + max(a, b)])
        if not -self.length <= k < self.length:
            raise IndexError(k)
        return self.mm[self.start + (k % self.length)]

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        end = self.length if n is None or n < 0 else min(self.length, self.pos + n)
        out = self[self.pos:end] if end > self.pos else b""
        self.pos = max(self.pos, end)
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


#: what the container readers walk: the bytes of a file or member, a mapped file, or a window of one
Container: TypeAlias = "PickleBuffer | Window"


def end_record(buf: Container) -> tuple[int, int, int, int] | None:
    """``(eocd offset, central directory size, central directory offset, comment length)`` of the last end of
    central directory record in the last 64 KiB of ``buf``, or None."""
    size = len(buf)
    # 20 bytes more than the search needs, where torch's reader looks for a ZIP64 locator: on a remote file one
    # range read then serves both (ckptool._ranges.RangeStore)
    lo = max(0, size - (65535 + 22 + 20))
    tail = bytes(buf[lo:size])
    at = tail.rfind(ZIP_EOCD, max(0, size - lo - (65535 + 22)))
    if at < 0 or at + 22 > len(tail):
        return None
    _sig, _d, _dcd, _n, _count, cd_size, cd_offset, clen = struct.unpack_from("<IHHHHIIH", tail, at)
    return lo + at, cd_size, cd_offset, clen


def zip_start(buf: Container, pos: int) -> int | None:
    """Where a zip appended after ``pos`` starts (what ``zipfile`` computes: end record - directory size -
    directory offset), or None."""
    found = end_record(buf)
    if found is None:
        return None
    eocd_at, cd_size, cd_offset, _clen = found
    start = eocd_at - cd_size - cd_offset
    if start < pos or bytes(buf[start:start + 4]) != ZIP_LOCAL:
        return None
    return start


def zip_end(buf: Container) -> int | None:
    """The offset just after the last end of central directory record of ``buf`` (and its comment), or None."""
    found = end_record(buf)
    return None if found is None else found[0] + 22 + found[3]


def as_file(buf: Container) -> BinaryIO:
    """``buf`` as a file: a :class:`Window` is one already; bytes and mapped files get a ``BytesIO``."""
    if isinstance(buf, Window):
        return cast(BinaryIO, buf)
    return io.BytesIO(buf if isinstance(buf, bytes) else bytes(buf))
