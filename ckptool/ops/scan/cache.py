"""The scan cache of ``ckptool scan --cache PATH`` and :func:`ckptool.scan_many`'s ``cache=``: a SQLite file that
maps one version of one checkpoint to what scanning it found, so that a second run over an unchanged bucket reads
nothing but the listing.

The key is the path (absolute) or URL, the file's size and its version (a local file's device, inode, modification
time and status-change time in nanoseconds, :func:`local_version`: ``os.utime`` can set the modification time back,
nothing but the kernel sets the status-change time; an object's ETag, else its modification time, as the listing or
a ``HEAD`` gives them) and ckptool's fingerprint (its version and a hash of its own source files, so a ckptool with
other rules never reuses a result): a replaced object has another size or ETag and is scanned again. The value is
the result as JSON (the schema of ``ckptool scan --json``, :meth:`~ckptool.scanning.results.ScanResult.to_dict`),
never a pickle: a cache file someone else could write must not be a way to run code.

The cache is a hint, never an authority: a row that does not match the schema (:func:`is_valid_row`: types, known
statuses and levels, the path of its key, every global a pickle names listed with its status), a row a local file
cannot have (a "skipped" row: only an object under a URL prefix is skipped) or a database that cannot be read
(damaged pages) is a miss, and the checkpoint is scanned again; nothing in the file is a verdict by itself. A row
that passes these checks is believed, so whoever can write the cache file can make a scan say "safe": keep it where
only the users who run ckptool can write (as trusted as the tool itself). The file is opened like an output: a
symbolic link at its path (or at its ``-wal`` / ``-shm`` companions) is refused when it dangles or leads out of
the folder it sits in, and it must be a regular file.

SQLite's write-ahead log and a busy timeout make the file safe for several writers at once (two runs sharing one
cache, on one machine: SQLite's locks need a local filesystem, not NFS); one run writes from one thread.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sqlite3
import time
from typing import Any

from ckptool import __version__
from ckptool.errors import OutputError
from ckptool.scanning.results import CodeFinding, GlobalFinding, PickleFinding, ScanResult

__all__ = ["ScanCache", "fingerprint", "is_valid_row", "local_version", "result_from_dict"]

#: seconds a writer waits for another's lock before giving up
BUSY_TIMEOUT = 60.0
#: what a skipped object (listed under a prefix, and not a checkpoint by its content) is stored as
SKIPPED = "null"


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """ckptool's version and the SHA-256 (first 16 hex digits) of its own ``.py`` files: part of every cache key, so
    a result is reused only by the same scanning code."""
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    h = hashlib.sha256()
    for root, dirs, files in os.walk(top):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                full = os.path.join(root, name)
                h.update(os.path.relpath(full, top).encode())
                with open(full, "rb") as f:
                    h.update(f.read())
    return f"{__version__}+{h.hexdigest()[:16]}"


def local_version(st: os.stat_result) -> str:
    """The version of a local file in a cache key: ``device:inode:mtime_ns:ctime_ns`` of its ``stat`` (another file
    put in its place, or the same one rewritten with its modification time set back, has another)."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}"


_STATUSES = ("allowed", "needs-trust", "unknown", "dangerous")
_LEVELS = ("safe", "needs-trust", "dangerous")


