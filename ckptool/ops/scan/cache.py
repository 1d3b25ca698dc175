"""The scan cache of ``ckptool scan --cache PATH`` and :func:`ckptool.scan_many`'s ``cache=``: a SQLite file that
maps one version of one checkpoint to what scanning it found, so that a second run over an unchanged bucket reads
nothing but the listing.

The key is the path (absolute) or URL, the file's size and its version (a local file's modification time in
nanoseconds; an object's ETag, else its modification time, as the listing or a ``HEAD`` gives them) and ckptool's
fingerprint (its version and a hash of its own source files, so a ckptool with other rules never reuses a result):
a replaced object has another size or ETag and is scanned again. The value is the result as JSON (the schema of
``ckptool scan --json``, :meth:`~ckptool.ops.scan.results.ScanResult.to_dict`), never a pickle: a cache file
someone else could write must not be a way to run code.

SQLite's write-ahead log and a busy timeout make the file safe for several writers at once (two runs sharing one
cache, on one machine: SQLite's locks need a local filesystem, not NFS); one run writes from one thread.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sqlite3
import time
from typing import Any

from ckptool import __version__
from ckptool.errors import OutputError
from ckptool.ops.scan.results import CodeFinding, GlobalFinding, PickleFinding, ScanResult

__all__ = ["ScanCache", "fingerprint", "result_from_dict"]

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


class ScanCache:
    """The SQLite scan cache at ``path`` (made when missing). :meth:`get` and :meth:`put` by :meth:`key`.

    Raises:
        OutputError: the file cannot be opened or made as a SQLite database.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
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

    def get(self, key: str) -> tuple[bool, ScanResult | None]:
        """``(found, result)``: the result stored for ``key`` (None: the object is no checkpoint, skipped)."""
        row = self._db.execute("SELECT result FROM scans WHERE key = ?", (key,)).fetchone()
        if row is None:
            return False, None
        text = str(row[0])
        return True, None if text == SKIPPED else result_from_dict(json.loads(text))

    def put(self, key: str, result: ScanResult | None) -> None:
        """Store ``result`` (None: skipped) for ``key``, replacing what was there."""
        text = SKIPPED if result is None else json.dumps(result.to_dict())
        self._db.execute("INSERT OR REPLACE INTO scans (key, result) VALUES (?, ?)", (key, text))

    def close(self) -> None:
        """Close the database."""
        self._db.close()
