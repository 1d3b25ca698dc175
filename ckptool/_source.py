"""Open a checkpoint source by local path or URL: the one home of "where the input bytes come from".

A path argument is a URL when it starts with a scheme and ``://`` (``s3://``, ``gs://``, ``http(s)://``,
``memory://``, ``hf://``...): such a source is read through `fsspec <https://filesystem-spec.readthedocs.io>`_,
imported only then (``pip install 'ckptool[remote]'`` adds fsspec and s3fs), so a local path never imports it.
ckptool handles no credentials: fsspec's own configuration applies (``AWS_*`` variables and ``~/.aws`` for s3fs,
``gcloud`` for gcsfs, ``HF_TOKEN`` for ``hf://``, ``fsspec.config``).

:func:`open_binary` gives a seekable binary reader. Over a URL it is fsspec's own file object, whose read-ahead
cache (:data:`BLOCK`) makes each miss one range request (an HTTP ``Range`` header, an S3 ranged ``GET``), so a
reader that seeks to the zip end record, the central directory, ``data.pkl`` and the safetensors header transfers
those bytes and not the tensors; :func:`bytes_transferred` counts what came over the network. Every range read is
exact or refused, and within :func:`consistent_reads` (each CLI command, ``convert``) every request must find the
object's first size and ETag / modification time: a network failure, an inexact answer or a changed object is one
:class:`~ckptool.errors.RemoteError` naming the URL. A server that ignores ``Range`` has the object downloaded once.

The remote machinery (fsspec, version pins, exact range fetches, the local copy for a server that ignores ``Range``)
lives in :mod:`ckptool._remote`; its public names are re-exported here. Listing the objects under a prefix is
:mod:`ckptool._listing`.

Outputs to a URL are written by :func:`ckptool._fileio.atomic_output` into a local temporary file and sent by
:func:`upload` only once complete; a failed upload is discarded (an S3 multipart upload is aborted), so no partial
destination object is left.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar

from ckptool._ranges import StoreCache
from ckptool._remote import (
    BLOCK,
    CHUNK,
    REMOTE_EXTRA,
    CountedReader,
    NoRangeSupport,
    RangeError,
    changed_error,
    checked_fetcher,
    consistent_reads,
    filesystem,
    http_file,
    object_reads,
    pins,
    range_store,
    remote_info,
    set_timeout,
    short_error,
    thread_transferred,
    transferred_bytes,
    version_stamp,
)
from ckptool.errors import InputNotFoundError, NotACheckpointError, RemoteError

__all__ = [
    "BLOCK", "CHUNK", "REMOTE_EXTRA", "NoRangeSupport", "RangeError", "RangeView", "bytes_transferred", "changed_error",
    "consistent_reads", "file_size", "holding_versions", "is_remote_file", "is_url", "kind", "leaves_folder",
    "local_copy", "local_reads", "object_reads", "open_binary", "open_regular", "recheck", "refuse_special",
    "remote_exists", "remote_info", "set_timeout", "special_kind", "spool", "thread_bytes_transferred", "upload",
    "version_key", "version_stamp", "whole_view",
]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")
F = TypeVar("F", bound=Callable[..., Any])


def is_url(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and _URL.match(path) is not None


def bytes_transferred() -> int:
    """Bytes read from remote sources (URLs) by this process so far; the difference of two calls is what an
    operation transferred (range requests included, whole reads included)."""
    return transferred_bytes[0]


def thread_bytes_transferred() -> int:
    """:func:`bytes_transferred` of the calling thread alone (what a scan transferred while others ran in threads)."""
    return thread_transferred()


def kind(path: str) -> str | None:
    """``"file"``, ``"directory"`` or None (nothing there) for a local path or URL.

    Raises:
        RemoteError: a URL could not be queried.
    """
    if not is_url(path):
        if os.path.isdir(path):
            return "directory"
        return "file" if os.path.exists(path) else None
    info = remote_info(path)
    if info is None:
        return None
    return "directory" if info.get("type") == "directory" else "file"


def file_size(path: str) -> int:
    """Size in bytes of the file at ``path`` (local path or URL).

    Raises:
        InputNotFoundError: nothing at ``path``.
        RemoteError: a URL could not be queried.
    """
    if not is_url(path):
        return os.path.getsize(path)
    info = remote_info(path)
    if info is None:
        raise InputNotFoundError(f"{path}: no such file; check the URL")
    return int(info.get("size") or 0)


def version_key(path: str) -> tuple[object, ...]:
    """A key that changes when the file at ``path`` changes (for caches of parsed structure): inode, size and
    modification time of a local file; size and ETag / modification time of a URL."""
    if not is_url(path):
        st = os.stat(path)
        return (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)  # per_version builds it too
    return (path, *version_stamp(remote_info(path) or {}))


T = TypeVar("T")


def per_version(cache: dict[tuple[object, ...], T], path: str, make: Callable[[], T], *, keep: int = 16,
                remote: bool = False) -> T:
    """``make()``, the structure parsed from the file at ``path``, computed once per version of it
    (:func:`version_key`) and kept in ``cache`` (at most ``keep`` versions; the cache is emptied when full). A URL
    is cached only with ``remote`` (its version costs a request); a path that is no regular file is not cached
    (``make`` raises its own error for it)."""
    if is_url(path):
        if not remote:
            return make()
        key = version_key(path)
    else:  # one stat: a regular file, and its version (many small files)
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return make()
        if not stat.S_ISREG(st.st_mode):
            return make()
        key = (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)  # as version_key
    value = cache.get(key)
    if value is None:
        value = make()
        if len(cache) >= keep:
            cache.clear()
        cache[key] = value
    return value


def holding_versions(fn: F) -> F:
    """``fn`` run inside :func:`consistent_reads` (for library entry points that read URLs more than once)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with consistent_reads():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def recheck(url: str) -> tuple[int | None, str | None]:
    """Ask for ``url``'s size and ETag / modification time once more and return them: the evidence that the
    object read is the object there now.

    Raises:
        RemoteError: it changed since it was first seen inside :func:`consistent_reads`, or it is gone.
    """
    info = remote_info(url, fresh=True)
    if info is None:
        raise RemoteError(f"{url} disappeared while it was read; nothing was written", url)
    return version_stamp(info)


