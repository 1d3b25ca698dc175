"""Signals around an output's commit: holding SIGINT / SIGTERM while a temporary file is made
(:func:`hold_signals`) or while an output is renamed into place (:func:`signals_blocked`), and the record of the
outputs this process has put in place (:func:`mark_committed`, :func:`was_committed`), from which the CLI's
``Interrupted ...`` line says whether the output is complete. Used by :mod:`ckptool._fileio` and convert's set and
DCP writers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from ckptool import _source as source

#: the signals that end a command with clean-up (SIGINT: KeyboardInterrupt; SIGTERM: the CLI raises Terminated)
_CLEANUP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def hold_signals() -> Callable[[], None]:
    """Hold SIGINT and SIGTERM until the returned function is called (once): between creating a temporary file and
    arming its clean-up, an interrupt would leave it behind. Their Python handlers are swapped for ones that only
    note the signal; releasing puts them back and runs the handler of the first signal noted (``Ctrl-C``'s
    KeyboardInterrupt, the CLI's Terminated; the default action for a default handler). A no-op off the main
    thread, where Python handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    pending: list[tuple[int, FrameType | None]] = []
    old: dict[int, Any] = {}
    for sig in _CLEANUP_SIGNALS:
        try:
            old[sig] = signal.signal(sig, lambda signum, frame: pending.append((signum, frame)))
        except (ValueError, OSError):  # not settable here
            continue
    done: list[bool] = []

    def release() -> None:
        if done:
            return
        done.append(True)
        for sig, handler in old.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if pending:
            signum, frame = pending[0]
            handler = old.get(signum)
            if callable(handler):
                handler(signum, frame)
            elif handler in (None, signal.SIG_DFL):
                signal.raise_signal(signum)

    return release


#: the outputs this process has put in place (:func:`mark_committed`), for the CLI's ``Interrupted ...`` line
_COMMITTED: set[str] = set()


def _output_key(path: str) -> str:
    return path if source.is_url(path) else os.path.abspath(path)


def mark_committed(path: str) -> None:
    """Record that the output ``path`` (as the command names it) is complete and in place. Call it inside
    :func:`signals_blocked`, together with the rename that commits it, so that an interrupt comes before both or
    after both."""
    _COMMITTED.add(_output_key(path))


def unmark_committed(path: str) -> None:
    """Forget :func:`mark_committed` of ``path`` (it was removed again)."""
    _COMMITTED.discard(_output_key(path))


def was_committed(path: str) -> bool:
    """Whether the output ``path`` was put in place by this process since :func:`forget_commits`: an interrupt
    after that point leaves it complete (the CLI then says so)."""
    return _output_key(path) in _COMMITTED


def forget_commits() -> None:
    """Start a new command: no output of it is in place yet."""
    _COMMITTED.clear()


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Block SIGINT and SIGTERM for the calling thread (``signal.pthread_sigmask``) in the block: one that arrives
    meanwhile is delivered when it ends, so the block (a rename and :func:`mark_committed`) is done whole or, when
    the signal came before it, not at all. Nests (each end restores the mask it found); a no-op where
    ``pthread_sigmask`` does not exist."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _CLEANUP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
