"""Open a checkpoint source by local path or URL: the one home of "where the input bytes come from".

A path argument is a URL when it starts with a scheme and ``://`` (``s3://``, ``gs://``, ``http(s)://``,
``memory://``, ``hf://``...): such a source is read through `fsspec <https://filesystem-spec.readthedocs.io>`_,
imported only then (``pip install 'ckptool[remote]'`` adds fsspec and s3fs), so a local path never imports it.
ckptool handles no credentials: fsspec's own configuration applies (``AWS_*`` variables and ``~/.aws`` for s3fs,
``gcloud`` for gcsfs, ``HF_TOKEN`` for ``hf://``, ``fsspec.config``).

:func:`open_binary` gives a seekable binary reader. Over a URL every read that misses the reader's small buffer
(:data:`BLOCK`) is one range request (``fs.cat_file(path, start, end)``: an HTTP ``Range`` header, an S3 ranged
``GET``), so a reader that seeks to the zip end record, the central directory, ``data.pkl`` and the safetensors
header transfers those bytes and not the tensors; :func:`bytes_transferred` counts what came over the network.
A network failure while reading is one :class:`~ckptool.errors.RemoteError` naming the URL and the offset.

Outputs to a URL are written by :func:`ckptool._fileio.atomic_output` into a local temporary file and sent by
:func:`upload` only once complete; a failed upload is discarded (an S3 multipart upload is aborted), so no partial
destination object is left.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from ckptool.errors import RemoteError, UsageError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")
#: the read buffer of a remote reader: the smallest range request (small reads of a zip's local headers and the
#: first bytes share one); a seek within it costs no request
BLOCK = 32 << 10
#: the size of the pieces in which :func:`upload` and :func:`spool` move bytes (memory bounded by one piece)
CHUNK = 8 << 20
REMOTE_EXTRA = "pip install 'ckptool[remote]'"

_transferred = [0]


def is_url(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and _URL.match(path) is not None


def bytes_transferred() -> int:
    """Bytes read from remote sources (URLs) by this process so far; the difference of two calls is what an
    operation transferred (range requests included, whole reads included)."""
    return _transferred[0]


def _filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path in it)`` for ``url``.

    Raises:
        RemoteError: fsspec (or the package the scheme needs, e.g. s3fs) is not installed, or the scheme is unknown.
    """
    try:
        import fsspec
        import fsspec.core

        fs, fspath = fsspec.core.url_to_fs(url)
        return fs, str(fspath)
    except ImportError as e:  # fsspec itself, or the package of the scheme (s3fs, gcsfs, huggingface_hub...)
        what = e.name or "the package fsspec uses for this scheme"
        raise RemoteError(f"{url} needs {what}, which is not installed ({_short(e)}); install it: "
                          f"{REMOTE_EXTRA} adds fsspec and s3fs (s3://, http(s)://)", url) from e
    except ValueError as e:
        raise RemoteError(f"{url}: {_short(e)}; check the URL's scheme", url) from e


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _remote_info(url: str) -> dict[str, Any] | None:
    """fsspec's ``info`` for ``url``, or None when nothing is there.

    Raises:
        RemoteError: the request failed (network, permission, a bad bucket name...).
    """
    fs, p = _filesystem(url)
    try:
        info: dict[str, Any] = fs.info(p)
    except FileNotFoundError:
        return None
    except Exception as e:  # the filesystem's own errors (botocore, aiohttp...): one clear line
        raise RemoteError(f"cannot read {url} ({_short(e)}); check the URL, the network and fsspec's credentials "
                          "for it", url) from e
    return info


def kind(path: str) -> str | None:
    """``"file"``, ``"directory"`` or None (nothing there) for a local path or URL.

    Raises:
        RemoteError: a URL could not be queried.
    """
    if not is_url(path):
        if os.path.isdir(path):
            return "directory"
        return "file" if os.path.exists(path) else None
    info = _remote_info(path)
    if info is None:
        return None
    return "directory" if info.get("type") == "directory" else "file"


def file_size(path: str) -> int:
    """Size in bytes of the file at ``path`` (local path or URL).

    Raises:
        UsageError: nothing at ``path``.
        RemoteError: a URL could not be queried.
    """
    if not is_url(path):
        return os.path.getsize(path)
    info = _remote_info(path)
    if info is None:
        raise UsageError(f"{path}: no such file; check the URL")
    return int(info.get("size") or 0)