# ------------------------------------------------------------------------------------------------ regular files
#: what each kind of file that is neither a regular file nor a folder is, as ``stat`` tells them apart
_SPECIAL: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def special_kind(mode: int) -> str | None:
    """What a file of ``st_mode`` ``mode`` is when it is a FIFO, a character or block device or a socket
    (``"a FIFO (named pipe)"``...), else None (a regular file, a folder, a link)."""
    return next((what for test, what in _SPECIAL if test(mode)), None)


def _special_error(path: str, kind: str, what: str) -> NotACheckpointError:
    return NotACheckpointError(
        f"{path}{f' ({what})' if what else ''} is {kind}, not a regular file: ckptool reads only regular files "
        "(reading a pipe, device or socket can block forever or never end); copy its content into a file first")


def refuse_special(path: str, what: str = "", *, mode: int | None = None) -> None:
    """Refuse ``path`` (a local path; links followed) when it is a FIFO, a character or block device or a socket,
    from its ``stat`` alone: nothing is opened. ``what`` says what it is to the caller (``"a DCP record"``, ``"the
    rules file"``). A path that does not exist, a folder and a URL pass (their callers refuse those). ``mode``: the
    ``st_mode`` of an ``os.stat(path)`` the caller made already (no second ``stat``: many small files).

    Raises:
        NotACheckpointError: a FIFO, a device or a socket.
    """
    if is_url(path):
        return
    if mode is None:
        try:
            mode = os.stat(path).st_mode
        except (OSError, ValueError):
            return
    kind = special_kind(mode)
    if kind is not None:
        raise _special_error(path, kind, what)