def _strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _opt_str(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _pickle_ok(p: Any) -> bool:
    if not isinstance(p, dict) or not isinstance(p.get("where"), str) or not _int(p.get("offset")):
        return False
    kp = p.get("key_paths", {})
    return (_strs(p.get("globals", [])) and _opt_str(p.get("error")) and isinstance(p.get("hidden", False), bool)
            and isinstance(p.get("truncated", False), bool) and isinstance(kp, dict)
            and all(isinstance(k, str) and _strs(v) for k, v in kp.items()))


def _global_ok(g: Any) -> bool:
    return (isinstance(g, dict) and isinstance(g.get("name"), str) and g.get("status") in _STATUSES
            and isinstance(g.get("reason"), str) and _strs(g.get("where")))


def _code_ok(c: Any) -> bool:
    return (isinstance(c, dict) and all(isinstance(c.get(k), str) for k in ("member", "kind", "reason"))
            and c.get("level") in _LEVELS and isinstance(c.get("detail", ""), str))


def _head_ok(d: Any, path: str | None) -> bool:
    """The row's own fields: a dict naming ``path`` (when given), its format, error, recognised type and bytes."""
    if not isinstance(d, dict) or not isinstance(d.get("path"), str):
        return False
    if path is not None and d["path"] != path and ("://" in path or os.path.abspath(d["path"]) != path):
        return False
    rec = d.get("recognised")
    br = d.get("bytes_read")
    return (isinstance(d.get("format", "unknown"), str) and _opt_str(d.get("error"))
            and (rec is None or (isinstance(rec, dict) and isinstance(rec.get("kind"), str)
                                 and isinstance(rec.get("description"), str)))
            and (br is None or _int(br) or (isinstance(br, float) and math.isfinite(br))))


def is_valid_row(d: Any, path: str | None = None) -> bool:
    """Whether ``d`` (a cached result, parsed JSON) has the schema of :meth:`ScanResult.to_dict` (types, known
    statuses and levels, finite counts), names ``path`` (when given: the URL, or the absolute path of a local file)
    and lists every global its pickles name with a
    status; anything else is a miss."""
    if not _head_ok(d, path):
        return False
    pickles, globs, code = d.get("pickles", []), d.get("globals", []), d.get("code", [])
    if not (isinstance(pickles, list) and all(map(_pickle_ok, pickles)) and isinstance(globs, list)
            and all(map(_global_ok, globs)) and isinstance(code, list) and all(map(_code_ok, code))
            and _strs(d.get("notes", []))):
        return False
    named = {g["name"] for g in globs}
    return all(name in named for p in pickles for name in p.get("globals", []))


def result_from_dict(d: dict[str, Any]) -> ScanResult:
    """The :class:`ScanResult` whose :meth:`~ScanResult.to_dict` is ``d`` (the verdicts are recomputed from the
    findings; keys it does not know are ignored)."""
    rec = d.get("recognised")
    res = ScanResult(str(d["path"]), str(d.get("format", "unknown")), error=d.get("error"),
                     recognised=None if rec is None else (rec["kind"], rec["description"]),
                     bytes_read=d.get("bytes_read"))
    fields = set(PickleFinding.__dataclass_fields__)
    res.pickles = [PickleFinding(**{k: v for k, v in p.items() if k in fields}) for p in d.get("pickles", [])]
    res.globals = [GlobalFinding(g["name"], g["status"], g["reason"], list(g["where"])) for g in d.get("globals", [])]
    res.notes = list(d.get("notes", []))
    res.code = [CodeFinding(c["member"], c["kind"], c["level"], c["reason"], c.get("detail", ""))
                for c in d.get("code", [])]
    # "incomplete" is ScanResult.cut_short: the container's own list, then one line per truncated pickle
    res.incomplete = [str(why) for why in d.get("incomplete", [])][:len(d.get("incomplete", [])) - sum(
        bool(p.truncated) for p in res.pickles)]
    return res


def _prepare(db: sqlite3.Connection) -> None:
    """Switch ``db`` to the write-ahead log and make its table. Two runs opening a new cache at once can find it
    locked here (SQLite does not wait on its busy timeout for the journal-mode switch): retried until
    :data:`BUSY_TIMEOUT` has passed.

    Raises:
        sqlite3.Error: not a database, or still locked after the timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS scans (key TEXT PRIMARY KEY, result TEXT NOT NULL)")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _is_busy(e: sqlite3.Error) -> bool:
    """Whether ``e`` says another writer holds the database (not that the file is damaged)."""
    return isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e))


def _retrying(op: Any) -> Any:
    """``op()``, tried again while another writer holds the database (SQLite answers some lock waits at once,
    not after its busy timeout), until :data:`BUSY_TIMEOUT` has passed.

    Raises:
        sqlite3.Error: what the last try raised."""
    deadline = time.monotonic() + BUSY_TIMEOUT
    while True:
        try:
            return op()
        except sqlite3.OperationalError as e:
            if not _is_busy(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _check_link(p: str, cache: str) -> None:
    """Refuse ``p`` (the cache file or one of SQLite's companions of it) when it is a symbolic link that dangles or
    leads out of its folder, or something else than a regular file.

    Raises:
        OutputError: it is.
    """
    if os.path.islink(p):
        real = os.path.realpath(p)
        folder = os.path.realpath(os.path.dirname(os.path.abspath(p)))
        if not os.path.exists(real) or os.path.commonpath([folder, real]) != folder:
            raise OutputError(f"{p} is a symbolic link to {os.readlink(p)!r}, which "
                              f"{'does not exist' if not os.path.exists(real) else 'is outside its folder'}; the "
                              f"scan cache is not opened through it: give --cache a plain file path", cache)
    if os.path.exists(p) and not os.path.isfile(p):
        raise OutputError(f"{p} is not a regular file; give --cache a plain file path", cache)


class ScanCache:
    """The SQLite scan cache at ``path`` (made when missing). :meth:`get` and :meth:`put` by :meth:`key`.

    Raises:
        OutputError: the file cannot be opened or made as a SQLite database; it (or its ``-wal`` / ``-shm`` file)
            is a symbolic link that dangles or leads out of its folder, or no regular file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        #: True once a read or write failed (damaged pages): every look-up is then a miss
        self._broken = False
        for p in (self.path, self.path + "-wal", self.path + "-shm"):
            _check_link(p, self.path)
        try:
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None,
                                       check_same_thread=False)
            _prepare(self._db)
        except sqlite3.Error as e:
            raise OutputError(f"cannot use {self.path} as a scan cache ({e}); give another --cache path",
                              self.path) from e

    @staticmethod
    def key(path: str, size: int | None, version: str | None) -> str:
        """The key of one version of the file or object ``path``: path or URL, size, version, ckptool's
        :func:`fingerprint`."""
        return json.dumps([path, size, version, fingerprint()])

    def get(self, key: str, *, may_skip: bool = True) -> tuple[bool, ScanResult | None]:
        """``(found, result)``: the result stored for ``key`` (None: the object is no checkpoint, skipped; only
        where ``may_skip``, an object listed under a URL prefix). A row that does not pass :func:`is_valid_row` for
        the key's path, and a database that cannot be read, are a miss ``(False, None)``."""
        if self._broken:
            return False, None
        try:
            row = _retrying(lambda: self._db.execute("SELECT result FROM scans WHERE key = ?", (key,)).fetchone())
        except sqlite3.Error as e:  # damaged pages: the cache is a hint, the checkpoint is scanned again
            self._broken = not _is_busy(e)
            return False, None
        if row is None or not isinstance(row[0], str):
            return False, None
        text = row[0]
        if text == SKIPPED:
            return (True, None) if may_skip else (False, None)
        try:
            d = json.loads(text)
            path = json.loads(key)[0]
            if not is_valid_row(d, path if isinstance(path, str) else None):
                return False, None
            return True, result_from_dict(d)
        except (ValueError, TypeError, KeyError, IndexError, RecursionError):
            return False, None

    def put(self, key: str, result: ScanResult | None) -> None:
        """Store ``result`` (None: skipped) for ``key``, replacing what was there; nothing when the database cannot
        be written (it is only a hint)."""
        if self._broken:
            return
        text = SKIPPED if result is None else json.dumps(result.to_dict())
        try:
            _retrying(lambda: self._db.execute("INSERT OR REPLACE INTO scans (key, result) VALUES (?, ?)",
                                               (key, text)))
        except sqlite3.Error as e:
            self._broken = not _is_busy(e)

    def close(self) -> None:
        """Close the database."""
        self._db.close()