def version_key(path: str) -> tuple[object, ...]:
    """A key that changes when the file at ``path`` changes (for caches of parsed structure): inode, size and
    modification time of a local file; size and ETag / modification time of a URL."""
    if not is_url(path):
        st = os.stat(path)
        return (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    info = _remote_info(path) or {}
    stamp = next((info[k] for k in ("ETag", "etag", "LastModified", "mtime", "last_modified", "created")
                  if info.get(k) is not None), None)
    return (path, info.get("size"), str(stamp))


class _RemoteRaw(io.RawIOBase):
    """A raw, seekable reader of the URL ``url`` (``size`` bytes): each ``readinto`` is one range request."""

    def __init__(self, fs: Any, fspath: str, url: str, size: int) -> None:
        super().__init__()
        self._fs = fs
        self._path = fspath
        self.name = url
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._size - self._pos)
        if n <= 0:
            return 0
        start = self._pos
        try:
            data = self._fs.cat_file(self._path, start=start, end=start + n)
        except Exception as e:  # the filesystem's own errors (botocore, aiohttp, OSError...): one clear line
            raise RemoteError(f"reading {self.name} failed at byte {start} ({_short(e)}); check the network and "
                              "run it again (nothing was written)", self.name) from e
        got = len(data)
        if got == 0:
            return 0
        if got > n:  # a server that ignored the Range header sent more: keep what was asked
            data = data[:n]
            got = n
        b[:got] = data
        self._pos += got
        _transferred[0] += got
        return got


def open_binary(path: str) -> BinaryIO:
    """A seekable binary reader of ``path``: the local file itself (``open(path, "rb")``), or for a URL a reader
    whose reads are range requests (buffered by :data:`BLOCK` bytes). Use it as a context manager.

    Raises:
        UsageError: nothing at a URL.
        RemoteError: a URL could not be reached; later, a read that failed.
        OSError: a local file could not be opened.
    """
    if not is_url(path):
        return open(path, "rb")
    size = file_size(path)
    fs, p = _filesystem(path)
    return io.BufferedReader(_RemoteRaw(fs, p, path, size), buffer_size=BLOCK)


def is_remote_file(f: BinaryIO) -> bool:
    """True when ``f`` came from :func:`open_binary` for a URL."""
    return isinstance(getattr(f, "raw", None), _RemoteRaw)


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


def spool(f: BinaryIO) -> BinaryIO:
    """A local temporary copy (in the system temp folder, deleted when closed) of the whole remote file ``f``,
    copied in :data:`CHUNK`-byte pieces: for layouts without an index (torch legacy streams, plain pickles), which
    can only be read from the start."""
    tmp = tempfile.TemporaryFile(prefix="ckptool-", suffix=".ckptool-tmp")  # noqa: SIM115 - returned
    try:
        f.seek(0)
        shutil.copyfileobj(f, tmp, CHUNK)
        tmp.flush()
        tmp.seek(0)
    except BaseException:
        tmp.close()
        raise
    return tmp


@contextlib.contextmanager
def whole_view(f: BinaryIO, *, lazy: Callable[[RangeView], bool] | None = None) -> Iterator[Any]:
    """The whole content of the open file ``f`` as a bytes-like buffer, released on exit: an ``mmap`` of a local
    file (bytes where it cannot be mapped: a pipe, an empty file); for a remote file a :class:`RangeView` when
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
    whole: mmap.mmap | bytes
    try:
        whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # not mappable (a pipe, an odd filesystem, an empty file): read it
        f.seek(0)
        whole = f.read()
    try:
        yield whole
    finally:
        if isinstance(whole, mmap.mmap):
            whole.close()


@contextlib.contextmanager
def local_copy(url: str) -> Iterator[str]:
    """A local copy of the file at ``url``, for readers that need a path (``torch.load``, ``safetensors``'
    ``load_file``, ``torch.jit.load``): downloaded in :data:`CHUNK`-byte pieces (memory bounded by one piece) to a
    fresh folder in the system temporary folder under the URL's file name, and removed on exit.

    Raises:
        UsageError: nothing at ``url``.
        RemoteError: the download failed (nothing is left behind).
    """
    folder = tempfile.mkdtemp(prefix="ckptool-")
    try:
        local = os.path.join(folder, url.rstrip("/").rsplit("/", 1)[-1] or "checkpoint")
        with open_binary(url) as f, open(local, "wb") as out:
            shutil.copyfileobj(f, out, CHUNK)
        yield local
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def upload(local: str, url: str) -> None:
    """Copy the local file ``local`` to ``url`` (``fs.open(url, "wb")``, :data:`CHUNK` bytes at a time); the object
    exists only once the copy is complete (the close commits it: S3 completes its multipart upload). On any failure
    the upload is discarded (``discard()``: S3 aborts the multipart upload) and nothing is left at ``url``.

    Raises:
        RemoteError: the destination could not be written.
    """
    fs, p = _filesystem(url)
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
    except BaseException as e:
        if out is not None:
            discard = getattr(out, "discard", None)
            with contextlib.suppress(Exception):
                if discard is not None:
                    discard()
        if isinstance(e, Exception) and not isinstance(e, RemoteError):
            raise RemoteError(f"writing {url} failed ({_short(e)}); nothing was written there: check the URL, the "
                              "network and fsspec's credentials for it, then run it again", url) from e
        raise


def remote_exists(url: str) -> bool:
    """True when something is at ``url``.

    Raises:
        RemoteError: the URL could not be queried.
    """
    return _remote_info(url) is not None


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
