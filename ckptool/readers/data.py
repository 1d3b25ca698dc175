"""Reading the bytes of a :class:`~ckptool.formats.tensors.Storage`: the one place that turns the readers' byte
ranges into data.

A storage's bytes are, by the form its reader gave it (:mod:`ckptool.formats.tensors`):

* one byte range of one file (``nbytes`` at ``offset`` of ``path``): a zip record, a raw ``.storage`` record of a
  torch.package archive, a range of a safetensors data block;
* ``segments``: ranges of several files concatenated, each possibly widened to float32 or byte-swapped as it is
  read (a DeepSpeed ZeRO parameter, a big-endian torch file: :mod:`ckptool.formats.segments`);
* ``pieces``: a safetensors sharing group, each stored tensor the contiguous copy of one view of the storage,
  written back into its place (``pieces`` may overlap: views of one storage hold the same bytes where they meet).

:func:`read_storage` reads a whole storage into a caller's buffer (``torch.empty(nbytes, dtype=torch.uint8)`` in
:func:`ckptool.torch_ops.source_load.load_source`: one copy, file to tensor, for a plain range and for segments
that need no widening or swapping); :func:`read_range` reads part of a storage through a caller's range reader
(``convert``'s :class:`~ckptool.ops.convert.write.Files`, which records what it read as evidence). Files are opened
by :class:`FileRanges` (local paths and URLs, :func:`ckptool._source.open_binary`), each once. Nothing here imports
torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import TracebackType
from typing import BinaryIO, Literal

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError
from ckptool.formats.dtypes import DTYPE_SIZES, numel
from ckptool.formats.segments import ConcatenatedFile, ReadRange, file_runs, read_segments
from ckptool.formats.tensors import Segment, Storage

__all__ = ["FileRanges", "read_range", "read_storage", "scatter"]

#: element size in bytes -> the ``memoryview.cast`` format of an unsigned integer that wide
_WORDS: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}


class FileRanges:
    """Files opened by path (a local path or a URL: :func:`ckptool._source.open_binary`), each once, read by byte
    range; closed by :meth:`close` or on leaving a ``with`` block."""

    def __init__(self) -> None:
        self._open: dict[str, BinaryIO] = {}

    def __enter__(self) -> FileRanges:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def get(self, path: str) -> BinaryIO:
        """The open file ``path`` (opened on first use)."""
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = source.open_binary(path)  # closed in close()
        return f

    def readinto(self, path: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` (a byte-format memoryview) with the bytes at ``offset`` of ``path``, read straight into it.

        Raises:
            CorruptCheckpointError: the file ends first.
        """
        f = self.get(path)
        f.seek(offset)
        got, n = 0, len(buf)
        while got < n:  # a raw or remote file may return less than asked before its end
            k = f.readinto(buf[got:])  # type: ignore[attr-defined]  # BinaryIO omits readinto
            if not k:
                raise CorruptCheckpointError(f"{path} is truncated: {n} bytes expected at offset {offset}, {got} "
                                             "found; re-download it")
            got += k

    def read(self, path: str, offset: int, n: int) -> bytearray:
        """``n`` bytes at ``offset`` of ``path`` (a :data:`~ckptool.formats.segments.ReadRange`).

        Raises:
            CorruptCheckpointError: the file ends first.
        """
        buf = bytearray(n)
        if n:
            self.readinto(path, offset, memoryview(buf))
        return buf

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def read_range(st: Storage, offset: int, n: int, read: ReadRange) -> bytes | bytearray:
    """``n`` bytes at byte ``offset`` of storage ``st`` (a plain range or ``segments``: gathered from several
    files, widened or byte-swapped), read through ``read(path, offset, nbytes)`` (e.g. :meth:`FileRanges.read`).

    Raises:
        ValueError: ``st`` is a safetensors sharing group (``pieces``): read it whole, :func:`read_storage`.
        CorruptCheckpointError: a file ends first.
    """
    if st.pieces is not None:
        raise ValueError("a storage assembled from pieces is read whole (read_storage)")
    if st.segments is None:
        return read(st.path, st.offset + offset, n)
    r = ConcatenatedFile(st.segments, read)
    r.seek(offset)
    data = r.read(n)
    if len(data) != n:
        raise CorruptCheckpointError(f"{st.path} is truncated: {n} bytes expected at offset {offset} of a "
                                     "gathered storage; re-download it")
    return data


