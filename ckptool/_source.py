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

Outputs to a URL are written by :func:`ckptool._fileio.atomic_output` into a local temporary file and sent by
:func:`upload` only once complete; a failed upload is discarded (an S3 multipart upload is aborted), so no partial
destination object is left.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import mmap
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar

from ckptool.errors import RemoteError, UsageError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")
#: the read buffer of a remote reader: the smallest range request (small reads of a zip's local headers and the
#: first bytes share one); a seek within it costs no request
BLOCK = 32 << 10
#: the size of the pieces in which :func:`upload` and :func:`spool` move bytes (memory bounded by one piece)
CHUNK = 8 << 20
REMOTE_EXTRA = "pip install 'ckptool[remote]'"

_transferred = [0]
F = TypeVar("F", bound=Callable[..., Any])


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
    """fsspec's ``info`` for ``url``, or None when nothing is there. Inside :func:`consistent_reads` the object's
    size and version tag are held to those it had at first (:func:`_check_pin`).

    Raises:
        RemoteError: the request failed (network, permission, a bad bucket name...); the object changed.
    """
    fs, p = _filesystem(url)
    try:
        info: dict[str, Any] = fs.info(p)
    except FileNotFoundError:
        return None
    except Exception as e:  # the filesystem's own errors (botocore, aiohttp...): one clear line
        raise RemoteError(f"cannot read {url} ({_short(e)}); check the URL, the network and fsspec's credentials "
                          "for it", url) from e
    if info.get("type") != "directory":
        _check_pin(url, _stamp(info))
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
    return (path, *_stamp(_remote_info(path) or {}))


# ------------------------------------------------------------------------------------------------ one object
#: the info keys that name an object's version, first found wins: an ETag (HTTP, S3, GCS), else its modification
#: time (HTTP ``Last-Modified``, S3 ``LastModified``, ``mtime``, ``created`` of fsspec's memory filesystem)
_TAGS = ("ETag", "etag", "Last-Modified", "LastModified", "mtime", "last_modified", "created")
#: URL -> the stamp (size, version tag) it had when first seen inside :func:`consistent_reads`
_pins: dict[str, tuple[int | None, str | None]] = {}
_scopes = [0]
#: (URL, stamp) -> local copy of an object whose server ignores ``Range`` (see :func:`_spooled`)
_spools: dict[tuple[str, tuple[int | None, str | None]], str] = {}


def _stamp(info: dict[str, Any]) -> tuple[int | None, str | None]:
    """``(size, version tag)`` of fsspec's ``info`` of an object: what must stay equal while it is read."""
    tag = next((str(info[k]) for k in _TAGS if info.get(k) is not None), None)
    size = info.get("size")
    return (None if size is None else int(size), tag)


def _check_pin(url: str, stamp: tuple[int | None, str | None]) -> None:
    """Compare ``stamp`` with the one ``url`` had when first seen inside :func:`consistent_reads` (and pin it).

    Raises:
        RemoteError: the object changed: another size or version tag than before.
    """
    if not _scopes[0]:
        return
    first = _pins.setdefault(url, stamp)
    if first != stamp:
        raise changed_error(url, first, stamp)


def changed_error(url: str, before: object, after: object) -> RemoteError:
    """The :class:`RemoteError` for ``url`` whose (size, ETag / modification time) went from ``before`` to
    ``after`` between two requests."""
    return RemoteError(f"{url} changed while it was read (size and ETag / Last-Modified were {before}, now "
                       f"{after}); nothing was written: run it again once the object is no longer being replaced",
                       url)


@contextlib.contextmanager
def consistent_reads() -> Iterator[None]:
    """Within this block every URL is held to the size and ETag (or modification time) it had when first seen:
    a later request that finds another is refused (:class:`~ckptool.errors.RemoteError`), so one command never
    mixes bytes of two versions of an object. A server that ignores ``Range`` has its object downloaded once per
    block (:func:`_spooled`). Blocks nest; the pins and local copies are dropped when the outermost one ends."""
    _scopes[0] += 1
    try:
        yield
    finally:
        _scopes[0] -= 1
        if not _scopes[0]:
            _pins.clear()
            for local in _spools.values():
                with contextlib.suppress(OSError):
                    os.unlink(local)
            _spools.clear()


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
    info = _remote_info(url)
    if info is None:
        raise RemoteError(f"{url} disappeared while it was read; nothing was written", url)
    return _stamp(info)


class RangeError(Exception):
    """A range request did not answer with exactly the bytes asked for (a wrong status, ``Content-Range`` or
    length); the message says what came instead."""


class NoRangeSupport(RangeError):
    """The server answered a range request with the whole object (status 200): it ignores ``Range``."""