def open_regular(path: str, what: str = "", *, mode: int | None = None) -> BinaryIO:
    """``open(path, "rb")`` of a local regular file, checked without blocking: :func:`refuse_special` first (from
    ``mode``, the ``st_mode`` of an ``os.stat(path)`` the caller made, when given), then the file opened with
    ``O_NONBLOCK`` (a FIFO swapped in meanwhile neither blocks the open nor passes) and its ``fstat`` checked again,
    the flag cleared for the reads that follow; buffered as ``open`` buffers it (``st_blksize`` bytes), without
    asking again whether it is a terminal. The one place every reader of a local input file opens it
    (:func:`open_binary` included).

    Raises:
        NotACheckpointError: a FIFO, a device or a socket.
        OSError: the file could not be opened (FileNotFoundError, PermissionError, IsADirectoryError...).
    """
    held = _held_files.get((threading.get_ident(), path)) if _held_files else None
    if held is not None and held[1] is not None:
        return _HeldFile(held[1], path)  # read whole already in this local_reads block
    fd, st = _open_checked(path, what, mode)
    try:
        if getattr(os, "O_NONBLOCK", 0) and hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        # the caller's to close; the buffer open() gives a regular file, from the fstat above (no second fstat, no
        # isatty ioctl: a regular file is no terminal)
        f = open(fd, "rb", buffering=st.st_blksize if st.st_blksize > 1 else io.DEFAULT_BUFFER_SIZE,  # noqa: SIM115
                 closefd=True)
    except BaseException:
        os.close(fd)
        raise
    f.raw.name = path  # type: ignore[attr-defined]  # as open(path) names it (error messages, zipfile)
    if held is not None and st.st_size <= READ_WHOLE_BYTES:  # the block's first open: read whole, then shared
        with f:
            held[1] = f.read()
        return _HeldFile(held[1], path)
    return f


def read_small(path: str, st: os.stat_result) -> bytes | None:
    """The bytes of the local regular file ``path`` of :data:`READ_WHOLE_BYTES` or fewer by ``st`` (its ``os.stat``)
    and its ``fstat``, opened by :func:`_open_checked` and read by position, without a file object (issue 52); the
    bytes a :func:`local_reads` block holds. None when it is bigger (the caller opens it). Raises as
    :func:`_open_checked`, and ``OSError`` when a read fails."""
    held = _held_files.get((threading.get_ident(), path)) if _held_files else None
    if held is not None:
        got: bytes | None = held[1]  # None: not read yet, the block's first open (open_regular) reads it
        return got
    if st.st_size > READ_WHOLE_BYTES:
        return None
    fd, now = _open_checked(path, "", st.st_mode)
    try:
        return _pread_all(fd, now.st_size) if now.st_size <= READ_WHOLE_BYTES else None
    finally:
        os.close(fd)


