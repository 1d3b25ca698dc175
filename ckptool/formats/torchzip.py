"""The zip container ``torch.save`` writes.

:class:`TorchZipWriter` writes the zip layout of torch's ``PyTorchStreamWriter`` (caffe2/serialize/inline_container.cc):
every record stored uncompressed under one top folder, its data starting on a 64-byte boundary (padding goes
into a local-header extra field, id ``FB``) so that ``torch.load(mmap=True)`` can map it, with ZIP64 records
when sizes, offsets or the entry count need them. Record bytes are copied from the source file with
:func:`ckptool._fileio.copy_range` (``os.copy_file_range`` where the kernel offers it), so memory stays bounded
whatever the record size, and the write-back of the output starts as it is written
(:class:`ckptool._fileio.WriteBehind`), so that the final fsync of :func:`ckptool._fileio.atomic_output` is short.

Copy-free on a filesystem with reflinks (XFS ``reflink=1``, btrfs): when the source and the output can share
extents (:func:`ckptool._fileio.clone_block`, tried once per source file), a large record's data is laid out at an
offset congruent with its source offset modulo the block size (the local header's ``FB`` padding grows to at most
one block less 1 byte; the 64-byte alignment holds, as the source offset is 64-aligned), so
:func:`~ckptool._fileio.copy_range` clones its whole blocks (``FICLONERANGE``) instead of copying them. Elsewhere
the layout is the one above, byte for byte.
"""

from __future__ import annotations

import secrets
import struct
import zlib
from collections.abc import Callable
from typing import BinaryIO

from ckptool._fileio import clone_block, copy_range, copy_range_crc, write_behind_for
from ckptool.errors import CkptError

ALIGNMENT = 64
SMALL_RECORD = 1 << 20
_U32 = 0xFFFFFFFF
_DOS_DATE = (0 << 11) | (0 << 5) | 0, (0 << 9) | (1 << 5) | 1  # 00:00:00, 1980-01-01 (what miniz writes)


