"""Remote objects (URLs) as :mod:`ckptool._source` reads them: fsspec's filesystem for a URL, the object's version
pinned while a command reads it, range reads held to be exact, and a local copy for a server that ignores ``Range``.

* :func:`consistent_reads` pins each URL's size and ETag / modification time at first sight (:func:`_check_pin`);
  a later request that finds another raises :func:`changed_error`'s :class:`~ckptool.errors.RemoteError`.
* :func:`http_file` is fsspec's HTTP file with a range fetch that accepts only an exact answer (status 206, a
  ``Content-Range`` naming the bytes asked for); :func:`checked_fetcher` holds every other filesystem's fetch to
  the length asked for, counts the bytes in :data:`transferred_bytes` and turns failures into one ``RemoteError``.
* :func:`_spooled` downloads the whole object once when the server answers a range request with all of it.
* :func:`object_reads` shares one object's ``info`` (its ``HEAD``) and the byte ranges fetched so far
  (:class:`ckptool._ranges.RangeStore`, read through :class:`ckptool._ranges.StoreCache`) among every open of it
  in one block: a scan opens an object several times (format detection, its zip directory, the walk, the code
  finder), and each open would else ask for its size and ETag again and fetch the same ranges again.

fsspec is imported only when a URL is read. :mod:`ckptool._source` re-exports the public names.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ckptool._ranges import RangeStore
from ckptool.errors import RemoteError

__all__ = [
    "BLOCK",
    "CHUNK",
    "REMOTE_EXTRA",
    "CountedReader",
    "NoRangeSupport",
    "RangeError",
    "changed_error",
    "checked_fetcher",
    "consistent_reads",
    "count_transferred",
    "filesystem",
    "http_file",
    "object_reads",
    "pins",
    "range_store",
    "remote_info",
    "set_timeout",
    "short_error",
    "thread_transferred",
    "timeout",
    "transferred_bytes",
    "version_stamp",
]

#: the read buffer of a remote reader: the smallest range request (small reads of a zip's local headers and the
#: first bytes share one); a seek within it costs no request
BLOCK = 32 << 10
#: the size of the pieces in which :func:`ckptool._source.upload` and :func:`ckptool._source.spool` move bytes (memory
#: bounded by one piece)
CHUNK = 8 << 20
REMOTE_EXTRA = "pip install 'ckptool[remote]'"

#: bytes read from remote sources by this process (:func:`ckptool._source.bytes_transferred`)
transferred_bytes = [0]
#: the same count per thread (``.n``), so that concurrent scans each know their own (:func:`count_transferred`)
_per_thread = threading.local()


def count_transferred(n: int) -> None:
    """Add ``n`` bytes read from a remote source to the process's count and to the calling thread's."""
    transferred_bytes[0] += n
    _per_thread.n = getattr(_per_thread, "n", 0) + n


def thread_transferred() -> int:
    """Bytes read from remote sources by the calling thread so far (a scan running beside others in threads
    counts only its own)."""
    return int(getattr(_per_thread, "n", 0))


#: seconds an HTTP(S) request may wait to connect, or for its next bytes (``ckptool --timeout``,
#: ``CKPTOOL_TIMEOUT``); a range request may take this long plus one second per :data:`MIN_RATE` bytes in all
DEFAULT_TIMEOUT = 10.0
_timeout: list[float | None] = [None]
#: bytes per second a range answer must at least bring (a server sending a byte a second fails)
MIN_RATE = 64 << 10


def set_timeout(seconds: float | None) -> None:
    """Set the per-request timeout of HTTP(S) reads (seconds; None: ``CKPTOOL_TIMEOUT`` or
    :data:`DEFAULT_TIMEOUT`)."""
    _timeout[0] = seconds


def timeout() -> float:
    """The per-request timeout of HTTP(S) reads in seconds: :func:`set_timeout`'s, else ``CKPTOOL_TIMEOUT``, else
    :data:`DEFAULT_TIMEOUT` (an unreadable, non-finite or non-positive ``CKPTOOL_TIMEOUT`` is ignored)."""
    if _timeout[0] is not None:
        return _timeout[0]
    try:
        env = float(os.environ.get("CKPTOOL_TIMEOUT", ""))
    except ValueError:
        return DEFAULT_TIMEOUT
    return env if 0 < env < 1e6 else DEFAULT_TIMEOUT


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path in it)`` for ``url``.

    Raises:
        RemoteError: fsspec (or the package the scheme needs, e.g. s3fs) is not installed, or the scheme is unknown.
    """
    try:
        import fsspec
        import fsspec.core

        options: dict[str, Any] = {}
        if url.split("://", 1)[0].lower() in ("http", "https"):
            import aiohttp

            t = timeout()
            options["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t)}
        fs, fspath = fsspec.core.url_to_fs(url, **options)
        return fs, str(fspath)
    except ImportError as e:  # fsspec itself, or the package of the scheme (s3fs, gcsfs, huggingface_hub...)
        what = e.name or "the package fsspec uses for this scheme"
        raise RemoteError(f"{url} needs {what}, which is not installed ({short_error(e)}); install it: "
                          f"{REMOTE_EXTRA} adds fsspec and s3fs (s3://, http(s)://)", url) from e
    except ValueError as e:
        raise RemoteError(f"{url}: {short_error(e)}; check the URL's scheme", url) from e


def short_error(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters) of ``e``, for one-line errors."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def remote_info(url: str, *, fresh: bool = False) -> dict[str, Any] | None:
    """fsspec's ``info`` for ``url`` (one ``HEAD`` over HTTP and S3, unless fsspec's listing cache has it), or None
    when nothing is there. Inside :func:`consistent_reads` the object's size and version tag are held to those it
    had at first (:func:`_check_pin`). Inside :func:`object_reads` of ``url`` on this thread the first answer is
    reused (no request) unless ``fresh``: the evidence that an object is still there asks again.

    Raises:
        RemoteError: the request failed (network, permission, a bad bucket name...); the object changed.
    """
    held = _objects.get((threading.get_ident(), url))
    if held is not None and held.info is not None and not fresh:
        return held.info
    fs, p = filesystem(url)
    try:
        info: dict[str, Any] = fs.info(p)
    except FileNotFoundError:
        return None
    except Exception as e:  # the filesystem's own errors (botocore, aiohttp...): one clear line
        raise RemoteError(f"cannot read {url} ({short_error(e)}); check the URL, the network and fsspec's credentials "
                          "for it", url) from e
    if info.get("type") != "directory":
        _check_pin(url, version_stamp(info))
        if held is not None:
            held.info = info
    return info


# ------------------------------------------------------------------------------------------------ one object
#: the info keys that name an object's version, first found wins: an ETag (HTTP, S3, GCS), else its modification
#: time (HTTP ``Last-Modified``, S3 ``LastModified``, ``mtime``, ``created`` of fsspec's memory filesystem)
_TAGS = ("ETag", "etag", "Last-Modified", "LastModified", "mtime", "last_modified", "created")
#: URL -> the stamp (size, version tag) it had when first seen inside :func:`consistent_reads`
pins: dict[str, tuple[int | None, str | None]] = {}
_scopes = [0]
#: (URL, stamp) -> local copy of an object whose server ignores ``Range`` (see :func:`_spooled`)
_spools: dict[tuple[str, tuple[int | None, str | None]], str] = {}


def version_stamp(info: dict[str, Any]) -> tuple[int | None, str | None]:
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
    first = pins.setdefault(url, stamp)
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
            pins.clear()
            for local in _spools.values():
                with contextlib.suppress(OSError):
                    os.unlink(local)
            _spools.clear()


class RangeError(Exception):
    """A range request did not answer with exactly the bytes asked for (a wrong status, ``Content-Range`` or
    length); the message says what came instead."""


class NoRangeSupport(RangeError):
    """The server answered a range request with the whole object (status 200): it ignores ``Range``."""


async def _bounded(r: Any, n: int) -> bytes:
    """The body of the aiohttp response ``r``, read up to ``n`` bytes and no further (a server that sends more
    than the object's or the range's size is refused, never read on into memory).

    Raises:
        RangeError: more than ``n`` bytes came."""
    out = bytearray()
    while True:
        piece = await r.content.read(min(CHUNK, n + 1 - len(out)))
        if not piece:
            return bytes(out)
        out += piece
        if len(out) > n:
            raise RangeError(f"the server sent more than the {n} bytes asked for (its body runs past the object's "
                             "declared size)")


def http_file(fs: Any, url: str, info: dict[str, Any]) -> Any:
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
            import aiohttp

            t = timeout()
            kwargs["timeout"] = aiohttp.ClientTimeout(total=t + (end - start) / MIN_RATE, sock_connect=t, sock_read=t)
            r = await self.session.get(self.fs.encode_url(self.url), headers=headers, **kwargs)
            async with r:
                r.raise_for_status()
                enc = r.headers.get("Content-Encoding", "identity").strip().lower()
                if enc not in ("", "identity"):
                    raise RangeError(f"the server answered a range request with Content-Encoding {enc!r} (asked for "
                                     "identity): refused, the bytes it would inflate to are not bounded")
                if r.status == 200 and start == 0 and end == size:  # the whole object asked for, and sent
                    out_all = await _bounded(r, size)
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
                out = await _bounded(r, end - start)
            if len(out) != end - start:
                raise RangeError(f"the server sent {len(out)} bytes for a range of {end - start}")
            return out

        _fetch_range = sync_wrapper(async_fetch_range)

    session = sync(fs.loop, fs.set_session)
    kw = {k: v for k, v in fs.kwargs.items() if k != "asynchronous"}
    return ExactHTTPFile(fs, url, session=session, block_size=BLOCK, size=size, cache_type="readahead",
                         loop=fs.loop, **kw)


def _spooled(fs: Any, fspath: str, url: str, stamp: tuple[int | None, str | None],
             why: str = "the server ignores Range requests") -> str:
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
    # tempfile imported here, for a remote file only: a local checkpoint's start-up does without it (and shutil, bz2,
    # lzma, random, which it imports)
    made: tuple[int, str] = importlib.import_module("tempfile").mkstemp(prefix="ckptool-", suffix=".ckptool-tmp")
    fd, local = made
    try:
        with os.fdopen(fd, "wb") as out, fs.open(fspath, "rb", block_size=0) as src:
            n = 0
            while piece := src.read(CHUNK):
                out.write(piece)
                n += len(piece)
                if stamp[0] is not None and n > stamp[0]:
                    break  # more than the declared size: refused below, never spooled on
        count_transferred(n)
        if stamp[0] is not None and n != stamp[0]:
            held = f"more than {stamp[0]}" if n > stamp[0] else str(n)
            raise RemoteError(f"{url}: {why}, and the whole object it sent holds {held} bytes where its size is "
                              f"{stamp[0]}; nothing was written: run it again", url)
        info = remote_info(url, fresh=True)  # the object downloaded is the one first seen, still there
        if info is None or version_stamp(info) != stamp:
            raise changed_error(url, stamp, None if info is None else version_stamp(info))
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(local)
        if isinstance(e, Exception) and not isinstance(e, RemoteError):
            raise RemoteError(f"reading {url} failed ({short_error(e)}); {why}, so the whole object was being "
                              "downloaded: check the network and run it again", url) from e
        raise
    sys.stderr.write(f"Note: {url}: {why}; downloaded the whole object once ({n} "
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


def checked_fetcher(f: Any, fs: Any, fspath: str, url: str, stamp: tuple[int | None, str | None]
                     ) -> Callable[[int, int], bytes]:
    """The fetcher for ``f.cache`` (fsspec's block cache of ``f``): ``f``'s own range fetch, held to returning
    exactly ``min(end, size) - start`` bytes, counted in :func:`~ckptool._source.bytes_transferred`; its failures
    become one :class:`~ckptool.errors.RemoteError` naming the URL and the offset. Once the server is seen to ignore
    ``Range`` (:class:`NoRangeSupport`), every read of this object comes from :func:`_spooled`'s local copy."""
    fetch = f.cache.fetcher
    size = f.size

    def fetcher(start: int, end: int) -> bytes:
        end = min(end, size)
        if start >= end:
            return b""
        local = _spools.get((url, stamp))
        if local is None and stamp[1] is None and type(fs).__name__ == "HTTPFileSystem":
            # no ETag nor Last-Modified: nothing would tell two versions' ranges apart, so every byte of the object
            # comes from one response (downloaded once, checked against its size)
            local = _spooled(fs, fspath, url, stamp, "the server gives neither ETag nor Last-Modified (ranges of two "
                             "versions could not be told apart)")
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
                raise RemoteError(f"reading {url} failed at byte {start} ({short_error(e)}); check the network and the "
                                  "server, and run it again (nothing was written)", url) from e
            else:
                if len(data) != end - start:
                    raise RemoteError(f"reading {url} failed at byte {start}: {len(data)} bytes came for a range of "
                                      f"{end - start}; nothing was written: run it again", url)
                count_transferred(len(data))
                return bytes(data)
        with open(local, "rb") as g:
            g.seek(start)
            return g.read(end - start)

    return fetcher


class CountedReader(io.RawIOBase):
    """A raw reader over ``f``, a file of an in-process fsspec filesystem (``memory://``, ``file://``: exact reads,
    no range requests), counting what it reads in :func:`~ckptool._source.bytes_transferred`."""

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
        count_transferred(len(data))
        return len(data)

    def close(self) -> None:
        self._f.close()
        super().close()


# -------------------------------------------------------------------------------------------------- one object's opens
class _Object:
    """What the opens of one object share inside :func:`object_reads`: its ``info`` and a store per version."""

    def __init__(self) -> None:
        self.depth = 0
        self.info: dict[str, Any] | None = None
        self.stores: dict[tuple[int | None, str | None], RangeStore] = {}


#: (thread, URL) -> what the opens of that object on that thread share, inside :func:`object_reads`
_objects: dict[tuple[int, str], _Object] = {}


@contextlib.contextmanager
def object_reads(url: str, info: dict[str, Any] | None = None) -> Iterator[None]:
    """Within this block, on this thread, every read of the object at ``url`` shares one ``info`` (its size and
    ETag: one ``HEAD`` however often it is opened, see :func:`remote_info`; none when the caller passes the ``info``
    it already asked for) and one :class:`RangeStore` per version (the bytes one open fetched serve the next),
    released when the block ends. Blocks nest. A scan of one object runs inside one
    (:func:`ckptool.scanning.entry.scan_file`), so that its opens cost the requests of one.

    Raises:
        RemoteError: ``info`` is another version of ``url`` than the one pinned by :func:`consistent_reads`.
    """
    key = (threading.get_ident(), url)
    held = _objects.setdefault(key, _Object())
    if info is not None and held.info is None and info.get("type") != "directory":
        _check_pin(url, version_stamp(info))
        held.info = info
    held.depth += 1
    try:
        yield
    finally:
        held.depth -= 1
        if not held.depth:
            del _objects[key]


def range_store(url: str, stamp: tuple[int | None, str | None]) -> RangeStore:
    """The :class:`RangeStore` of version ``stamp`` of ``url``: the one shared inside :func:`object_reads` on this
    thread, else a new one (the opens of one file object)."""
    held = _objects.get((threading.get_ident(), url))
    if held is None:
        return RangeStore()
    return held.stores.setdefault(stamp, RangeStore())