def _open_checked(path: str, what: str, mode: int | None) -> tuple[int, os.stat_result]:
    """The descriptor and ``fstat`` of the local file ``path``, the caller's to close: refused from its ``stat``
    (:func:`refuse_special`; ``mode`` when the caller made it), opened with ``O_NONBLOCK`` (a FIFO swapped in
    meanwhile neither blocks the open nor passes) and refused again from its ``fstat``.

    Raises:
        NotACheckpointError: a FIFO, a device or a socket.
        OSError: the file could not be opened.
    """
    refuse_special(path, what, mode=mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        kind = special_kind(st.st_mode)
        if kind is not None:
            raise _special_error(path, kind, what)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class _HeldFile(io.BytesIO):
    """The bytes of a local file a :func:`local_reads` block read whole, as a file named ``path`` (no ``fileno``:
    the readers that would map it read it instead)."""

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(data)
        self.name = path


#: (thread, path) -> [blocks open, the file's bytes once read] of the :func:`local_reads` blocks open
_held_files: dict[tuple[int, str], list[Any]] = {}


@contextlib.contextmanager
def local_reads(path: str) -> Iterator[None]:
    """Within this block, on this thread, the opens of the local file ``path`` (:func:`open_regular`, every reader's
    way in) share one: when the file is :data:`READ_WHOLE_BYTES` or smaller the first open reads it whole and every
    open gets those bytes as an in-memory file named ``path`` (its format's first bytes, its pickle read and its
    scan: ``inspect`` of many small files opens each once, issue 52); a bigger file is opened as usual each time.
    All of them read the same bytes, even if the file changes meanwhile. Blocks nest; the bytes go when the
    outermost ends."""
    key = (threading.get_ident(), path)
    held = _held_files.setdefault(key, [0, None])
    held[0] += 1
    try:
        yield
    finally:
        held[0] -= 1
        if not held[0]:
            del _held_files[key]


def open_binary(path: str, *, mode: int | None = None) -> BinaryIO:
    """A seekable binary reader of ``path``: the local file itself (``open(path, "rb")``), or for a URL fsspec's
    own file object (``fs.open``) whose cache reads :data:`BLOCK` bytes ahead, each miss one range request for the
    bytes not yet held (:class:`~ckptool._ranges.StoreCache`; inside :func:`object_reads` every open of the URL
    shares the ranges fetched and the object's ``info``, so a second open costs no request), with every range read
    checked to bring exactly the bytes asked for (over HTTP: status 206 and a ``Content-Range``
    naming them, :func:`http_file`), and the object's size and ETag / modification time held to those of the
    open (:func:`consistent_reads` holds them across opens). A server that ignores ``Range`` has the object
    downloaded once (:func:`_spooled`). Use it as a context manager. ``mode``: as :func:`open_regular`'s.

    Raises:
        InputNotFoundError: nothing at a URL.
        RemoteError: a URL could not be reached or changed; later, a read that failed or was not exact.
        NotACheckpointError: a local FIFO, device or socket (:func:`open_regular`).
        OSError: a local file could not be opened.
    """
    if not is_url(path):
        return open_regular(path, mode=mode)
    info = remote_info(path)
    if info is None:
        raise InputNotFoundError(f"{path}: no such file; check the URL")
    stamp = version_stamp(info)
    fs, p = filesystem(path)
    try:
        if type(fs).__name__ == "HTTPFileSystem" and info.get("size") is not None:
            f = http_file(fs, p, info)
        else:
            f = fs.open(p, "rb", block_size=BLOCK, cache_type="readahead")
    except Exception as e:
        raise RemoteError(f"cannot open {path} ({short_error(e)}); check the URL and the network", path) from e
    if getattr(f, "cache", None) is None or not hasattr(f.cache, "fetcher"):  # memory://, file://
        return io.BufferedReader(CountedReader(f, path), buffer_size=BLOCK)
    again = version_stamp(getattr(f, "_details", None) or {})
    if again[1] is not None and again != stamp:  # the file object asked for the object's info once more
        f.close()
        raise changed_error(path, stamp, again)
    # fsspec's per-file read-ahead cache becomes one over the object's shared ranges (object_reads)
    f.cache = StoreCache(BLOCK, checked_fetcher(f, fs, p, path, stamp), f.size, range_store(path, stamp))
    f.name = path
    return f  # type: ignore[no-any-return]


def is_remote_file(f: BinaryIO) -> bool:
    """True when ``f`` came from :func:`open_binary` for a URL."""
    return isinstance(getattr(f, "raw", None), CountedReader) or getattr(f, "cache", None) is not None


class RangeView:
    """Bytes-like random access to a remote file without reading it: ``len``, indexing, slicing and ``find``
    become reads of the file (range requests, see :func:`open_binary`). Enough for the zip and safetensors paths of
    ``ckptool scan``, which look at the start, the end record and what the directory points to; code that needs a
    real buffer (a regular expression over a pickle) gets a :func:`spool`-ed copy instead."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self._f = f
        self._size = size

    def __len__(self) -> int:
        return self._size

    def _read(self, start: int, stop: int) -> bytes:
        start, stop = max(0, start), min(stop, self._size)
        if stop <= start:
            return b""
        self._f.seek(start)
        return self._f.read(stop - start)

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self._size)
            data = self._read(start, stop)
            return data if step == 1 else data[::step]
        i = key + self._size if key < 0 else key
        if not 0 <= i < self._size:
            raise IndexError("index out of range")
        return self._read(i, i + 1)[0]

    def __bytes__(self) -> bytes:
        return self._read(0, self._size)

    def find(self, sub: bytes, start: int = 0, end: int | None = None) -> int:
        end = self._size if end is None else min(end, self._size)
        pos = start
        while pos < end:
            piece = self._read(pos, min(end, pos + CHUNK + len(sub)))
            at = piece.find(sub)
            if at >= 0:
                return pos + at
            if pos + len(piece) >= end:
                break
            pos += max(1, len(piece) - len(sub) + 1)
        return -1

    def close(self) -> None:
        """Nothing to release (the file belongs to the caller); for symmetry with ``mmap``."""


def _stdlib(name: str) -> Any:
    """The standard library's module ``name``, imported when first needed: ``tempfile`` and ``shutil`` serve only
    a remote file's local copies, and a local checkpoint's start-up does without them (they import ``bz2``,
    ``lzma``, ``random``...)."""
    return importlib.import_module(name)


def spool(f: BinaryIO) -> BinaryIO:
    """A local temporary copy (in the system temp folder, deleted when closed) of the whole remote file ``f``,
    copied in :data:`CHUNK`-byte pieces: for layouts without an index (torch legacy streams, plain pickles), which
    can only be read from the start."""
    tmp: BinaryIO = _stdlib("tempfile").TemporaryFile(prefix="ckptool-", suffix=".ckptool-tmp")
    try:
        f.seek(0)
        _stdlib("shutil").copyfileobj(f, tmp, CHUNK)
        tmp.flush()
        tmp.seek(0)
    except BaseException:
        tmp.close()
        raise
    return tmp


#: a local file of this many bytes or fewer is read whole by :func:`whole_view` rather than mapped: ``scan`` of a
#: folder of small pickles maps and unmaps none of them (about 10 us a file, issue 52)
READ_WHOLE_BYTES = 256 << 10


@contextlib.contextmanager
def whole_view(f: BinaryIO, *, lazy: Callable[[RangeView], bool] | None = None) -> Iterator[Any]:
    """The whole content of the open file ``f`` as a bytes-like buffer, released on exit: an ``mmap`` of a local
    file (bytes where it cannot be mapped: a pipe, an empty file; and a file of :data:`READ_WHOLE_BYTES` or less,
    whose one ``read`` costs half the mapping and unmapping of it); for a remote file a :class:`RangeView` when
    ``lazy(view)`` says the layout is read through its index (a zip that ends at the end of the file, safetensors),
    else an ``mmap`` of a :func:`spool`-ed local copy.

    Raises:
        RemoteError: reading a remote file failed.
    """
    if is_remote_file(f):
        view = RangeView(f, f.seek(0, io.SEEK_END))
        if lazy is not None and lazy(view):
            yield view
            return
        with spool(f) as local, whole_view(local) as buf:
            yield buf
        return
    whole: mmap.mmap | bytes | None = None
    try:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        if size > READ_WHOLE_BYTES:
            whole = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        elif f.seekable():  # small: positioned reads of the file from byte 0 (no seek, no second fstat)
            whole = _pread_all(fd, size)
    except (OSError, ValueError, io.UnsupportedOperation):  # not mappable (a pipe, an odd filesystem, an empty file)
        pass
    if whole is None:  # not mappable, nor read by position: read it
        f.seek(0)
        whole = f.read()
    try:
        yield whole
    finally:
        if isinstance(whole, mmap.mmap):
            whole.close()


def _pread_all(fd: int, size: int | None = None) -> bytes:
    """The bytes of the open regular file ``fd`` from byte 0 to its end, by ``os.pread`` (its offset is left alone)
    until a read returns nothing, or, given its ``fstat`` ``size``, until a read returns fewer bytes than asked for
    with ``size`` bytes read (a short read of a regular file is its end: one read of a small file, not two)."""
    chunks = []
    pos = 0
    ask = READ_WHOLE_BYTES + 1 if size is None else size + 1  # no buffer of 256 KiB for a small file (an mmap each)
    while chunk := os.pread(fd, ask, pos):
        chunks.append(chunk)
        pos += len(chunk)
        if pos == size and len(chunk) < ask:
            break
        ask = READ_WHOLE_BYTES + 1
    return b"".join(chunks) if len(chunks) != 1 else chunks[0]


@contextlib.contextmanager
def local_copy(url: str) -> Iterator[str]:
    """A local copy of the file at ``url``, for readers that need a path (``torch.load``, ``safetensors``'
    ``load_file``, ``torch.jit.load``): downloaded in :data:`CHUNK`-byte pieces (memory bounded by one piece) to a
    fresh folder in the system temporary folder under the URL's file name, and removed on exit.

    Raises:
        InputNotFoundError: nothing at ``url``.
        RemoteError: the download failed (nothing is left behind).
    """
    folder = _stdlib("tempfile").mkdtemp(prefix="ckptool-")
    try:
        local = os.path.join(folder, url.rstrip("/").rsplit("/", 1)[-1] or "checkpoint")
        with open_binary(url) as f, open(local, "wb") as out:
            _stdlib("shutil").copyfileobj(f, out, CHUNK)
        yield local
    finally:
        _stdlib("shutil").rmtree(folder, ignore_errors=True)


def upload(local: str, url: str) -> None:
    """Copy the local file ``local`` to ``url`` (``fs.open(url, "wb")``, :data:`CHUNK` bytes at a time); the object
    exists only once the copy is complete (the close commits it: S3 completes its multipart upload). On any failure
    the upload is discarded (``discard()``: S3 aborts the multipart upload) and nothing is left at ``url``.

    Raises:
        RemoteError: the destination could not be written.
    """
    fs, p = filesystem(url)
    # parts of CHUNK bytes (S3 takes parts of 5 MiB and more, 10,000 at most): fsspec's default of 50 MiB made
    # the upload hold several copies of a part
    block = max(CHUNK, -(-os.path.getsize(local) // 9000))
    out: Any = None
    try:
        out = fs.open(p, "wb", block_size=block)
        with open(local, "rb") as src:
            while True:
                piece = src.read(CHUNK)
                if not piece:
                    break
                out.write(piece)
        out.close()
        pins.pop(url, None)  # the object there is now the one written: later reads are held to it
    except BaseException as e:
        if out is not None:
            discard = getattr(out, "discard", None)
            with contextlib.suppress(Exception):
                if discard is not None:
                    discard()
        if isinstance(e, Exception) and not isinstance(e, RemoteError):
            raise RemoteError(f"writing {url} failed ({short_error(e)}); nothing was written there: check the URL, the "
                              "network and fsspec's credentials for it, then run it again", url) from e
        raise


def remote_exists(url: str) -> bool:
    """True when something is at ``url``.

    Raises:
        RemoteError: the URL could not be queried.
    """
    return remote_info(url) is not None


def leaves_folder(folder: str, path: str) -> str | None:
    """Why ``path``, opened as a loader opens a name it joined to ``folder`` (``os.path.join``: an absolute name
    replaces the folder, ``..`` climbs out of it), is not inside ``folder``; None when it is.

    It is outside when its normalised path is not below ``folder``, or when a folder on the way from ``folder`` to
    it (``path`` itself included, when it is a folder) is a symbolic link to a place outside ``folder``'s real
    path: what the link reaches is not the folder's content. A symbolic link as the last part, to a file, is
    accepted (a Hugging Face cache snapshot links every file to its blob). Reads only the links on the way.
    """
    base = os.path.abspath(folder)
    target = os.path.normpath(os.path.join(base, path))
    rel = os.path.relpath(target, base)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        return f"{path} is outside {folder}"
    parts = [] if rel == os.curdir else rel.split(os.sep)
    cur = base
    for i, part in enumerate(parts):
        cur = os.path.join(cur, part)
        if os.path.islink(cur) and (i < len(parts) - 1 or os.path.isdir(cur)):
            real = os.path.realpath(cur)
            if os.path.commonpath([real, os.path.realpath(base)]) != os.path.realpath(base):
                return f"{cur} is a symbolic link to {real}, outside {folder}"
    return None
