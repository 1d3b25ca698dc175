"""A fast, read-only reader of a zip's central directory, for torch zip checkpoints.

``zipfile.ZipFile`` builds a ``ZipInfo`` per member (a third of a second for 50,000 records); checkpoints need
each record's name, local-header offset, sizes, CRC-32 and method: parsed (APPNOTE.TXT 4.3.12, 4.3.14-4.3.16
ZIP64 end records, 4.5.3 ZIP64 extra field) with ``struct.unpack_from`` over one read of the directory.
"""

from __future__ import annotations

import struct
import zlib
from collections import Counter
from collections.abc import Callable
from itertools import compress, repeat
from operator import attrgetter, gt, itemgetter
from typing import BinaryIO, NamedTuple

from ckptool.errors import CorruptCheckpointError, TruncatedError

_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
#: a 46-byte central directory header, the fields read: signature, flags, method, CRC-32, compressed and
#: uncompressed sizes, name / extra / comment lengths, local header offset
_CDH_FIELDS = struct.Struct("<I4xHH4xIIIHHH8xI")
_EOCD_FIELDS = struct.Struct("<IHHHHIIH")
#: the ZIP64 end record (APPNOTE.TXT 4.3.14): signature, record size, this disk, the directory's disk, entries on
#: this disk, entries, directory size, directory offset
_EOCD64_FIELDS = struct.Struct("<IQ4xIIQQQQ")
_U32 = 0xFFFFFFFF
#: how far back from the end miniz looks for the end record: 4 KiB blocks, stepping back 4093 bytes, until
#: 65535 + 22 bytes are covered (``mz_zip_reader_locate_header_sig``)
_MINIZ_TAIL = 4096 + 16 * 4093


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


class EndRecord(NamedTuple):
    """Where a zip reader finds the central directory: ``entries`` entries, ``size`` bytes at file offset ``offset``
    (the record's offset plus ``shift``), found from the end record at ``eocd_at``; ``zip64``: the ZIP64 end record
    gave them; ``shift``: added to every offset the directory holds (``zipfile`` reading a zip appended to other
    data; 0 for torch's reader, which takes offsets as absolute)."""

    entries: int
    size: int
    offset: int
    eocd_at: int
    zip64: bool
    shift: int = 0
    #: with ``zip64``: the 32-bit record's (entries, size, offset), which readers without ZIP64 take
    plain: tuple[int, int, int] | None = None


class Directory(list[ZipEntry]):
    """A central directory as one reader reads it: its entries in directory order (a list), the :class:`EndRecord`
    that located it, and ``used``: the directory bytes its entries take (less than ``end.size`` when the directory
    holds more than the declared count)."""

    end: EndRecord
    used: int = 0


def duplicate_member(name: str) -> str:
    """Why a zip holding two members named ``name`` is refused by every command (``scan``'s verdict ``error``):
    one loader reads the first, another the last (a zip-confusion), so a check may not read what a loader runs."""
    return (f"the zip holds two members named {name!r}; loaders may read either one (a zip-confusion: two readers "
            "may see two different files), so ckptool refuses the file")


def _no_end(path: str) -> CorruptCheckpointError:
    return TruncatedError(
        f"{path} is a damaged zip (no end of central directory: the file is truncated); re-download or re-save it")


