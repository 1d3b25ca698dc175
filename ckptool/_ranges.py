"""The byte ranges of one remote object fetched so far (:class:`RangeStore`), and the fsspec cache that reads
through them (:class:`StoreCache`): what :func:`ckptool._remote.object_reads` shares among the opens of one
object, so that the same bytes are not fetched twice. Pure Python, no fsspec import; thread-safe.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

__all__ = ["STORE_LIMIT", "RangeStore", "StoreCache"]

#: the most bytes of one object :class:`RangeStore` keeps (a scan reads a zip's first block, its end record and
#: directory, its pickles: tens of KiB, a few MiB for a pickle of 50,000 tensors); a range that would pass it
#: empties the store first, and a range larger than it is not kept
STORE_LIMIT = 4 << 20


class RangeStore:
    """The byte ranges of one version of one remote object fetched so far, shared by every reader of it inside
    :func:`ckptool._remote.object_reads`: sorted, disjoint, touching ones joined, :data:`STORE_LIMIT` bytes at
    most. A read asks the network only for the bytes no range holds (one request per read), so the same bytes
    never come twice while they are kept. fsspec's own caches do not fit here: ``readahead`` and ``bytes`` keep one
    range (a zip's first block and its end record evict each other), ``blockcache`` makes one request per block
    (the 64 KiB end-record search is two or three), ``parts`` never fetches. Thread-safe."""

    def __init__(self, limit: int = STORE_LIMIT) -> None:
        self.limit = limit
        self._starts: list[int] = []
        self._data: list[bytes] = []
        self._held = 0
        self._lock = threading.Lock()
        #: reads answered from memory, and reads that made a request
        self.hits = self.misses = 0

    def _at(self, pos: int) -> int | None:
        """The index of the range holding byte ``pos``, or None."""
        i = bisect.bisect_right(self._starts, pos) - 1
        return i if i >= 0 and pos < self._starts[i] + len(self._data[i]) else None

    def read(self, start: int, end: int, fetch: Callable[[int, int], bytes], ahead: int = 0) -> bytes:
        """Bytes ``start`` to ``end`` (``end`` within the object) of the object: from the ranges held where they
        cover them, else one ``fetch(lo, hi)`` of the bytes between the range holding ``start`` and the one holding
        ``end - 1`` (where such ranges are held); when no held range follows, ``ahead`` more bytes are fetched
        (read-ahead, up to the next held range; ``fetch`` clips at the object's end) and kept."""
        with self._lock:
            i = self._at(start)
            head = b"" if i is None else self._data[i][start - self._starts[i]:end - self._starts[i]]
            if len(head) == end - start:
                self.hits += 1
                return head
            self.misses += 1
            j = self._at(end - 1)
            tail = b"" if j is None else self._data[j][:end - self._starts[j]]
            lo, hi = start + len(head), end - len(tail)
            if not tail:  # read ahead, up to the next range held
                k = bisect.bisect_left(self._starts, hi)
                hi = min(hi + ahead, self._starts[k]) if k < len(self._starts) else hi + ahead
        got = fetch(lo, hi)
        self._add(lo, got)
        return head + got[:end - len(tail) - lo] + tail

    def _add(self, lo: int, data: bytes) -> None:
        """Keep ``data``, the bytes from ``lo``, joined with the ranges it touches."""
        hi = lo + len(data)
        if not data or len(data) > self.limit:
            return
        with self._lock:
            a = bisect.bisect_left(self._starts, lo)
            if a > 0 and self._starts[a - 1] + len(self._data[a - 1]) >= lo:
                a -= 1
            b = bisect.bisect_right(self._starts, hi, lo=a)
            pre = post = b""
            if a < b:
                first, last = self._starts[a], self._starts[b - 1]
                pre = self._data[a][:max(0, lo - first)]
                post = self._data[b - 1][hi - last:] if last + len(self._data[b - 1]) > hi else b""
            joined = pre + data + post
            dropped = sum(len(d) for d in self._data[a:b])
            if self._held - dropped + len(joined) > self.limit:  # full: start again from this range
                self._starts, self._data, self._held = [], [], 0
                a = b = dropped = 0
                joined, pre = data, b""
            self._starts[a:b] = [lo - len(pre)]
            self._data[a:b] = [joined]
            self._held += len(joined) - dropped

    @property
    def held(self) -> int:
        """Bytes kept now."""
        return self._held

    def ranges(self) -> list[tuple[int, bytes]]:
        """The ranges kept now: ``(offset, bytes)``, in order."""
        with self._lock:
            return list(zip(self._starts, self._data, strict=True))


class StoreCache:
    """A read cache of fsspec's kind (what ``AbstractBufferedFile.read`` calls: ``_fetch(start, end)``) over a
    :class:`RangeStore`: each open of an object gets its own, all of them the same store. A miss reads
    ``blocksize`` bytes ahead (as fsspec's ``readahead`` cache does) through ``fetcher``."""

    name = "ckptool-ranges"

    def __init__(self, blocksize: int, fetcher: Callable[[int, int], bytes], size: int, store: RangeStore) -> None:
        self.blocksize = blocksize
        self.fetcher = fetcher
        self.size = size
        self.store = store

    def _fetch(self, start: int | None, end: int | None) -> bytes:
        start = start or 0
        end = self.size if end is None or end > self.size else end
        if start >= end:
            return b""
        return self.store.read(start, end, self.fetcher, ahead=self.blocksize)

    def _log_stats(self) -> str:
        return f", {self.store.hits} hits, {self.store.misses} misses, {self.store.held} bytes held"
