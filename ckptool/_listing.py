"""Listing the objects under a URL prefix or folder (:func:`list_objects`, what ``ckptool scan`` of a prefix
reads): fsspec's ``find`` (one listing request per 1000 keys on S3), or for an HTTP server its index pages, read a
level of folders at a time, every link held inside the prefix (:func:`inside_prefix`) and the walk bounded in depth,
entries and page size. fsspec and the modules used only here are imported when a URL is listed.
"""

from __future__ import annotations

import importlib
from typing import Any

from ckptool._remote import filesystem, short_error, version_stamp
from ckptool.errors import RemoteError

__all__ = ["LIST_THREADS", "MAX_INDEX_PAGE", "MAX_LISTED", "MAX_LIST_DEPTH", "inside_prefix", "list_objects"]


def _stdlib(name: str) -> Any:
    """The standard library's module ``name``, imported when a URL is first listed (a local checkpoint's start-up
    does without it)."""
    return importlib.import_module(name)


#: folders whose index pages are read at once when an HTTP folder is listed (:func:`_walk_levels`)
LIST_THREADS = 16


#: folder levels below the prefix an HTTP listing descends at most (an index page that links ``sub/`` forever)
MAX_LIST_DEPTH = 64
#: objects and folders one HTTP listing may find at most (pages of endless distinct links)
MAX_LISTED = 1_000_000


def inside_prefix(link: str, top: str) -> str | None:
    """``link`` (a URL an index page gave) as the URL it names, its query and fragment dropped and its ``.`` /
    ``..`` segments resolved (a trailing ``/`` kept), when that is ``top`` or below it on the same server; None
    when it leads elsewhere (``../../secret/``, ``/secret/``, another host)."""
    parse = _stdlib("urllib.parse")
    posix = _stdlib("posixpath")
    lk, tp = parse.urlsplit(link), parse.urlsplit(top)
    if (lk.scheme.replace("https", "http"), lk.netloc) != (tp.scheme.replace("https", "http"), tp.netloc):
        return None
    path = posix.normpath(lk.path or "/")
    path = "/" if path in (".", "//") else ("/" + path.lstrip("/"))
    if lk.path.endswith("/") and not path.endswith("/"):
        path += "/"
    base = posix.normpath(tp.path or "/").rstrip("/") + "/"
    if not (path == base or path == base.rstrip("/") or path.startswith(base)):
        return None
    return str(parse.urlunsplit((lk.scheme, lk.netloc, path, "", "")))


#: the most bytes an HTTP index page may hold once decoded (a ``Content-Encoding`` bomb stops here)
MAX_INDEX_PAGE = 32 << 20


def _index_page(fs: Any, url: str) -> list[dict[str, Any]]:
    """fsspec's HTTP ``ls(url, detail=True)`` (the same links: ``<a href>`` values, and with ``simple_links`` bare
    URLs), its page read up to :data:`MAX_INDEX_PAGE` bytes once decoded, under the request timeouts.

    Raises:
        RemoteError: the page is larger (an endless page, a compression bomb).
    """
    http = importlib.import_module("fsspec.implementations.http")
    sync = importlib.import_module("fsspec.asyn").sync

    async def fetch() -> bytes:
        session = await fs.set_session()
        async with session.get(fs.encode_url(url), **fs.kwargs) as r:
            fs._raise_not_found_for_status(r, url)
            kind = r.headers.get("Content-Type", "text/html").partition(";")[0]
            if kind not in ("text/html", ""):
                return b""
            out = bytearray()
            while piece := await r.content.read(1 << 20):
                out += piece
                if len(out) > MAX_INDEX_PAGE:
                    raise RemoteError(f"the index page {url} is larger than {MAX_INDEX_PAGE} bytes once decoded (an "
                                      "endless page or a compression bomb?); nothing was listed", url)
            return bytes(out)

    text = sync(fs.loop, fetch).decode("utf-8", "replace")
    links = [u[2] for u in http.ex.findall(text)] + (http.ex2.findall(text) if fs.simple_links else [])
    parts = importlib.import_module("urllib.parse").urlsplit(url)
    out: dict[str, dict[str, Any]] = {}
    for raw in links:
        if raw in ("..", "../"):
            continue
        if raw.startswith("/") and len(raw) > 1:
            link = f"{parts.scheme}://{parts.netloc}{raw}"
        elif raw.startswith("http"):
            link = raw
        else:
            link = "/".join([url.rstrip("/"), raw.lstrip("/")])
        out.setdefault(link, {"name": link, "size": None, "type": "directory" if link.endswith("/") else "file"})
    return list(out.values())


def _walk_levels(fs: Any, top: str) -> dict[str, dict[str, Any]]:
    """``fs.find(top, detail=True)`` for a filesystem whose ``find`` reads one folder after another (HTTP index
    pages: fsspec's ``_walk`` awaits each subfolder in turn): the folders of each level listed at once, on
    :data:`LIST_THREADS` threads, each folder and object once. A link is followed only inside ``top``
    (:func:`inside_prefix`: ``..``, ``.``, queries and fragments normalised away; a link out of it is dropped).

    Raises:
        RemoteError: the folders go deeper than :data:`MAX_LIST_DEPTH` levels or hold more than :data:`MAX_LISTED`
            entries (an endless listing).
    """
    found: dict[str, dict[str, Any]] = {}
    seen, level, depth = {top.rstrip("/")}, [top], 0
    with _stdlib("concurrent.futures").ThreadPoolExecutor(LIST_THREADS) as pool:
        while level:
            depth += 1
            if depth > MAX_LIST_DEPTH:
                raise RemoteError(f"listing {top} went deeper than {MAX_LIST_DEPTH} folder levels (an index page "
                                  "that links further folders without end?); nothing was scanned: give a deeper "
                                  "prefix", top)
            below = []
            for listing in pool.map(lambda d: _index_page(fs, d), level):
                for info in listing:
                    name = inside_prefix(str(info["name"]), top)
                    if name is None:
                        continue
                    if info.get("type") != "directory" and not name.endswith("/"):
                        found.setdefault(name, {**info, "name": name})
                    elif name.rstrip("/") not in seen:
                        seen.add(name.rstrip("/"))
                        below.append(name)
                    if len(found) + len(seen) > MAX_LISTED:
                        raise RemoteError(f"listing {top} found more than {MAX_LISTED} objects and folders (an "
                                          "endless listing?); nothing was scanned: give a narrower prefix", top)
            level = below
    return found


def list_objects(url: str) -> list[tuple[str, int | None, str | None]]:
    """Every object under the prefix or folder ``url`` (recursively, sorted by name; fsspec's ``find``, one listing
    request per 1000 keys on S3; an HTTP server's index pages a level at a time, :func:`_walk_levels`):
    ``(URL, size, version tag)``, the size and ETag / modification time as the listing gives them (None where it
    gives none: an HTTP index page names links only).

    Raises:
        RemoteError: the listing failed.
    """
    fs, p = filesystem(url)
    try:
        found = _walk_levels(fs, p) if type(fs).__name__ == "HTTPFileSystem" else fs.find(p, detail=True)
    except RemoteError:
        raise
    except Exception as e:  # the filesystem's own errors: one clear line
        raise RemoteError(f"cannot list {url} ({short_error(e)}); check the URL, the network and fsspec's credentials "
                          "for it", url) from e
    out = []
    for name in sorted(found):
        info = found[name]
        if info.get("type") == "directory":
            continue
        size, tag = version_stamp(info)
        out.append((str(fs.unstrip_protocol(name)), size, tag))
    return out