def torch_end_record(f: BinaryIO, size: int, path: str, *, zip64: bool = True) -> EndRecord:
    """The end of the zip in open file ``f`` (``size`` bytes) as torch's reader finds it (miniz 3.0.2,
    ``mz_zip_reader_read_central_dir``): the last end record signature with 22 bytes after it in the last
    :data:`_MINIZ_TAIL` bytes; the ZIP64 end record whenever a ZIP64 locator precedes it and points at a ZIP64
    record (whatever the 32-bit record holds); offsets absolute. ``zip64=False``: the 32-bit record alone (what a
    reader takes that uses the ZIP64 record only when the 32-bit one holds its 0xFFFF markers).

    Raises:
        CorruptCheckpointError: no end record, a ZIP64 locator pointing past the end, a directory out of bounds,
            smaller than its entries, on another disk, or over :data:`MAX_DIRECTORY`.
    """
    lo, tail, pos = _miniz_end_signature(f, size, path)
    eocd_at = lo + pos
    fields = _EOCD_FIELDS.unpack_from(tail, pos)[1:7]
    _this_disk, _cd_disk, _on_disk, count, cd_size, cd_offset = fields
    plain = (count, cd_size, cd_offset)
    z64 = _miniz_zip64(f, size, path, tail, pos, eocd_at) if zip64 and eocd_at >= 20 + 56 else None
    found64 = z64 is not None
    if z64 is not None:
        fields = z64
    elif count == 0xFFFF or cd_size == _U32 or cd_offset == _U32:
        raise CorruptCheckpointError(f"{path} is a damaged zip (bad ZIP64 end record); re-download it")
    this_disk, cd_disk, on_disk, count, cd_size, cd_offset = fields
    if count != on_disk or ((this_disk | cd_disk) and (this_disk, cd_disk) != (1, 1)):
        raise CorruptCheckpointError(
            f"{path} is a damaged zip (the end record's entry counts or disk numbers disagree: {count} entries, "
            f"{on_disk} on this disk); torch refuses it too")
    if cd_offset + cd_size > size or cd_size < 46 * count:
        raise CorruptCheckpointError(f"{path} is a damaged zip (central directory out of bounds); re-download it")
    return EndRecord(count, cd_size, cd_offset, eocd_at, found64, 0, plain if found64 else None)


def _miniz_end_signature(f: BinaryIO, size: int, path: str) -> tuple[int, bytes, int]:
    """``(lo, tail, pos)``: the file's bytes from ``lo`` to its end, and the last end record signature in them
    with 22 bytes after it, as miniz looks for it (the last 64 KiB first, where a valid end record lies, then the
    last :data:`_MINIZ_TAIL` bytes).

    Raises:
        CorruptCheckpointError: there is none.
    """
    for window in (65535 + 22 + 20, _MINIZ_TAIL):
        lo = max(0, size - window)
        f.seek(lo)
        tail = f.read(size - lo)
        pos = tail.rfind(_EOCD, 0, max(0, len(tail) - 18))
        if pos >= 0 or lo == 0:
            break
    if pos < 0:
        raise _no_end(path)
    return lo, tail, pos


def _miniz_zip64(f: BinaryIO, size: int, path: str, tail: bytes, pos: int, eocd_at: int
                 ) -> tuple[int, int, int, int, int, int] | None:
    """``(this disk, directory's disk, entries on this disk, entries, directory size, directory offset)`` of the
    ZIP64 end record a ZIP64 locator just before the end record (at ``eocd_at``; ``tail[pos]``) points at, or None
    where there is no locator or no ZIP64 record there.

    Raises:
        CorruptCheckpointError: the locator points past the end, or the ZIP64 record is damaged.
    """
    if pos >= 20:
        loc = tail[pos - 20:pos]
    else:
        f.seek(eocd_at - 20)
        loc = f.read(20)
    if loc[:4] != _EOCD64_LOCATOR:
        return None
    z64_at, disks = struct.unpack_from("<QI", loc, 8)
    if z64_at > size - 56:
        raise CorruptCheckpointError(f"{path} is a damaged zip (bad ZIP64 end record); re-download it")
    f.seek(z64_at)
    z = f.read(56)
    if z[:4] != _EOCD64:
        return None
    _s, rec_size, this_disk, cd_disk, on_disk, count, cd_size, cd_offset = _EOCD64_FIELDS.unpack(z)
    if rec_size < 44 or disks != 1 or count > _U32 or on_disk > _U32 or cd_size > _U32:
        raise CorruptCheckpointError(f"{path} is a damaged zip (bad ZIP64 end record); re-download it")
    return this_disk, cd_disk, on_disk, count, cd_size, cd_offset