def _http_file(fs: Any, url: str, info: dict[str, Any]) -> Any:
    """fsspec's :class:`~fsspec.implementations.http.HTTPFile` for ``url`` (its block cache, :data:`BLOCK`), whose
    range fetch accepts only an exact answer: status 206, ``Content-Range: bytes START-END/SIZE`` naming the
    range asked for and the object's size (``info["size"]``), a body of exactly that length, and the ETag and
    ``Last-Modified`` of ``info`` where the answer carries them. fsspec's own fetch also takes a 206 whose
    ``Content-Range`` names other bytes, and 200 answers at offset 0.

    Its fetch raises :class:`NoRangeSupport` for a 200 answer, :class:`RangeError` for another inexact one and
    :class:`~ckptool.errors.RemoteError` when the ETag or ``Last-Modified`` changed.
    """
    from fsspec.asyn import sync, sync_wrapper
    from fsspec.implementations.http import HTTPFile

    size = int(info["size"])
    versions = {k: info[k] for k in ("ETag", "Last-Modified") if info.get(k)}

    class ExactHTTPFile(HTTPFile):  # type: ignore[misc]  # fsspec is untyped
        async def async_fetch_range(self, start: int, end: int) -> bytes:
            kwargs = self.kwargs.copy()
            headers = {**kwargs.pop("headers", {}), "Range": f"bytes={start}-{end - 1}",
                       "Accept-Encoding": "identity"}
            r = await self.session.get(self.fs.encode_url(self.url), headers=headers, **kwargs)
            async with r:
                r.raise_for_status()
                if r.status == 200 and start == 0 and end == size:  # the whole object asked for, and sent
                    out_all: bytes = await r.read()
                    if len(out_all) != size:
                        raise RangeError(f"the server sent {len(out_all)} bytes for the whole object of {size}")
                    return out_all
                if r.status == 200:
                    raise NoRangeSupport(f"the server answered a request for bytes {start}-{end - 1} with the "
                                         "whole object (status 200): it ignores Range")
                if r.status != 206:
                    raise RangeError(f"the server answered a range request with status {r.status}")
                want = f"bytes {start}-{end - 1}/{size}"
                got = r.headers.get("Content-Range", "").strip()
                if got not in (want, f"bytes {start}-{end - 1}/*"):
                    raise RangeError(f"the server sent Content-Range {got or 'none'!r} for a request of {want!r}")
                for k, v in versions.items():
                    if r.headers.get(k, v) != v:
                        raise changed_error(url, f"{k} {v}", f"{k} {r.headers[k]}")
                out: bytes = await r.read()
            if len(out) != end - start:
                raise RangeError(f"the server sent {len(out)} bytes for a range of {end - start}")
            return out

        _fetch_range = sync_wrapper(async_fetch_range)

    session = sync(fs.loop, fs.set_session)
    kw = {k: v for k, v in fs.kwargs.items() if k != "asynchronous"}
    return ExactHTTPFile(fs, url, session=session, block_size=BLOCK, size=size, cache_type="readahead",
                         loop=fs.loop, **kw)


def _spooled(fs: Any, fspath: str, url: str, stamp: tuple[int | None, str | None]) -> str:
    """The path of a local copy of the object at ``url`` (``stamp``: its size and version tag), for a server that
    ignores ``Range``: the whole object is streamed once (``fs.open(block_size=0)``, fsspec's streaming reader) into
    a temporary file in the system temporary folder, checked to hold ``stamp``'s size, and announced on stderr with
    its byte count. Inside :func:`consistent_reads` one copy serves every reader of the same version; the copies
    are removed when the block ends (else when the process exits).

    Raises:
        RemoteError: the download failed or did not bring the object's size.
    """
    key = (url, stamp)
    local = _spools.get(key)
    if local is not None:
        return local
    fd, local = tempfile.mkstemp(prefix="ckptool-", suffix=".ckptool-tmp")
    try:
        with os.fdopen(fd, "wb") as out, fs.open(fspath, "rb", block_size=0) as src:
            n = 0
            while piece := src.read(CHUNK):
                out.write(piece)
                n += len(piece)
        _transferred[0] += n
        if stamp[0] is not None and n != stamp[0]:
            raise RemoteError(f"{url}: the server ignores Range requests, and the whole object it sent holds {n} "
                              f"bytes where its size is {stamp[0]}; nothing was written: run it again", url)
        info = _remote_info(url)  # the object downloaded is the one first seen, still there
        if info is None or _stamp(info) != stamp:
            raise changed_error(url, stamp, None if info is None else _stamp(info))
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(local)
        if isinstance(e, Exception) and not isinstance(e, RemoteError):
            raise RemoteError(f"reading {url} failed ({_short(e)}); the server ignores Range requests, so the "
                              "whole object was being downloaded: check the network and run it again", url) from e
        raise
    sys.stderr.write(f"Note: {url}: the server ignores Range requests; downloaded the whole object once ({n} "
                     "bytes) into a temporary file and read it from there\n")
    sys.stderr.flush()
    _spools[key] = local
    if not _scopes[0]:
        atexit.register(_drop_spool, key)
    return local


