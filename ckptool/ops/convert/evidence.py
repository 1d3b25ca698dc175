"""Evidence about ``convert``'s source that did not pass through the reader that fed the output.

The output is re-opened by an independent reader (:mod:`ckptool.ops.convert.verify`) and compared with what the
writer meant to write; that alone cannot catch a reader that returned wrong bytes (a wrong offset, a flipped byte
in transit, a server that ignored ``Range``): the output would faithfully hold them. So every range of source bytes
the writer used is recorded here with the CRC-32 of the bytes as they streamed (:meth:`SourceEvidence.saw`), and
:meth:`SourceEvidence.check` holds each one to evidence from outside that path:

* a range inside a zip record whose CRC-32 the zip directory records (torch zip, ``.pt2``): the whole record is
  read again and must match the directory's CRC-32, and the range's bytes in that second read must match the
  first; a whole record used as it is needs no second read (its CRC-32 is compared directly). A record copied as
  it is into the output carries the directory's CRC-32 there (:meth:`SourceEvidence.vouched`), which the output's
  reader (``zipfile``, ``safe_open``) then checks against the bytes written;
* a range of a local file without checksums (safetensors, torch legacy, DCP, DeepSpeed): read again with the
  operating system's ``open`` (not ckptool's reader) and compared;
* a URL: every range read was exact (:func:`ckptool._source.open_binary`), and the object's size and ETag /
  modification time are asked for again and must equal those of the first request (:func:`ckptool._source.
  recheck`); a URL's ranges are not downloaded twice.
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterable
from typing import Any, BinaryIO

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError

_CHUNK = 8 << 20


class SourceEvidence:
    """The source ranges one output was made from, and the checks of :func:`check` (see the module docstring)."""

    def __init__(self) -> None:
        self._records: dict[str, list[tuple[int, int, int]]] = {}  # path -> sorted (offset, nbytes, crc)
        self._pieces: dict[str, list[tuple[int, int, int]]] = {}  # path -> (offset, nbytes, crc) read
        self.by_directory = 0  # source zip records held to their directory's CRC-32
        self.reread = 0  # ranges compared with a second, independent read of a local file
        self.urls: dict[str, tuple[int | None, str | None]] = {}  # URL -> (size, ETag) found unchanged

    def expect_records(self, storages: Iterable[Any]) -> None:
        """Learn the zip records of ``storages`` (``path``, ``offset``, ``nbytes``, ``crc``; those with a ``crc``
        and one range of one file)."""
        for st in storages:
            if st.crc is not None and st.pieces is None and st.segments is None:
                rows = self._records.setdefault(st.path, [])
                row = (st.offset, st.nbytes, st.crc)
                i = bisect.bisect_left(rows, row)
                if i == len(rows) or rows[i] != row:
                    rows.insert(i, row)

    def saw(self, path: str, offset: int, nbytes: int, crc: int) -> None:
        """Record that ``nbytes`` at ``offset`` of ``path`` went into the output with CRC-32 ``crc`` as read."""
        if nbytes:
            self._pieces.setdefault(path, []).append((offset, nbytes, crc))

    def vouched(self, path: str) -> None:
        """Record that a whole record of ``path`` went into the output carrying its zip directory's CRC-32, which
        the output's reader checks against the bytes written."""
        self.by_directory += 1
        if source.is_url(path):
            self.urls.setdefault(path, (None, None))

    def _record_of(self, path: str, offset: int, nbytes: int) -> tuple[int, int, int] | None:
        rows = self._records.get(path, [])
        i = bisect.bisect_right(rows, (offset, float("inf"), 0)) - 1
        if i >= 0:
            lo, n, _ = rows[i]
            if lo <= offset and offset + nbytes <= lo + n:
                return rows[i]
        return None

    def check(self) -> str | None:
        """Check every range recorded since the last call (see the module docstring); None when all hold, else the
        first difference. The ranges are then forgotten.

        Raises:
            RemoteError: a URL changed or could not be asked again.
            OSError: a local source could not be read again.
        """
        pieces, self._pieces = self._pieces, {}
        for path, ranges in pieces.items():
            by_record: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
            loose = []
            for p in ranges:
                rec = self._record_of(path, p[0], p[1])
                if rec is not None and (p[0], p[1]) == rec[:2]:
                    self.by_directory += 1
                    if p[2] != rec[2]:
                        return (f"the {p[1]} bytes read at offset {p[0]} of {path} do not match the CRC-32 of the "
                                "zip directory's record there")
                elif rec is not None:
                    by_record.setdefault(rec, []).append(p)
                else:
                    loose.append(p)
            if source.is_url(path):
                self.urls.setdefault(path, (None, None))
            diff = self._check_records(path, by_record)
            if diff is None and loose and not source.is_url(path):
                diff = self._reread(path, [(lo, n, crc) for lo, n, crc in loose])
            if diff is not None:
                return diff
        for url in self.urls:
            self.urls[url] = source.recheck(url)
        return None

    def _open(self, path: str) -> BinaryIO:
        return source.open_binary(path) if source.is_url(path) else open(path, "rb")

    def _check_records(self, path: str, by_record: dict[tuple[int, int, int], list[tuple[int, int, int]]]
                       ) -> str | None:
        """Read each record of ``by_record`` again: it must match its directory CRC-32, and the ranges read in it
        the same bytes as before."""
        if not by_record:
            return None
        with self._open(path) as f:
            for (lo, n, crc), ranges in sorted(by_record.items()):
                got, crcs = _stream(f, lo, n, [(a - lo, m) for a, m, _ in ranges])
                self.by_directory += 1
                if got != crc:
                    return (f"the record of {n} bytes at offset {lo} of {path} does not match its zip directory's "
                            "CRC-32 when read again")
                for (a, m, first), again in zip(ranges, crcs):
                    if first != again:
                        return (f"the {m} bytes read at offset {a} of {path} differ from the same bytes read again "
                                "(checked against the zip directory's CRC-32)")
        return None

    def _reread(self, path: str, ranges: list[tuple[int, int, int]]) -> str | None:
        """Read each range of the local file ``path`` again with ``open`` and compare its CRC-32 with the first."""
        with open(path, "rb") as f:
            for lo, n, crc in sorted(ranges):
                _, (again,) = _stream(f, lo, n, [(0, n)])
                self.reread += 1
                if again != crc:
                    return (f"the {n} bytes read at offset {lo} of {path} differ from the same bytes read again "
                            "with the operating system's open()")
        return None

    def merge(self, other: SourceEvidence) -> None:
        """Add what ``other`` (the evidence of one task of a parallel write, checked) compared to this one's."""
        self.by_directory += other.by_directory
        self.reread += other.reread
        for url, stamp in other.urls.items():
            if stamp != (None, None) or url not in self.urls:
                self.urls[url] = stamp

    def summary(self) -> str:
        """What :meth:`check` compared, for the ``Verified:`` line (empty when nothing was recorded)."""
        parts = []
        if self.by_directory:
            parts.append(f"the CRC-32 checksums of the source's zip directory ({self.by_directory} record(s))")
        if self.reread:
            parts.append(f"a second read of the source file with the operating system's open() "
                         f"({self.reread} range(s))")
        for url, (size, tag) in self.urls.items():
            what = f"size {size} bytes" + (f", ETag / modification time {tag}" if tag else "")
            parts.append(f"the object {url} unchanged while it was read ({what}; every range read exact)")
        return "; ".join(parts)


def _stream(f: BinaryIO, offset: int, nbytes: int, ranges: list[tuple[int, int]]) -> tuple[int, list[int]]:
    """Read ``nbytes`` at ``offset`` of ``f`` in :data:`_CHUNK`-byte pieces: the CRC-32 of all of them, and of each
    range ``(start, length)`` (relative to ``offset``) of ``ranges``.

    Raises:
        CorruptCheckpointError: the file ends first.
    """
    f.seek(offset)
    total = 0
    crcs = [0] * len(ranges)
    pos = 0
    while pos < nbytes:
        chunk = memoryview(f.read(min(_CHUNK, nbytes - pos)))
        if not chunk:
            raise CorruptCheckpointError(f"{getattr(f, 'name', 'the source')} ended {nbytes - pos} bytes early when "
                                         "read again")
        total = zlib.crc32(chunk, total)
        end = pos + len(chunk)
        for i, (a, m) in enumerate(ranges):
            lo, hi = max(a, pos), min(a + m, end)
            if lo < hi:
                crcs[i] = zlib.crc32(chunk[lo - pos:hi - pos], crcs[i])
        pos = end
    return total, crcs
