"""Pausing Python's cyclic garbage collector while a checkpoint graph is built and walked.

Reading a 50,000-tensor pickle creates a few hundred thousand container objects; each generation-0 collection
then walks the surviving ones, which doubled the time of ``inspect`` on such files. Nothing ckptool builds
needs the cycle collector while it runs (reference counting frees the graph afterwards), so the public entry
points pause it and restore the caller's setting on the way out.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
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