def zipfile_end_record(f: BinaryIO, size: int, path: str) -> EndRecord:
    """The end of the zip in open file ``f`` as Python's ``zipfile`` finds it (3.11, ``_EndRecData``,
    ``_EndRecData64``, ``ZipFile._RealGetContents``): the record in the last 22 bytes if it has no comment, else the
    last signature in the last 64 KiB + 22 bytes; the ZIP64 end record that sits just before the ZIP64 locator
    (the locator's offset is not used); ``shift`` = the bytes between the directory's recorded end and the record
    (data before the zip), added to every offset; every entry up to the directory's size is read, whatever the
    count.

    Raises:
        CorruptCheckpointError: where ``zipfile`` raises ``BadZipFile``.
    """
    if size < 22:
        raise _no_end(path)
    f.seek(size - 22)
    last = f.read(22)
    if last[:4] == _EOCD and last[-2:] == b"\0\0":
        eocd_at, rec = size - 22, last
    else:
        lo = max(size - (1 << 16) - 22, 0)
        f.seek(lo)
        data = f.read(size - lo)
        at = data.rfind(_EOCD)
        if at < 0 or at + 22 > len(data):
            raise _no_end(path)
        eocd_at, rec = lo + at, data[at:at + 22]
    _s, _d, _dcd, _n, count, cd_size, cd_offset, _c = _EOCD_FIELDS.unpack(rec)
    zip64 = False
    if eocd_at >= 20:
        f.seek(eocd_at - 20)
        loc = f.read(20)
        if loc[:4] == _EOCD64_LOCATOR:
            diskno, _rel, disks = struct.unpack_from("<IQI", loc, 4)
            if diskno != 0 or disks > 1:
                raise CorruptCheckpointError(f"{path}: zipfile refuses a zip spanning several disks")
            if eocd_at >= 76:
                f.seek(eocd_at - 76)
                z = f.read(56)
                if z[:4] == _EOCD64:
                    zip64 = True
                    _s, _rs, _td, _cd, _od, count, cd_size, cd_offset = _EOCD64_FIELDS.unpack(z)
    shift = eocd_at - cd_size - cd_offset - (76 if zip64 else 0)
    if cd_offset + shift < 0:
        raise CorruptCheckpointError(f"{path} is a damaged zip (bad offset for central directory)")
    return EndRecord(count, cd_size, cd_offset + shift, eocd_at, zip64, shift)


def read_directory(f: BinaryIO, size: int, path: str) -> Directory:
    """The central directory of the zip in open file ``f`` (``size`` bytes) as torch reads it
    (:func:`torch_end_record`: ``count`` entries from the directory's start), in directory order.

    Raises:
        CorruptCheckpointError: no end-of-central-directory record (truncated download) or a damaged directory.
    """
    return _read_entries(f, torch_end_record(f, size, path), path, counted=True)


def plain_directory(f: BinaryIO, size: int, path: str) -> Directory:
    """The central directory the 32-bit end record points to, ignoring a ZIP64 locator (what readers take that use
    the ZIP64 record only when the 32-bit one is saturated; ckptool before 0.x).

    Raises:
        CorruptCheckpointError: as :func:`read_directory`.
    """
    return _read_entries(f, torch_end_record(f, size, path, zip64=False), path, counted=True)


def zipfile_directory(f: BinaryIO, size: int, path: str, torch_view: Directory | None = None) -> Directory:
    """The central directory of the zip in open file ``f`` as Python's ``zipfile`` reads it
    (:func:`zipfile_end_record`: every entry in the directory's bytes, offsets shifted, names cut at a NUL as
    ``ZipInfo`` does). ``torch_view``: torch's directory of the same file, returned as is when ``zipfile`` finds
    the same one (same place, no shift, no bytes after the counted entries).

    Raises:
        CorruptCheckpointError: where ``zipfile.ZipFile`` raises ``BadZipFile``.
    """
    end = zipfile_end_record(f, size, path)
    if torch_view is not None:
        t = torch_view.end
        if (end.offset, end.size, end.shift) == (t.offset, t.size, 0) and torch_view.used == t.size:
            return torch_view
    out = _read_entries(f, end, path, counted=False)
    if any("\0" in e.name for e in out):
        out[:] = [e._replace(name=e.name.split("\0", 1)[0]) if "\0" in e.name else e for e in out]
    return out