def _drop_spool(key: tuple[str, tuple[int | None, str | None]]) -> None:
    local = _spools.pop(key, None)
    if local is not None:
        with contextlib.suppress(OSError):
            os.unlink(local)


def _checked_fetcher(f: Any, fs: Any, fspath: str, url: str, stamp: tuple[int | None, str | None]
                     ) -> Callable[[int, int], bytes]:
    """The fetcher for ``f.cache`` (fsspec's block cache of ``f``): ``f``'s own range fetch, held to returning
    exactly ``min(end, size) - start`` bytes, counted in :func:`bytes_transferred`; its failures become one
    :class:`~ckptool.errors.RemoteError` naming the URL and the offset. Once the server is seen to ignore
    ``Range`` (:class:`NoRangeSupport`), every read of this object comes from :func:`_spooled`'s local copy."""
    fetch = f.cache.fetcher
    size = f.size

    def fetcher(start: int, end: int) -> bytes:
        end = min(end, size)
        if start >= end:
            return b""
        local = _spools.get((url, stamp))
        if local is None:
            try:
                data = fetch(start, end)
            except NoRangeSupport:
                local = _spooled(fs, fspath, url, stamp)
            except RemoteError:
                raise
            except Exception as e:  # fsspec's, aiohttp's, botocore's errors, RangeError: one clear line
                expired = type(e).__name__ == "FileExpired"  # s3fs: the ETag changed (If-Match failed)
                if expired:
                    raise changed_error(url, stamp, "another ETag") from e
                raise RemoteError(f"reading {url} failed at byte {start} ({_short(e)}); check the network and the "
                                  "server, and run it again (nothing was written)", url) from e
            else:
                if len(data) != end - start:
                    raise RemoteError(f"reading {url} failed at byte {start}: {len(data)} bytes came for a range of "
                                      f"{end - start}; nothing was written: run it again", url)
                _transferred[0] += len(data)
                return bytes(data)
        with open(local, "rb") as g:
            g.seek(start)
            return g.read(end - start)

    return fetcher


class _Counted(io.RawIOBase):
    """A raw reader over ``f``, a file of an in-process fsspec filesystem (``memory://``, ``file://``: exact reads,
    no range requests), counting what it reads in :func:`bytes_transferred`."""

    def __init__(self, f: Any, url: str) -> None:
        super().__init__()
        self._f = f
        self.name = url

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return int(self._f.tell())

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self._f.seek(offset, whence))

    def readinto(self, b: Any) -> int:
        data = self._f.read(len(b))
        b[: len(data)] = data
        _transferred[0] += len(data)
        return len(data)

    def close(self) -> None:
        self._f.close()
        super().close()


def open_binary(path: str) -> BinaryIO:
    """A seekable binary reader of ``path``: the local file itself (``open(path, "rb")``), or for a URL fsspec's
    own file object (``fs.open``: its read-ahead cache of :data:`BLOCK` bytes, each miss one range request) with
    every range read checked to bring exactly the bytes asked for (over HTTP: status 206 and a ``Content-Range``
    naming them, :func:`_http_file`), and the object's size and ETag / modification time held to those of the
    open (:func:`consistent_reads` holds them across opens). A server that ignores ``Range`` has the object
    downloaded once (:func:`_spooled`). Use it as a context manager.

    Raises:
        UsageError: nothing at a URL.
        RemoteError: a URL could not be reached or changed; later, a read that failed or was not exact.
        OSError: a local file could not be opened.
    """
    if not is_url(path):
        return open(path, "rb")
    info = _remote_info(path)
    if info is None:
        raise UsageError(f"{path}: no such file; check the URL")
    stamp = _stamp(info)
    fs, p = _filesystem(path)
    try:
        if type(fs).__name__ == "HTTPFileSystem" and info.get("size") is not None:
            f = _http_file(fs, p, info)
        else:
            f = fs.open(p, "rb", block_size=BLOCK, cache_type="readahead")
    except Exception as e:
        raise RemoteError(f"cannot open {path} ({_short(e)}); check the URL and the network", path) from e
    if getattr(f, "cache", None) is None or not hasattr(f.cache, "fetcher"):  # memory://, file://
        return io.BufferedReader(_Counted(f, path), buffer_size=BLOCK)
    again = _stamp(getattr(f, "_details", None) or {})
    if again[1] is not None and again != stamp:  # the file object asked for the object's info once more
        f.close()
        raise changed_error(path, stamp, again)
    f.cache.fetcher = _checked_fetcher(f, fs, p, path, stamp)
    f.name = path
    return f  # type: ignore[no-any-return]


def is_remote_file(f: BinaryIO) -> bool:
    """True when ``f`` came from :func:`open_binary` for a URL."""
    return isinstance(getattr(f, "raw", None), _Counted) or getattr(f, "cache", None) is not None


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
        _pins.pop(url, None)  # the object there is now the one written: later reads are held to it
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
