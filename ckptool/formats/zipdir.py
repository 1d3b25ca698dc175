"""A fast, read-only reader of a zip's central directory, for torch zip checkpoints.

``zipfile.ZipFile`` builds a ``ZipInfo`` object per member, a third of a second for the 50,000 records of a
large state_dict; checkpoints only need each record's name, local-header offset, sizes, CRC-32 and method. This
parses exactly that (APPNOTE.TXT 4.3.12 central directory header, 4.3.14-4.3.16 ZIP64 end records, 4.5.3 ZIP64
extra field) with ``struct.unpack_from`` over one read of the directory.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import BinaryIO, NamedTuple

from ckptool.errors import CorruptCheckpointError

_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
#: a 46-byte central directory header, the fields read: signature, flags, method, CRC-32, compressed and
#: uncompressed sizes, name / extra / comment lengths, local header offset
_CDH_FIELDS = struct.Struct("<I4xHH4xIIIHHH8xI")
_U32 = 0xFFFFFFFF


#: the most bytes a compressed (deflated) record may inflate to: torch stores every record uncompressed, so only
#: re-packed archives compress, and a small record inflating to gigabytes is a zip bomb
MAX_INFLATE = 1 << 30
#: inflation produces at most this many bytes per step (the unit of memory a zip bomb can cost before a check)
INFLATE_CHUNK = 1 << 20
#: compressed bytes are read this many at a time
READ_CHUNK = 1 << 20
#: a deflated member may declare this many inflated bytes, or :data:`MAX_RATIO` times its compressed size:
#: torch's pickles deflate about 5 times (a 50,000-tensor data.pkl: 5.0 at level 9), tensors less; 1 MiB of
#: deflated zeros inflates to 1 GiB
FREE_INFLATE = 4 << 20
MAX_RATIO = 16
#: the largest central directory read (about 12 million records)
MAX_DIRECTORY = 1 << 30
#: general purpose flag bits 0 (encrypted) and 6 (strong encryption)
ENCRYPTED = 0x1 | 0x40


class ZipEntry(NamedTuple):
    """One central-directory record: ``name`` (full path in the zip), ``header_offset`` (local header),
    ``compress_size`` / ``file_size`` in bytes, ``crc`` (CRC-32), ``method`` (0 stored, 8 deflated), ``flags``
    (general purpose bit flags; bit 0 = encrypted)."""

    name: str
    header_offset: int
    compress_size: int
    file_size: int
    crc: int
    method: int
    flags: int = 0


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
    zip64 = count == 0xFFFF or cd_size == _U32 or cd_offset == _U32
    if zip64 and pos >= 20 and tail[pos - 20:pos - 16] == _EOCD64_LOCATOR:
        (z64_at,) = struct.unpack_from("<Q", tail, pos - 20 + 8)
        f.seek(z64_at)
        z = f.read(56)
        if len(z) < 56 or z[:4] != b"PK\x06\x06":
            raise CorruptCheckpointError(f"{path} is a damaged zip (bad ZIP64 end record); re-download it")
        count, _c2, cd_size, cd_offset = struct.unpack_from("<QQQQ", z, 24)
        eocd_at = z64_at
    if cd_offset + cd_size > eocd_at:
        raise CorruptCheckpointError(f"{path} is a damaged zip (central directory out of bounds); re-download it")
    if cd_size > MAX_DIRECTORY:
        raise CorruptCheckpointError(
            f"{path}: the zip central directory declares {cd_size} bytes, over ckptool's limit of {MAX_DIRECTORY}")
    f.seek(cd_offset)
    buf = f.read(cd_size)
    if len(buf) != cd_size:
        raise CorruptCheckpointError(f"{path} is truncated (central directory incomplete); re-download it")
    out: list[ZipEntry] = []
    append = out.append
    p = 0
    unpack = _CDH_FIELDS.unpack_from
    new = tuple.__new__  # ZipEntry(...) without the NamedTuple's Python-level __new__: 50,000 records add up
    # every name sliced from one Latin-1 decoding of the directory: an ASCII name (all of torch's) reads the same in
    # UTF-8 and cp437; any other name is decoded from its bytes
    text = buf.decode("latin-1")
    try:
        for _ in range(count):
            sig, flags, method, crc, csize, usize, n, m, k, off = unpack(buf, p)
            if sig != 0x02014B50:
                raise CorruptCheckpointError(f"{path} is a damaged zip (bad central directory entry); re-download it")
            name = text[p + 46:p + 46 + n]
            if not name.isascii():
                name = buf[p + 46:p + 46 + n].decode("utf-8" if flags & 0x800 else "cp437")
            if usize == _U32 or csize == _U32 or off == _U32:
                usize, csize, off = _zip64_extra(buf[p + 46 + n:p + 46 + n + m], usize, csize, off, path)
            append(new(ZipEntry, (name, off, csize, usize, crc, method, flags)))
            p += 46 + n + m + k
    except (struct.error, IndexError) as e:
        raise CorruptCheckpointError(f"{path} is a damaged zip (central directory cut short); re-download it") from e
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(
            f"{path} is a damaged zip (a member name is not valid UTF-8); re-download it") from e
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
    n: int
    m: int
    n, m = struct.unpack_from("<HH", hdr, 26)
    return entry.header_offset + 30 + n + m


def read_member(f: BinaryIO, entry: ZipEntry, path: str, *, limit: int | None = None, check_crc: bool = True,
                watch: Callable[[bytearray], None] | None = None) -> bytes:
    """The (inflated) bytes of ``entry``, checked against its CRC-32 unless ``check_crc=False``: :func:`member_buffer`
    as ``bytes``.

    Raises:
        CorruptCheckpointError: see :func:`member_buffer`.
    """
    data = member_buffer(f, entry, path, limit=limit, check_crc=check_crc, watch=watch)
    return data if type(data) is bytes else bytes(data)


def member_buffer(f: BinaryIO, entry: ZipEntry, path: str, *, limit: int | None = None, check_crc: bool = True,
                  watch: Callable[[bytearray], None] | None = None) -> bytes | bytearray:
    """The content of ``entry`` in one buffer: ``bytes`` for a stored member, a ``bytearray`` for a deflated one.

    A deflated member is inflated as a stream (APPNOTE.TXT 4.4.5 method 8, ``zlib.decompressobj``): the compressed
    bytes are read :data:`READ_CHUNK` at a time, the output grows :data:`INFLATE_CHUNK` at a time in one buffer, and
    its CRC-32 is computed as it grows. Inflation stops, and the member is refused, as soon as the output passes the
    declared size (as miniz, torch's zip reader, requires); before anything is inflated, a member that declares more
    than ``limit`` bytes (default :data:`MAX_INFLATE`), or, past :data:`FREE_INFLATE` bytes, more than
    :data:`MAX_RATIO` times its compressed size, is refused. A zip bomb costs at most a few chunks of memory and
    time. ``watch(buffer)``, if given, is called after each chunk and may raise to refuse the
    member early (the pickle reader checks the opcodes that have arrived).

    Raises:
        CorruptCheckpointError: truncated data, a bad CRC, an encrypted member, a member that inflates past (or
            short of) its declared size, past ``limit`` or past the ratio, or an unsupported compression method.
    """
    limit = MAX_INFLATE if limit is None else limit
    if entry.flags & ENCRYPTED:
        raise CorruptCheckpointError(f"{path}: {entry.name!r} is encrypted; torch cannot read it either")
    if entry.method == 0 and entry.compress_size != entry.file_size:
        raise CorruptCheckpointError(
            f"{path}: stored member {entry.name!r} declares {entry.compress_size} bytes stored but {entry.file_size} "
            "bytes of content; the zip is damaged")
    if entry.method == 8 and entry.file_size > limit:
        raise CorruptCheckpointError(
            f"{path}: {entry.name!r} declares {entry.file_size} bytes once inflated, over ckptool's limit of {limit} "
            "bytes for compressed records (a zip bomb?); torch never compresses records: re-save the checkpoint")
    if entry.method not in (0, 8):
        raise CorruptCheckpointError(f"{path}: {entry.name!r} uses unsupported compression method {entry.method}")
    if entry.method == 8 and entry.file_size > max(FREE_INFLATE, MAX_RATIO * entry.compress_size):
        raise CorruptCheckpointError(
            f"{path}: {entry.name!r} declares {entry.file_size} bytes once inflated from {entry.compress_size}, more "
            f"than {MAX_RATIO} times its compressed size past {FREE_INFLATE >> 20} MiB (a zip bomb?); torch never "
            "compresses records: if you trust the file, re-save it with torch.save")
    f.seek(data_offset(f, entry, path))
    if entry.method == 0:
        data = f.read(entry.compress_size)
        if len(data) != entry.compress_size:
            raise CorruptCheckpointError(f"{path}: {entry.name!r} is truncated; re-download the file")
        if check_crc and zlib.crc32(data) != entry.crc:
            raise _bad_crc(path, entry)
        return data
    out, crc = _inflate(f, entry, path, watch)
    if check_crc and crc != entry.crc:
        raise _bad_crc(path, entry)
    return out


def _bad_crc(path: str, entry: ZipEntry) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {entry.name!r} fails its CRC-32 check; the file is damaged, re-download it")


def _inflate(f: BinaryIO, entry: ZipEntry, path: str,
             watch: Callable[[bytearray], None] | None) -> tuple[bytearray, int]:
    """Inflate ``entry`` (``f`` positioned at its data) into one bytearray; returns it and its CRC-32."""
    declared = entry.file_size
    d = zlib.decompressobj(-15)
    out = bytearray()
    crc = 0
    left = entry.compress_size
    pending = b""
    while not d.eof:
        if not pending:
            if left <= 0:
                raise CorruptCheckpointError(
                    f"{path}: {entry.name!r} inflates to {len(out)} bytes before its data ends, not its declared "
                    f"{declared}; the file is damaged")
            pending = f.read(min(READ_CHUNK, left))
            if not pending:
                raise CorruptCheckpointError(f"{path}: {entry.name!r} is truncated; re-download the file")
            left -= len(pending)
        try:
            piece = d.decompress(pending, INFLATE_CHUNK)
        except zlib.error as e:
            raise CorruptCheckpointError(f"{path}: {entry.name!r} does not inflate ({e}); the file is damaged") from e
        pending = d.unconsumed_tail
        if not piece:
            continue
        n = len(out) + len(piece)
        if n > declared:
            raise CorruptCheckpointError(
                f"{path}: {entry.name!r} inflates past its declared size of {declared} bytes (a zip bomb or "
                "a damaged file); refusing to read it")
        out += piece
        crc = zlib.crc32(piece, crc)
        if watch is not None:
            watch(out)
    if len(out) != declared:
        raise CorruptCheckpointError(
            f"{path}: {entry.name!r} inflates to {len(out)} bytes, not its declared {declared}; the file is damaged")
    return out, crc


def read_member_head(f: BinaryIO, entry: ZipEntry, path: str, n: int = 8) -> bytes:
    """The first ``n`` bytes of ``entry``'s content (inflating at most 64 KiB of a deflated member), to see what
    it is without reading it all.

    Raises:
        CorruptCheckpointError: an encrypted member, a local header that is missing, data that does not inflate, or
            an unsupported compression method.
    """
    if entry.flags & ENCRYPTED:
        raise CorruptCheckpointError(f"{path}: {entry.name!r} is encrypted; torch cannot read it either")
    f.seek(data_offset(f, entry, path))
    if entry.method == 0:
        return f.read(min(n, entry.compress_size))
    if entry.method != 8:
        raise CorruptCheckpointError(f"{path}: {entry.name!r} uses unsupported compression method {entry.method}")
    try:
        return zlib.decompressobj(-15).decompress(f.read(min(entry.compress_size, 1 << 16)), n)
    except zlib.error as e:
        raise CorruptCheckpointError(f"{path}: {entry.name!r} does not inflate ({e}); the file is damaged") from e
