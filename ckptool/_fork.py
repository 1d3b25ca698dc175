"""Many small tasks shared with children forked from this process (``os.fork``): ``scan`` of a folder of many
small files, ``--jobs N`` of them (:mod:`ckptool.ops.scan.many`).

A forked child starts in about a millisecond with everything this process imported, where a pool's worker imports
ckptool again (about 0.3 s). :func:`shared` cuts the items into contiguous slices, one a process: this process runs
the first and yields each result as it comes, then each child's, sent back whole as one pickle over a pipe (our
own results, from our own process; never a checkpoint's data). A child that cannot be started or fails leaves its
slice to this process: no item is lost. This module imports only the standard library, so that a command that
forks pays nothing more at start-up.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

__all__ = ["CHILD_OVERHEAD", "FORK_FILES_PER_JOB", "fork_count", "shared", "slice_cuts"]

T = TypeVar("T")
R = TypeVar("R")

#: small local files are shared with forked children only when each process gets this many or more: a child costs
#: about a millisecond to fork, and its results are sent back as one pickle (a small pickle's scan: about 0.1 ms,
#: sending what its report prints back: a few microseconds)
FORK_FILES_PER_JOB = 64

#: the share of a forked child's slice that this process takes on top of its own (:func:`slice_cuts`): a child
#: starts a fork later and sends its results back as a pickle, which this process loads; on 500 small pickles (2
#: CPUs) 0.05 to 0.15 gave the same wall time within noise, 0 a slower median (the parent waits for the child)
CHILD_OVERHEAD = 0.05


def fork_count(count: int, jobs: int) -> int:
    """How many processes (this one and forked children) share ``count`` items when ``jobs`` may run at once: one
    for each :data:`FORK_FILES_PER_JOB` items, at most ``jobs`` and ``os.cpu_count()``; 1 (this process alone)
    where ``os.fork`` is missing."""
    if jobs <= 1 or not hasattr(os, "fork"):
        return 1
    return max(1, min(jobs, count // FORK_FILES_PER_JOB, os.cpu_count() or 1))


def slice_cuts(count: int, n: int) -> list[int]:
    """Where :func:`shared` cuts ``count`` items into ``n`` contiguous slices (``n + 1`` offsets from 0 to
    ``count``): this process's first, :data:`CHILD_OVERHEAD` of a slice larger than each child's, so that the
    children's results arrive as this process finishes its own."""
    weight = n + CHILD_OVERHEAD
    return [0, *(min(count, round(count * (1 + CHILD_OVERHEAD + i - 1) / weight)) for i in range(1, n)), count]


def shared(items: Sequence[T], task: Callable[[T], R], n: int) -> Iterator[R]:
    """``task(item)`` of each of ``items``, in order, shared among this process and ``n - 1`` children forked from
    it (see the module docstring). ``task`` reports a problem of its item in its result, never by raising (a child
    whose task raised sends nothing: its slice is run again here, where it raises). In one process when this one runs
    other threads (a fork copies only the calling thread: a lock another one holds stays held). Children left when
    the caller stops early are killed and reaped."""
    threading = sys.modules.get("threading")
    if threading is not None and threading.active_count() > 1:
        n = 1
    cut = slice_cuts(len(items), n)
    children: list[tuple[int, int, int, int]] = []  # (pid, read end, first, end)
    try:
        for i in range(1, n):
            child = _fork_child(task, items[cut[i]:cut[i + 1]])
            if child is None:
                break
            children.append((*child, cut[i], cut[i + 1]))
        # this process's slice, each child's, then the slices of children that could not be started
        tail = children[-1][3] if children else len(items)
        for item in items[:children[0][2] if children else tail]:
            yield task(item)
        while children:
            pid, r, first, end = children.pop(0)
            results = _child_results(pid, r, end - first)  # closes r, reaps pid (also when interrupted)
            if results is None:
                yield from map(task, items[first:end])
            else:
                yield from results
        yield from map(task, items[tail:])
    finally:
        for pid, r, _first, _end in children:  # the caller stopped early: end the children left
            _end_child(pid, r)


def _fork_child(task: Callable[[T], R], items: Sequence[T]) -> tuple[int, int] | None:
    """A child forked to run ``task`` over ``items`` and send the results down a pipe: ``(pid, read end)``, or None
    when it could not be started (no pipe, no fork)."""
    try:
        r, w = os.pipe()
    except OSError:
        return None
    gc.freeze()  # the child's collections skip what it shares with this process (fewer pages copied)
    try:
        pid = os.fork()
    except OSError:
        gc.unfreeze()
        os.close(r)
        os.close(w)
        return None
    if pid == 0:  # the child: its slice, its results down the pipe, and out (never back to the caller)
        code = 1
        try:
            os.close(r)
            data = _slice_results(task, items)
            with os.fdopen(w, "wb") as out:
                out.write(data)
            code = 0
        finally:
            os._exit(code)
    gc.unfreeze()
    os.close(w)
    return pid, r


def _slice_results(task: Callable[[Any], Any], items: Sequence[Any]) -> bytes:
    """A forked child's work (:func:`shared`): ``task`` of each item, pickled as one list."""
    return pickle.dumps([task(t) for t in items], protocol=pickle.HIGHEST_PROTOCOL)


def _child_results(pid: int, r: int, count: int) -> list[Any] | None:
    """The ``count`` results the forked child ``pid`` sent down the pipe ``r`` (closed here, the child reaped), or
    None when it failed (then its slice is run again in this process)."""
    chunks = []
    try:
        while chunk := os.read(r, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(r)
        _pid, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    if status != 0 or not data:
        return None
    try:
        results = pickle.loads(data)  # our own child's results (ScanResult, inspect rows): no checkpoint's data
    except Exception:  # a child cut short: its slice is run here
        return None
    return results if isinstance(results, list) and len(results) == count else None


def _end_child(pid: int, r: int) -> None:
    """Stop the forked child ``pid`` whose results are no longer wanted, close its pipe ``r`` and reap it."""
    import signal  # noqa: PLC0415

    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.close(r)
    with contextlib.suppress(OSError):
        os.waitpid(pid, 0)
