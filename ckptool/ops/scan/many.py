"""Scanning many checkpoints in one run: files, folders and object-store prefixes, on any
:class:`concurrent.futures.Executor`, with an optional cache (``ckptool scan --jobs N``, :func:`scan_many`).

* What is scanned (:func:`expand`): each path as :func:`ckptool.scanning.entry.iter_targets` gives it (a file, a
  folder walked recursively, a DCP folder as one); a URL that is a prefix or folder (``s3://bucket/models/``, any
  fsspec filesystem that lists) stands for every object under it (:func:`ckptool._listing.list_objects`). An object
  found under a prefix is a checkpoint by its content, as a local folder's files are: its name ends like a checkpoint
  (:data:`~ckptool.scanning.entry.CHECKPOINT_SUFFIXES`), or its first bytes are a zip, a pickle of protocol 2-5,
  safetensors or a tar (one range request, :func:`starts_like_checkpoint`); other objects are skipped.
* One task per checkpoint (:func:`scan_target`: a module-level function of a picklable :class:`Target`, so a
  process pool or ``dask.distributed``'s ``Client.get_executor()`` runs it as well as a thread pool); results come
  back as tasks finish. :class:`ManyRun` is that loop for any such task (``inspect`` of many checkpoints runs
  :func:`ckptool.ops.inspect.many.inspect_target` on it); :class:`ScanRun` adds the cache. A checkpoint that
  cannot be read, a path that does not exist or a task that failed is a result whose ``error`` says why (verdict
  ``error``), never the end of the run.
* With a :class:`~ckptool.ops.scan.cache.ScanCache`, each checkpoint's version (size and modification time, or
  size and ETag) is looked up first, from the listing where it gives them, else by one ``stat`` or ``HEAD``; a
  checkpoint found there is not read. The cache is read and written by the caller, never by the tasks.

Nothing here schedules work across machines: the executor does.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ckptool import _fork, _listing
from ckptool import _source as source
from ckptool.errors import CkptError
from ckptool.scanning.entry import CHECKPOINT_SUFFIXES, ScanResult, scan_file
from ckptool.scanning.targets import iter_targets, unreadable

if TYPE_CHECKING:  # the cache (sqlite3, hashlib) and the pools (concurrent.futures, logging) are imported only by
    # a run that has them: a run of many small files in this process needs neither (start-up)
    import concurrent.futures as cf

    from ckptool.ops.scan import cache as scan_cache
else:
    # stand-ins imported on first use: the public functions' annotations (``cf.Executor``,
    # ``scan_cache.ScanCache``) resolve for ``typing.get_type_hints`` while a run of many small files imports neither
    from ckptool.torch_ops.annotations import ModuleOnFirstUse

    cf = ModuleOnFirstUse("concurrent.futures")
    scan_cache = ModuleOnFirstUse("ckptool.ops.scan.cache")

__all__ = ["ManyRun", "ScanRun", "Target", "expand", "fork_count", "not_a_checkpoint", "scan_many", "scan_target",
           "starts_like_checkpoint", "target_reads"]

R = TypeVar("R")

#: threads that ask for the versions of objects the listing gave none for (``HEAD`` requests, for the cache)
STAMP_THREADS = 64


@dataclass(frozen=True)
class Target:
    """One checkpoint to scan: ``path`` (file, DCP folder or URL), the ``notes`` its result gets, its ``size`` and
    ``version`` (modification time in ns, or ETag) where known, ``listed`` when it was found under a URL prefix (and
    is skipped unless it is a checkpoint by its content), ``error`` when finding it failed."""

    path: str
    notes: tuple[str, ...] = ()
    size: int | None = None
    version: str | None = None
    listed: bool = False
    error: str | None = None
    #: fsspec's ``info`` of a URL whose version a ``HEAD`` gave (for the cache): its scan asks for it no more
    info: dict[str, Any] | None = field(default=None, compare=False, hash=False)


def expand(paths: Iterable[str | os.PathLike[str]], whole: Callable[[str], bool] | None = None, *,
           configs: bool = True) -> Iterator[Target]:
    """The checkpoints of ``paths`` (see the module docstring), in order; a path that cannot be walked or listed
    (missing, empty, a listing refused) is one :class:`Target` with its ``error``. ``whole(folder)``: whether a
    local folder given in ``paths`` is one checkpoint rather than a folder to walk (``inspect``: a sharded set, a
    DeepSpeed or Megatron folder); ``configs``: folders also give the configs that make a loader run code
    (:func:`ckptool.scanning.entry.iter_targets`; scan reads them, inspect does not)."""
    for given in paths:
        p = os.fspath(given)
        try:
            if source.is_url(p) and (p.endswith("/") or source.kind(p) == "directory"):
                yield from (_listed(u, size, tag) for u, size, tag in _listing.list_objects(p))
                continue
            if whole is not None and not source.is_url(p) and os.path.isdir(p) and whole(p):
                yield Target(p)
                continue
            for path, notes in iter_targets([p], configs=configs):
                why = unreadable(notes)
                if why is not None:
                    yield Target(path, error=why)
                    continue
                yield Target(path, tuple(notes), size=_local_size(path))
        except (CkptError, OSError) as e:
            yield Target(p, error=str(e))


def _local_size(path: str) -> int | None:
    """The size in bytes of the local regular file ``path`` from one ``stat`` (links followed), else None (a URL, a
    folder, a FIFO or device, a path that cannot be stat'ed: its scan says why)."""
    if source.is_url(path):
        return None
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _listed(url: str, size: int | None, tag: str | None) -> Target:
    """The :class:`Target` of an object a listing gave. A key that ends in ``/`` and holds bytes (S3 allows it; s3fs
    takes it for a folder marker and cannot open it) is an object all the same: a result with an error, never skipped
    as a folder."""
    if url.endswith("/") and size:
        return Target(url, size=size, version=tag, error=(
            f"{url}: this object's key ends in '/' and it holds {size} bytes; it cannot be read through fsspec, so it "
            "was not scanned: copy it to a key without the trailing '/' and scan that"))
    return Target(url, size=size, version=tag, listed=True)


def starts_like_checkpoint(url: str) -> bool:
    """Whether the first 512 bytes of ``url`` are a zip, a pickle of protocol 2-5 (a torch legacy stream starts with
    one), a safetensors header or a tar header (``ustar`` at byte 257); True when they cannot be read (the scan then
    says why)."""
    try:
        with source.open_binary(url) as f:
            head = f.read(512)
    except (CkptError, OSError):
        return True
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")) or head[257:262] == b"ustar":
        return True
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return True
    return head[8:9] == b"{"  # safetensors: an 8-byte header length, then the JSON header


def target_reads(t: Target) -> contextlib.AbstractContextManager[None]:
    """The block a task reads ``t`` in: for a URL, :func:`ckptool._source.object_reads` (one ``HEAD``, given by the
    listing or the cache's look-up where they asked already, and no range fetched twice: the look at its first
    bytes and the task share what they fetch); nothing for a local file."""
    return source.object_reads(t.path, t.info) if source.is_url(t.path) else contextlib.nullcontext()


def not_a_checkpoint(t: Target) -> bool:
    """Whether ``t`` is an object found under a prefix that is no checkpoint by its name or first bytes (skipped:
    the module docstring)."""
    return t.listed and not t.path.lower().endswith(CHECKPOINT_SUFFIXES) and not starts_like_checkpoint(t.path)


def scan_target(t: Target, *, key_paths: bool = True) -> ScanResult | None:
    """Scan one :class:`Target` (the task each executor runs): its :class:`ScanResult`, with the bytes it transferred
    for a URL; None for an object under a prefix that is no checkpoint by its content. Never raises for a problem of
    the checkpoint or the network: the result's ``error`` says it. ``key_paths``:
    :func:`~ckptool.scanning.entry.scan_file`'s."""
    if t.error is not None:
        return ScanResult(t.path, error=t.error)
    start = source.thread_bytes_transferred()
    try:
        with target_reads(t):
            if not_a_checkpoint(t):
                return None
            res = scan_file(t.path, key_paths=key_paths)
    except (CkptError, OSError) as e:
        res = ScanResult(t.path, error=str(e))
    res.notes += t.notes
    if source.is_url(t.path):
        res.bytes_read = source.thread_bytes_transferred() - start
    return res


def fork_count(targets: list[Target], jobs: int) -> int:
    """How many processes share ``targets`` when ``jobs`` may run at once (:func:`ckptool._fork.fork_count`); 1 when
    a target is a URL (threads wait on the network for those)."""
    if any(source.is_url(t.path) for t in targets):
        return 1
    return _fork.fork_count(len(targets), jobs)


def _stamped(t: Target) -> Target:
    """``t`` with its size and version (a local file's ``stat``, else a URL's ``HEAD``) where the listing gave none;
    ``error`` set when asking failed. A folder (a DCP checkpoint) gets none: it is not cached."""
    if t.error is not None or (t.size is not None and t.version is not None):
        return t
    try:
        if not source.is_url(t.path):
            if not os.path.isfile(t.path):
                return t
            from ckptool.ops.scan.cache import local_version  # noqa: PLC0415 (a run with a cache only)

            st = os.stat(t.path)
            return replace(t, size=st.st_size, version=local_version(st))
        info = source.remote_info(t.path)
        size, tag = source.version_stamp(info or {})
        return replace(t, size=size, version=None if tag is None else str(tag), info=info)
    except (CkptError, OSError) as e:
        return replace(t, error=str(e))


def _cache_key(t: Target) -> str | None:
    if t.error is not None or t.size is None or t.version is None:
        return None
    from ckptool.ops.scan.cache import ScanCache  # noqa: PLC0415 (a run with a cache only)

    return ScanCache.key(t.path if source.is_url(t.path) else os.path.abspath(t.path), t.size, t.version)


#: words of the errors that come from the network, not from the object (:mod:`ckptool._remote`'s messages)
TRANSIENT = ("network", "changed while it was read", "disappeared while", "run it again", "the scan task failed")


def _cacheable(res: ScanResult | None) -> bool:
    """A result worth keeping: whatever the bytes gave (a damaged file stays damaged), but not a failure to get them
    (a dropped connection, an object replaced mid-read: :data:`TRANSIENT`)."""
    if res is None:
        return True
    errors = [res.error or "", *(p.error or "" for p in res.pickles)]
    return not any(word in e for e in errors for word in TRANSIENT)


class ManyRun(Generic[R]):
    """One run of ``task`` over many checkpoints (``scan``, ``inspect``): :attr:`targets` (every checkpoint of
    ``paths`` found by :func:`expand`, listed before the first task runs) and, iterated, ``(target, result)`` pairs
    as tasks finish (in order without an executor; None: an object under a prefix that is no checkpoint).
    ``task(target)``: a module-level function (a process pool or a cluster pickles it) that reports a problem of its
    checkpoint in its result, never by raising; ``failed(target, why)``: the result of a task that raised (a worker
    died, a bug), a row rather than the end of the run. ``executor``: any :class:`concurrent.futures.Executor`
    (None: one after another in this thread); ``window``: tasks in flight at most (default: 4 per worker of a pool
    that says how many it has, else 64); ``whole``, ``configs``: as :func:`expand`'s."""

    def __init__(self, paths: Iterable[str | os.PathLike[str]], task: Callable[[Target], R | None],
                 failed: Callable[[Target, str], R], *, executor: cf.Executor | None = None,
                 window: int | None = None, whole: Callable[[str], bool] | None = None,
                 configs: bool = True) -> None:
        self.targets = list(expand(paths, whole, configs=configs))
        self.task = task
        self.failed = failed
        self.executor = executor
        workers = getattr(executor, "_max_workers", None)
        self.window = window or (4 * workers if isinstance(workers, int) else 64)
        #: checkpoints answered without running their task (from a cache) so far
        self.hits = 0
        #: without an executor, the processes the tasks are shared among (this one and ``forks - 1`` forked
        #: children, :meth:`_forked`); 1: all in this process
        self.forks = 1

    def _lookups(self) -> Iterator[tuple[Target, str | None, tuple[bool, R | None]]]:
        """Each target with its cache key and what a cache holds for it (``(False, None)``: nothing, run the task)."""
        yield from ((t, None, (False, None)) for t in self.targets)

    def __iter__(self) -> Iterator[tuple[Target, R | None]]:
        if self.executor is None and self.forks > 1:
            yield from self._forked(self.forks)
            return
        pending: dict[cf.Future[R | None], tuple[Target, str | None]] = {}
        for t, key, (found, cached) in self._lookups():
            if found:
                self.hits += 1
                yield t, cached
                continue
            if self.executor is None:
                yield t, self._done(t, key, self.task(t))
                continue
            try:
                fut = self.executor.submit(self.task, t)
            except Exception as e:  # the pool is broken (its workers could not start): a row, not a lost target
                yield t, self._done(t, None, self.failed(t, f"{type(e).__name__}: {e}"))
                continue
            pending[fut] = (t, key)
            while len(pending) >= self.window:
                yield from self._drain(pending)
        while pending:
            yield from self._drain(pending)

    def _forked(self, n: int) -> Iterator[tuple[Target, R | None]]:
        """The tasks shared among this process and ``n - 1`` children forked from it (:func:`ckptool._fork.shared`),
        in order: this process's slice as each finishes, then each child's. Used without a cache (:attr:`forks`: set
        by ``--jobs N`` for many small local files)."""
        for t, res in zip(self.targets, _fork.shared(self.targets, self.task, n)):
            yield t, self._done(t, None, res)

    def _drain(self, pending: dict[cf.Future[R | None], tuple[Target, str | None]]
               ) -> Iterator[tuple[Target, R | None]]:
        """The tasks of ``pending`` that are done once the first of them is (removed from it), with their results."""
        import concurrent.futures as cf  # noqa: PLC0415 (only a run on an executor gets here)

        done, _ = cf.wait(list(pending), return_when=cf.FIRST_COMPLETED)
        for fut in done:
            t, key = pending.pop(fut)
            try:
                res = fut.result()
            except Exception as e:  # the task itself failed (a worker died, a bug): a row, not the end of the run
                res = self.failed(t, f"{type(e).__name__}: {e}")
                key = None
            yield t, self._done(t, key, res)

    def _done(self, t: Target, key: str | None, res: R | None) -> R | None:
        """What a task gave for ``t`` (``key``: its cache key), once it is done."""
        return res


def _scan_failed(t: Target, why: str) -> ScanResult:
    return ScanResult(t.path, error=f"the scan task failed: {why}")


class ScanRun(ManyRun[ScanResult]):
    """One scan of many checkpoints (:class:`ManyRun` of :func:`scan_target`); ``cache``: a
    :class:`~ckptool.ops.scan.cache.ScanCache`, read and written here, never by the tasks; ``key_paths=False``: the
    results without key paths (a report that does not show them; never with a cache, whose rows serve any output)."""

    def __init__(self, paths: Iterable[str | os.PathLike[str]], *, executor: cf.Executor | None = None,
                 cache: scan_cache.ScanCache | None = None, window: int | None = None,
                 key_paths: bool = True) -> None:
        task = scan_target if key_paths or cache is not None else partial(scan_target, key_paths=False)
        super().__init__(paths, task, _scan_failed, executor=executor, window=window)
        self.cache = cache

    def _lookups(self) -> Iterator[tuple[Target, str | None, tuple[bool, ScanResult | None]]]:
        if self.cache is None:
            yield from super()._lookups()
            return
        import concurrent.futures as cf  # noqa: PLC0415 (only a run with a cache gets here)

        need = any(source.is_url(t.path) and t.version is None for t in self.targets)
        with cf.ThreadPoolExecutor(STAMP_THREADS if need else 1) as pool:
            for t in pool.map(_stamped, self.targets):
                key = _cache_key(t)
                found, cached = self.cache.get(key, may_skip=t.listed) if key is not None else (False, None)
                if found and cached is not None and source.is_url(cached.path):
                    cached.bytes_read = 0
                yield t, key, (found, cached)

    def _done(self, t: Target, key: str | None, res: ScanResult | None) -> ScanResult | None:
        if self.cache is not None and key is not None and _cacheable(res):
            self.cache.put(key, res)
        return res


def scan_many(paths: Iterable[str | os.PathLike[str]], *, executor: cf.Executor | None = None,
              cache: scan_cache.ScanCache | str | os.PathLike[str] | None = None) -> Iterator[ScanResult]:
    """Scan every checkpoint of ``paths`` (files, folders walked recursively, URL prefixes listed; see
    :mod:`ckptool.ops.scan.many`) and yield each :class:`ScanResult` as its scan finishes.

    ``executor``: any :class:`concurrent.futures.Executor` runs one task per checkpoint (a ``ThreadPoolExecutor``
    for remote objects, whose scans wait on the network; a ``ProcessPoolExecutor`` for local files, whose scans
    parse pickles in Python; ``dask.distributed.Client(...).get_executor()`` for a cluster); None scans them one
    after another, in order. ``cache``: a :class:`~ckptool.ops.scan.cache.ScanCache` or the path of its SQLite file
    (made when missing): an unchanged checkpoint is answered from it without being read.

    A missing path, an empty folder, a listing refused, an unreadable object or a failed task is a result whose
    ``verdict`` is ``error`` (its ``error`` says why); nothing raises for them.

    Raises:
        OutputError: ``cache`` cannot be opened as a SQLite database.
    """
    if isinstance(cache, (str, os.PathLike)):
        from ckptool.ops.scan.cache import ScanCache  # noqa: PLC0415 (a run with a cache only)

        db: ScanCache | None = ScanCache(cache)
    else:
        db = cache
    try:
        for _t, res in ScanRun(paths, executor=executor, cache=db):
            if res is not None:
                yield res
    finally:
        if db is not None and db is not cache:
            db.close()