class TorchZipWriter:
    """Write records into an open, seekable binary file in the zip layout torch reads.

    Use :meth:`write_bytes` for small records, :meth:`copy_record` for a byte range of another file; then
    :meth:`close` writes the central directory. The caller owns the file object.

    ``progress``, if given, is called with a number of bytes each time a piece of a record body has been copied
    by :meth:`copy_record` (at most 8 MiB per call); the calls for one record add up to its size, so the calls
    for a file add up to the sum of the ``size`` arguments of :meth:`copy_record`. Records written with
    :meth:`write_bytes` (the pickle, small metadata) are not counted.
    """

    def __init__(self, f: BinaryIO, archive_name: str, *, progress: Callable[[int], None] | None = None) -> None:
        self.f = f
        self.prefix = archive_name.strip("/") + "/"
        #: name, crc, size, local header offset, compression method (0 stored, 8 deflated), compressed size
        self.entries: list[tuple[bytes, int, int, int, int, int]] = []
        self.pos = f.tell()
        self.progress = progress
        self._behind = write_behind_for(f)  # None for a file object without a descriptor (io.BytesIO)
        #: id(source file) -> (the file, kept so that its id is not reused; its clone block size, 0: copy)
        self._blocks: dict[int, tuple[BinaryIO, int]] = {}

    # -- local header --------------------------------------------------------------------------------------
    def _clone_block(self, src: BinaryIO, offset: int) -> int:
        """The block size at which the record at ``offset`` of ``src`` can be cloned into the output, else 0."""
        if offset % ALIGNMENT:  # aligning to it would break the 64-byte alignment mmap needs
            return 0
        got = self._blocks.get(id(src))
        if got is None:
            got = self._blocks[id(src)] = (src, clone_block(src, self.f))
        return got[1]

    def _header(self, name: bytes, size: int, crc: int, csize: int | None = None,
                method: int = 0, congruent: tuple[int, int] = (0, ALIGNMENT)) -> tuple[bytes, int]:
        csize = size if csize is None else csize
        zip64 = size >= _U32 or csize >= _U32
        extra = struct.pack("<HHQQ", 0x0001, 16, size, csize) if zip64 else b""
        base = 30 + len(name) + len(extra)
        target, modulus = congruent  # the data starts at an offset congruent with target modulo modulus
        pad = (target - (self.pos + base + 4)) % modulus
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding field, as PyTorchStreamWriter
        s32, c32 = (_U32, _U32) if zip64 else (size, csize)
        hdr = struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, method, _DOS_DATE[0], _DOS_DATE[1], crc, c32, s32,
            len(name), len(extra),
        ) + name + extra
        return hdr, 14  # offset of the CRC field inside the header

    def _begin(self, record: str, size: int, crc: int, csize: int | None = None,
               method: int = 0, congruent: tuple[int, int] = (0, ALIGNMENT)) -> tuple[bytes, int]:
        name = (self.prefix + record).encode("utf-8")
        offset = self.pos
        hdr, _ = self._header(name, size, crc, csize, method, congruent)
        self.f.write(hdr)
        self.pos += len(hdr)
        return name, offset

    def write_bytes(self, record: str, data: bytes) -> None:
        """Write ``data`` as the record ``<archive>/<record>``."""
        crc = zlib.crc32(data)
        name, offset = self._begin(record, len(data), crc)
        self.f.write(data)
        self.pos += len(data)
        self.entries.append((name, crc, len(data), offset, 0, len(data)))

    def copy_record(self, record: str, src: BinaryIO, offset: int, size: int, crc: int | None = None) -> None:
        """Copy ``size`` bytes at ``offset`` of ``src`` as the record ``<archive>/<record>``.

        With a known ``crc`` (the source zip's CRC-32 of the same bytes) the bytes are copied by the kernel;
        without it they are read in 8 MiB chunks to compute the CRC, and the local header is patched afterwards.

        Raises:
            CkptError: the source ended before ``size`` bytes were copied.
        """
        if size <= SMALL_RECORD:  # small records: one buffered read and write, no per-record syscalls
            src.seek(offset)
            data = src.read(size)
            if len(data) != size:
                raise CkptError(f"the input ended {size - len(data)} bytes before the end of a record; it is truncated")
            if crc is None:
                crc = zlib.crc32(data)
            name, hoff = self._begin(record, size, crc)
            self.f.write(data)
            self.pos += size
            self.entries.append((name, crc, size, hoff, 0, size))
            if self._behind is not None:
                self._behind.written(self.pos)  # bytes still in the file object's buffer are left to the fsync
            if self.progress is not None:
                self.progress(size)
            return
        block = self._clone_block(src, offset) if crc is not None else 0
        name, hoff = self._begin(record, size, crc or 0, congruent=(offset, block) if block else (0, ALIGNMENT))
        self.f.flush()
        if crc is None:
            crc = copy_range_crc(src, self.f, offset, size, progress=self.progress, behind=self._behind)
            self._patch_crc(hoff, crc)
        else:
            self.f.seek(self.pos)
            copy_range(src, self.f, offset, size, progress=self.progress, behind=self._behind, block=block)
        self.pos += size
        self.entries.append((name, crc, size, hoff, 0, size))

    def copy_compressed(self, record: str, src: BinaryIO, offset: int, csize: int, size: int, crc: int,
                        method: int = 8) -> None:
        """Copy a compressed record as it is: ``csize`` bytes at ``offset`` of ``src``, which inflate (``method``,
        8 = deflate) to ``size`` bytes of CRC-32 ``crc``, become the record ``<archive>/<record>`` with the same
        method, sizes and CRC. Nothing is inflated, so a rewrite costs the compressed size whatever the record
        inflates to (``torch.load`` reads deflated records; ``mmap=True`` cannot map them, as for the source).

        Raises:
            CkptError: the source ended before ``csize`` bytes were copied.
        """
        block = self._clone_block(src, offset) if csize > SMALL_RECORD else 0
        name, hoff = self._begin(record, size, crc, csize, method, (offset, block) if block else (0, ALIGNMENT))
        self.f.flush()
        self.f.seek(self.pos)
        copy_range(src, self.f, offset, csize, progress=self.progress, behind=self._behind, block=block)
        self.pos += csize
        self.entries.append((name, crc, size, hoff, method, csize))

    def _patch_crc(self, header_offset: int, crc: int) -> None:
        here = self.f.tell()
        self.f.seek(header_offset + 14)
        self.f.write(struct.pack("<I", crc))
        self.f.seek(here)

    # -- torch.save's record sequence ----------------------------------------------------------------------
    def begin_torch_save(self, data_pkl: bytes) -> None:
        """Write the records ``torch.save`` puts before the storages: ``data.pkl`` (the pickle), then
        ``.format_version`` (``1``), ``.storage_alignment`` (``64``) and ``byteorder`` (``little``), in that order
        (torch/serialization.py ``_save``). Follow with one ``data/<key>`` record per storage, then
        :meth:`end_torch_save`."""
        self.write_bytes("data.pkl", data_pkl)
        self.write_bytes(".format_version", b"1")
        self.write_bytes(".storage_alignment", str(ALIGNMENT).encode())
        self.write_bytes("byteorder", b"little")

    def end_torch_save(self) -> None:
        """Write the records ``torch.save`` puts after the storages (``version`` ``3`` and a random 40-digit
        ``.data/serialization_id``), then the central directory."""
        self.write_bytes("version", b"3\n")
        self.write_bytes(".data/serialization_id", str(secrets.randbits(128)).zfill(40).encode())
        self.close()

    # -- central directory -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Write the central directory (with ZIP64 end records when needed)."""
        f = self.f
        cd_start = self.pos
        out = bytearray()
        for name, crc, size, off, method, csize in self.entries:
            zip64_fields = []
            s32, c32 = size, csize
            o32 = off
            if size >= _U32 or csize >= _U32:
                zip64_fields += [size, csize]
                s32 = c32 = _U32
            if off >= _U32:
                zip64_fields.append(off)
                o32 = _U32
            extra = struct.pack("<HH", 0x0001, 8 * len(zip64_fields)) + struct.pack(
                f"<{len(zip64_fields)}Q", *zip64_fields) if zip64_fields else b""
            out += struct.pack(
                "<IHHHHHHIIIHHHHHII", 0x02014B50, 45 if zip64_fields else 20, 45 if zip64_fields else 20, 0, method,
                _DOS_DATE[0], _DOS_DATE[1], crc, c32, s32, len(name), len(extra), 0, 0, 0, 0, o32,
            ) + name + extra
        f.write(out)
        cd_size = len(out)
        end = cd_start + cd_size
        n = len(self.entries)
        if n >= 0xFFFF or cd_start >= _U32 or cd_size >= _U32:
            f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, cd_size, cd_start))
            f.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
            f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                                min(cd_size, _U32), min(cd_start, _U32), 0))
        else:
            f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, cd_start, 0))
        self.pos = f.tell()