def _read_entries(f: BinaryIO, end: EndRecord, path: str, *, counted: bool) -> Directory:
    """The entries of the directory ``end`` locates: ``end.entries`` of them (``counted``, as miniz) or as many as its
    bytes hold (as ``zipfile``), each offset plus ``end.shift``."""
    cd_size = end.size
    if cd_size > MAX_DIRECTORY:
        raise CorruptCheckpointError(
            f"{path}: the zip central directory declares {cd_size} bytes, over ckptool's limit of {MAX_DIRECTORY}")
    f.seek(end.offset)
    buf = f.read(cd_size)
    if len(buf) != cd_size:
        raise TruncatedError(f"{path} is truncated (central directory incomplete); re-download it")
    out = Directory()
    out.end = end
    append = out.append
    p = 0
    unpack = _CDH_FIELDS.unpack_from
    new = tuple.__new__  # ZipEntry(...) without the NamedTuple's Python-level __new__: 50,000 records add up
    shift = end.shift
    # every name sliced from one Latin-1 decoding of the directory: an ASCII name (all of torch's) reads the same in
    # UTF-8 and cp437; any other name is decoded from its bytes
    text = buf.decode("latin-1")
    try:
        left = end.entries if counted else -1
        while (left > 0) if counted else (p < cd_size):
            left -= 1
            sig, flags, method, crc, csize, usize, n, m, k, off = unpack(buf, p)
            if sig != 0x02014B50:
                raise CorruptCheckpointError(f"{path} is a damaged zip (bad central directory entry); re-download it")
            name = text[p + 46:p + 46 + n]
            if not name.isascii():
                name = buf[p + 46:p + 46 + n].decode("utf-8" if flags & 0x800 else "cp437")
            if usize == _U32 or csize == _U32 or off == _U32:
                usize, csize, off = _zip64_extra(buf[p + 46 + n:p + 46 + n + m], usize, csize, off, path)
            append(new(ZipEntry, (name, off + shift, csize, usize, crc, method, flags)))
            p += 46 + n + m + k
    except (struct.error, IndexError) as e:
        raise CorruptCheckpointError(f"{path} is a damaged zip (central directory cut short); re-download it") from e
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(
            f"{path} is a damaged zip (a member name is not valid UTF-8); re-download it") from e
    if p > cd_size:
        raise CorruptCheckpointError(f"{path} is a damaged zip (central directory cut short); re-download it")
    out.used = p
    return out


def raw_name(e: ZipEntry) -> bytes:
    """The bytes of ``e``'s name as the directory holds them (UTF-8 when its flag bit 11 says so, else cp437)."""
    return e.name.encode("utf-8" if e.flags & 0x800 else "cp437")


def _miniz_sorted(keys: list[bytes]) -> list[int]:
    """The entry indices in the order miniz's heap sort leaves them (``mz_zip_reader_sort_central_dir_offsets_by_
    filename``, comparing lower-cased names): among names equal but for case, this order decides which one a lookup
    finds."""
    size = len(keys)
    idx = list(range(size))
    if size <= 1:
        return idx

    def sift(root: int, end: int) -> None:
        while True:
            child = 2 * root + 1
            if child >= end:
                return
            if child + 1 < end and keys[idx[child]] < keys[idx[child + 1]]:
                child += 1
            if not keys[idx[root]] < keys[idx[child]]:
                return
            idx[root], idx[child] = idx[child], idx[root]
            root = child

    for start in range((size - 2) >> 1, -1, -1):
        sift(start, size)
    for end in range(size - 1, 0, -1):
        idx[end], idx[0] = idx[0], idx[end]
        sift(0, end)
    return idx


