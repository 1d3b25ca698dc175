"""Pausing Python's cyclic garbage collector while a checkpoint graph is built and walked.

Reading a 50,000-tensor pickle creates a few hundred thousand container objects; each generation-0 collection
then walks the surviving ones, which doubled the time of ``inspect`` on such files. Nothing ckptool builds
needs the cycle collector while it runs (reference counting frees the graph afterwards), so the public entry
points pause it and restore the caller's setting on the way out.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def gc_paused(fn: F) -> F:
    """Decorator: run ``fn`` with ``gc`` disabled, re-enabling it afterwards only if it was enabled before."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return wrapper  # type: ignore[return-value]


def skip_final_collection() -> None:
    """Move every object still alive to the collector's permanent generation (``gc.freeze``), for a process that
    is about to exit: the interpreter's shutdown otherwise runs full collections that walk them all (the zip
    directory of a 50,000-member checkpoint, kept for reuse, and the modules), to free nothing that outlives the
    process. Measured on ``ckptool inspect --json`` of a 50,000-tensor file, 25 interleaved runs: median 0.641 s
    -> 0.573 s (mean -39 ms). ``atexit`` handlers and context managers still run; only cyclic garbage made before
    the call is left to the operating system."""
    gc.freeze()


#: the generation-0 threshold of :func:`rare_collections`: allocations of container objects between collections
RARE_THRESHOLD = 100_000


@contextlib.contextmanager
def rare_collections() -> Iterator[None]:
    """Within the block, generation-0 collections run every :data:`RARE_THRESHOLD` allocations (``gc.set_threshold``;
    700 by default), the caller's thresholds restored after it. For a run over many files (``scan FOLDER``) whose
    graphs reference counting frees: each collection walks the results kept so far, about 7% of the scan of 500
    small pickles at the default. Unlike :func:`gc_paused`, collections still run, so cyclic garbage stays bounded
    however many files the run reads."""
    old = gc.get_threshold()
    gc.set_threshold(max(RARE_THRESHOLD, old[0]), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
