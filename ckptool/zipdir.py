"""A fast, read-only reader of a zip's central directory, for torch zip checkpoints.

``zipfile.ZipFile`` builds a ``ZipInfo`` object per member, a third of a second for the 50,000 records of a
large state_dict; checkpoints only need each record's name, local-header offset, sizes, CRC-32 and method. This
parses exactly that (APPNOTE.TXT 4.3.12 central directory header, 4.3.14-4.3.16 ZIP64 end records, 4.5.3 ZIP64
extra field) with ``struct.unpack_from`` over one read of the directory.
"""

from __future__ import annotations

import struct
import zlib
from typing import BinaryIO, NamedTuple

from ckptool.errors import CorruptCheckpointError

_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_CDH = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_U32 = 0xFFFFFFFF


class ZipEntry(NamedTuple):
    """One central-directory record: ``name`` (full path in the zip), ``header_offset`` (local header),
    ``compress_size`` / ``file_size`` in bytes, ``crc`` (CRC-32), ``method`` (0 stored, 8 deflated)."""

    name: str
    header_offset: int
    compress_size: int
    file_size: int
    crc: int
    method: int


def read_directory(f: BinaryIO, size: int, path: str) -> list[ZipEntry]:
    """The central directory of the zip in open file ``f`` (``size`` bytes), in directory order.

    Raises:
        CorruptCheckpointError: no end-of-central-directory record (truncated download) or a damaged directory.
    """
    tail_len = min(size, 65535 + 22 + 20)
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    pos = tail.rfind(_EOCD)
    if pos < 0 or pos + 22 > len(tail):
        raise CorruptCheckpointError(
            f"{path} is a damaged zip (no end of central directory: the file is truncated); re-download or re-save it")
    _sig, _d, _dcd, _n_here, count, cd_size, cd_offset, _clen = struct.unpack_from("<IHHHHIIH", tail, pos)
    eocd_at = size - tail_len + pos
    if (count == 0xFFFF or cd_size == _U32 or cd_offset == _U32) and pos >= 20 and tail[pos - 20:pos - 16] == _EOCD64_LOCATOR:
        (z64_at,) = struct.unpack_from("<Q", tail, pos - 20 + 8)
        f.seek(z64_at)
        z = f.read(56)
        if len(z) < 56 or z[:4] != b"PK\x06\x06":
            raise CorruptCheckpointError(f"{path} is a damaged zip (bad ZIP64 end record); re-download it")
        count, _c2, cd_size, cd_offset = struct.unpack_from("<QQQQ", z, 24)
        eocd_at = z64_at
    if cd_offset + cd_size > eocd_at:
        raise CorruptCheckpointError(f"{path} is a damaged zip (central directory out of bounds); re-download it")
    f.seek(cd_offset)
    buf = f.read(cd_size)
    if len(buf) != cd_size:
        raise CorruptCheckpointError(f"{path} is truncated (central directory incomplete); re-download it")
    out: list[ZipEntry] = []
    p = 0
    unpack = _CDH.unpack_from
    try:
        for _ in range(count):
            (sig, _vm, _vn, flags, method, _t, _d2, crc, csize, usize, n, m, k, _disk, _ia, _ea,
             off) = unpack(buf, p)
            if sig != 0x02014B50:
                raise CorruptCheckpointError(f"{path} is a damaged zip (bad central directory entry); re-download it")
            raw = buf[p + 46:p + 46 + n]
            name = raw.decode("utf-8" if flags & 0x800 else "cp437")
            if usize == _U32 or csize == _U32 or off == _U32:
                usize, csize, off = _zip64_extra(buf[p + 46 + n:p + 46 + n + m], usize, csize, off, path)
            out.append(ZipEntry(name, off, csize, usize, crc, method))
            p += 46 + n + m + k
    except struct.error as e:
        raise CorruptCheckpointError(f"{path} is a damaged zip (central directory cut short); re-download it") from e
    return out


def _zip64_extra(extra: bytes, usize: int, csize: int, off: int, path: str) -> tuple[int, int, int]:
    q = 0
    while q + 4 <= len(extra):
        hid, hlen = struct.unpack_from("<HH", extra, q)
        if hid == 0x0001:
            vals = list(struct.unpack_from(f"<{hlen // 8}Q", extra, q + 4))
            if usize == _U32:
                usize = vals.pop(0)
            if csize == _U32:
                csize = vals.pop(0)
            if off == _U32:
                off = vals.pop(0)
            return usize, csize, off
        q += 4 + hlen
    raise CorruptCheckpointError(f"{path} is a damaged zip (ZIP64 sizes missing); re-download it")


def data_offset(f: BinaryIO, entry: ZipEntry, path: str) -> int:
    """Offset of ``entry``'s data in the file, from its local header (30 bytes + name + extra).

    Raises:
        CorruptCheckpointError: the local header is missing.
    """
    f.seek(entry.header_offset)
    hdr = f.read(30)
    if len(hdr) != 30 or hdr[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{path}: bad local header for {entry.name!r}; the zip is damaged")
    n, m = struct.unpack_from("<HH", hdr, 26)
    return entry.header_offset + 30 + n + m


def read_member(f: BinaryIO, entry: ZipEntry, path: str) -> bytes:
    """The (inflated) bytes of ``entry``, checked against its CRC-32.

    Raises:
        CorruptCheckpointError: truncated data, a bad CRC, or an unsupported compression method.
    """
    start = data_offset(f, entry, path)
    f.seek(start)
    data = f.read(entry.compress_size)
    if len(data) != entry.compress_size:
        raise CorruptCheckpointError(f"{path}: {entry.name!r} is truncated; re-download the file")
    if entry.method == 8:
        try:
            data = zlib.decompress(data, -15)
        except zlib.error as e:
            raise CorruptCheckpointError(f"{path}: {entry.name!r} does not inflate ({e}); the file is damaged") from e
    elif entry.method != 0:
        raise CorruptCheckpointError(f"{path}: {entry.name!r} uses unsupported compression method {entry.method}")
    if zlib.crc32(data) != entry.crc:
        raise CorruptCheckpointError(f"{path}: {entry.name!r} fails its CRC-32 check; the file is damaged, re-download it")
    return data