def read_storage(st: Storage, into: bytearray | memoryview | None = None, files: FileRanges | None = None
                 ) -> bytearray | memoryview:
    """The ``st.nbytes`` bytes of storage ``st`` (see the module docstring for its three forms), written into
    ``into`` (any writable buffer of exactly ``st.nbytes`` bytes, returned) or a new ``bytearray``; files opened
    by ``files`` (else opened and closed here). A plain range and a segment that needs no widening or swapping
    are read straight into the buffer (``readinto``, no intermediate copy); a widened or swapped segment passes
    through one buffer of its own size; a piece of a sharing group through one of the piece's size. Bytes of a
    sharing group that no piece covers are zero (their values are not stored anywhere).

    Raises:
        ValueError: ``into`` is not ``st.nbytes`` bytes.
        CorruptCheckpointError: a file ends first; a piece that is not its view's size or reaches past the storage.
    """
    buf = bytearray(st.nbytes) if into is None else into
    mv = memoryview(buf).cast("B")
    if len(mv) != st.nbytes:
        raise ValueError(f"a buffer of {len(mv)} bytes for a storage of {st.nbytes}")
    own = files is None
    fr = FileRanges() if files is None else files
    try:
        if st.pieces is not None:
            _scatter_pieces(st, mv, fr)
        elif st.segments is None:
            fr.readinto(st.path, st.offset, mv)
        else:
            _read_segments_into(st.segments, mv, fr)
    finally:
        if own:
            fr.close()
    return buf


def _read_segments_into(segments: Sequence[Segment], mv: memoryview, files: FileRanges) -> None:
    """Fill ``mv`` with the concatenation of ``segments``: a widened or swapped segment through a buffer of its own,
    the plain ones that lie end to end in one file with one read each (up to
    :data:`~ckptool.formats.segments.MAX_RUN` bytes, scattered from that buffer; a DCP chunk split on a later
    dimension is one segment per row: :func:`~ckptool.formats.segments.file_runs`), a run of one segment straight
    into ``mv``."""
    pos = 0
    plain: list[tuple[str, int, int, int]] = []
    for seg in segments:
        if seg.widen is None and seg.swap <= 1:
            plain.append((seg.path, seg.offset, seg.nbytes, pos))
        else:
            mv[pos:pos + seg.nbytes] = read_segments([seg], files.read)
        pos += seg.nbytes
    for path, offset, nbytes, parts in file_runs(plain):
        if len(parts) == 1:
            files.readinto(path, offset, mv[parts[0][2]:parts[0][2] + nbytes])
            continue
        data = memoryview(files.read(path, offset, nbytes))
        for at, k, to in parts:
            mv[to:to + k] = data[at:at + k]


def _scatter_pieces(st: Storage, mv: memoryview, files: FileRanges) -> None:
    """Write each of ``st.pieces`` (the contiguous copy of a view of the storage) into its view of ``mv``."""
    esize = DTYPE_SIZES[st.dtype]
    for p in st.pieces or ():
        n = numel(p.shape)
        if p.nbytes != n * esize:
            raise CorruptCheckpointError(f"{st.path}: a stored view of {n} {st.dtype} elements holds {p.nbytes} bytes")
        if n == 0:
            continue
        hi = p.offset + sum((s - 1) * d for s, d in zip(p.shape, p.stride)) + 1
        if p.offset < 0 or hi * esize > len(mv) or any(d < 0 for d in p.stride):
            raise CorruptCheckpointError(f"{st.path}: a stored view reaches past its storage of {len(mv)} bytes")
        scatter(files.read(st.path, p.file_offset, p.nbytes), mv, esize, p.offset, p.shape, p.stride)


def scatter(data: bytes | bytearray | memoryview, dst: memoryview, esize: int, offset: int, shape: Sequence[int],
            stride: Sequence[int]) -> None:
    """Write ``data`` (a view's elements in row-major order, ``esize`` bytes each) into the view ``offset`` /
    ``shape`` / ``stride`` (elements, non-negative strides, inside ``dst``) of ``dst`` (a byte-format memoryview):
    the inverse of :func:`ckptool.formats.strided.gather`. Rows are assigned with ``memoryview`` steps (no
    per-element Python work for element sizes 1, 2, 4 and 8)."""
    src = memoryview(data).cast("B")
    if not shape:
        dst[offset * esize:(offset + 1) * esize] = src[:esize]
        return
    fmt = _WORDS.get(esize)
    words, from_words = (dst.cast(fmt), src.cast(fmt)) if fmt else (None, None)
    inner, step = shape[-1], stride[-1]
    rows = itertools.product(*(range(s) for s in shape[:-1]))  # every row, in row-major order
    for row, idx in enumerate(rows):
        first = offset + sum(i * d for i, d in zip(idx, stride[:-1]))
        if words is not None and from_words is not None and step > 0:
            words[first:first + (inner - 1) * step + 1:step] = from_words[row * inner:(row + 1) * inner]
            continue
        for j in range(inner):
            p, q = (first + j * step) * esize, (row * inner + j) * esize
            dst[p:p + esize] = src[q:q + esize]