class TorchRecords:
    """The records of a zip as torch's ``PyTorchStreamReader`` (torch 2.13, miniz 3.0.2) finds them: under the
    folder of the first member (``archive/``; ``prefix`` None when it is in none: torch refuses the file), as
    ``mz_zip_reader_locate_file`` does: ignoring ASCII case, and among names equal but for case (or not at all), the
    one its binary search over the heap-sorted directory hits."""

    def __init__(self, entries: list[ZipEntry]) -> None:
        self.entries = entries
        first = entries[0].name if entries else ""
        self.prefix: str | None = first.split("/", 1)[0] + "/" if "/" in first else None
        #: the prefix's bytes as the directory holds them (the folder of a cp437 name is not its UTF-8 encoding)
        self._prefix_raw = raw_name(entries[0]).split(b"/", 1)[0] + b"/" if self.prefix is not None else b""
        self._lower: dict[bytes, tuple[int, ...]] | None = None
        self._order: list[int] | None = None
        self._keys: list[bytes] = []

    def _index(self) -> dict[bytes, tuple[int, ...]]:
        """Lower-cased raw name -> the indices of the entries that have it; built once, in C loops for ASCII
        names free of newlines (torch's); only a name held more than once is looked for in Python."""
        if self._lower is None:
            names = [e.name for e in self.entries]
            text = "\n".join(names)
            if text.isascii() and text.count("\n") == len(names) - 1:
                self._keys = text.lower().encode("ascii").split(b"\n") if names else []
            else:
                self._keys = [raw_name(e).lower() for e in self.entries]
            keys = self._keys
            lower: dict[bytes, tuple[int, ...]] = dict(zip(keys, zip(range(len(keys)))))  # k -> (i,), in C
            if len(lower) < len(keys):  # names equal but for case: every index, in directory order
                found: dict[bytes, list[int]] = {k: [] for k, n in Counter(keys).items() if n > 1}
                for i, k in enumerate(keys):
                    if k in found:
                        found[k].append(i)
                lower.update((k, tuple(hits)) for k, hits in found.items())
            self._lower = lower
        return self._lower

    def lacking(self, template: str, needs: dict[str, int]) -> tuple[list[str], list[str]]:
        """The keys of ``needs`` (key -> bytes declared) whose record ``template.format(key=key)`` (``data/{key}``)
        torch does not find (:meth:`find`), and those whose record holds fewer bytes, in order (in C loops for
        plain ASCII keys: the 50,000 storages of a large state_dict)."""
        keys, (head, _, tail) = list(needs), template.partition("{key}")
        text = "\n".join(keys)
        if keys and text.isascii() and text.count("\n") == len(keys) - 1 and template.isascii() and \
                self.prefix is not None and self._prefix_raw.isascii():
            lead = self._prefix_raw.decode("ascii") + head
            names = (lead + text.replace("\n", tail + "\n" + lead) + tail).lower().encode("ascii").split(b"\n")
            index, entries = self._index(), self.entries
            hits = list(map(index.get, names, repeat(())))
            if set(map(len, hits)) == {1}:  # each record there once: its size, in C loops
                sizes = map(attrgetter("file_size"), map(entries.__getitem__, map(itemgetter(0), hits)))
                return [], list(compress(keys, map(gt, needs.values(), sizes)))
        found = {k: self.find(template.format(key=k)) for k in keys}
        return [k for k, e in found.items() if e is None], [k for k, e in found.items() if e and needs[k] > e.file_size]

    def find(self, name: str) -> ZipEntry | None:
        """The entry torch reads for record ``name`` (``data.pkl``, ``data/0``), or None where torch finds none."""
        if self.prefix is None:
            return None
        target = (self._prefix_raw + name.encode("utf-8")).lower()
        hits = self._index().get(target)
        if not hits:
            return None
        if len(hits) == 1:
            return self.entries[hits[0]]
        if self._order is None:
            self._order = _miniz_sorted(self._keys)
        keys, order = self._keys, self._order
        lo, hi = 0, len(order) - 1
        while lo <= hi:
            mid = lo + ((hi - lo) >> 1)
            k = keys[order[mid]]
            if k == target:
                return self.entries[order[mid]]
            if k < target:
                lo = mid + 1
            else:
                hi = mid - 1
        return None  # not reached: a sorted order holds the target

    def variants(self, name: str) -> list[ZipEntry]:
        """Every entry whose name equals record ``name`` under the prefix but for ASCII case (the candidates a
        case-sensitive reader such as ``zipfile`` may pick instead)."""
        if self.prefix is None:
            return []
        target = (self._prefix_raw + name.encode("utf-8")).lower()
        return [self.entries[i] for i in self._index().get(target, [])]


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
    if entry.header_offset < 0:  # zipfile's view of a zip whose directory points before the file's start
        raise CorruptCheckpointError(f"{path}: {entry.name!r} starts before the file does; the zip is damaged")
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
            raise TruncatedError(f"{path}: {entry.name!r} is truncated; re-download the file")
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
                raise TruncatedError(f"{path}: {entry.name!r} is truncated; re-download the file")
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
