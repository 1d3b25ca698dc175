"""Shards of a set written at once: the executor that :func:`ckptool.ops.rewrite.set_writer.write_set` hands one
shard per task (``--jobs N`` of ``remap``, the prefix commands, ``rename`` and ``filter`` of a sharded set, and of
``convert`` to a sharded set), and that :func:`ckptool.ops.rewrite.dcp.rewrite_dcp` hands one ``.distcp`` data file
per task (the same commands on a ``torch.distributed.checkpoint`` folder); :func:`shard_executor` in the library.

Each task writes one shard (or data file) into its scratch file or staging folder; the caller waits for all of them
and only then, in its own thread, renames the shards into place and writes the index last (a DCP folder: writes
``.metadata`` and renames the staging folder into place), the commit, as a serial run does. A task that fails, or
an interrupt while they run, cancels the tasks not started, waits for the running ones to stop, and the scratch
files are removed: nothing partial is ever committed.

The tasks are closures over the shard's parsed structure and the run's counters, so they run in this process: a
:class:`concurrent.futures.ThreadPoolExecutor` (the work of a shard is reading and writing bytes and CRC-32 /
SHA-256 sums over them, during which Python releases the GIL, so threads overlap; the pickle of a shard is small).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

__all__ = ["current_executor", "locked", "run_all", "run_each", "shard_executor", "shard_jobs"]

T = TypeVar("T")
_EXECUTOR: contextvars.ContextVar[cf.Executor | None] = contextvars.ContextVar("ckptool_shard_executor",
                                                                              default=None)


@contextlib.contextmanager
def shard_executor(executor: cf.Executor | None) -> Iterator[None]:
    """Within the block, sets are written one shard per task of ``executor`` (None: one after another). The
    executor must run its tasks in this process (a ``ThreadPoolExecutor``); it is not shut down here."""
    token = _EXECUTOR.set(executor)
    try:
        yield
    finally:
        _EXECUTOR.reset(token)


@contextlib.contextmanager
def shard_jobs(jobs: int) -> Iterator[None]:
    """:func:`shard_executor` with a pool of ``jobs`` threads made for the block (none for ``jobs`` 1)."""
    if jobs <= 1:
        yield
        return
    with cf.ThreadPoolExecutor(jobs, thread_name_prefix="ckptool-shard") as pool, shard_executor(pool):
        yield


def current_executor() -> cf.Executor | None:
    """The executor of the enclosing :func:`shard_executor` block, or None."""
    return _EXECUTOR.get()


def locked(fn: Callable[..., T] | None) -> Callable[..., T] | None:
    """``fn`` made safe to call from several tasks at once (one call at a time); None stays None."""
    if fn is None:
        return None
    lock = threading.Lock()

    def call(*args: Any) -> T:
        with lock:
            return fn(*args)

    return call


def run_all(executor: cf.Executor, tasks: Sequence[Callable[[], None]]) -> None:
    """Run every task on ``executor`` and return when all are done. The first failure (or an interrupt while
    waiting) cancels the tasks not started and waits for the running ones before it is raised, so that nothing is
    still writing when the caller cleans up. Each task runs in a copy of the caller's context
    (:mod:`contextvars`: the enclosing :func:`shard_executor`, a Megatron ``--tp-dim`` rule), as it would serially."""
    futures = [executor.submit(contextvars.copy_context().run, t) for t in tasks]
    try:
        for fut in cf.as_completed(futures):
            fut.result()
    except BaseException:
        for fut in futures:
            fut.cancel()
        cf.wait(futures)
        raise


def run_each(fn: Callable[[T], None], items: Sequence[T], executor: cf.Executor | None = None) -> None:
    """``fn(item)`` for each of ``items``: one task per item on ``executor`` (:func:`run_all`: every task done, or
    all stopped, when this returns or raises), or one after another, in order, in this thread when ``executor`` is
    None or there is one item."""
    if executor is None or len(items) < 2:
        for item in items:
            fn(item)
        return
    run_all(executor, [functools.partial(fn, item) for item in items])
