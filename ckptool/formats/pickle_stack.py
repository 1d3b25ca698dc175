"""A C stack sized for a pickle's tuple nesting: :func:`tuple_levels` bounds how deeply tuples can nest in a pickle,
:func:`call_with_stack` runs the unpickler in a helper thread whose stack holds that many levels (hashing a tuple
recurses in C without a depth check: a dict key made of a million nested tuples would overflow the C stack, a
segfault). Re-exported by :mod:`ckptool.formats.pickle_check`, whose opcode walk runs before the unpickler.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from ckptool.errors import UnsupportedError

__all__ = ["INLINE_TUPLE_LEVELS", "MAX_UNPICKLE_STACK", "call_with_stack", "tuple_levels"]

_TUPLE_OPS = (b"t", b"\x85", b"\x86", b"\x87")  # TUPLE TUPLE1 TUPLE2 TUPLE3
#: tuple nesting up to this bound is unpickled in the caller's thread (about 64 bytes of C stack per level)
INLINE_TUPLE_LEVELS = 2000
_STACK_PER_LEVEL = 160
_STACK_BASE = 4 << 20
#: the largest helper-thread stack ckptool asks for (virtual memory; only what deep nesting uses is touched)
MAX_UNPICKLE_STACK = 2 << 30
_stack_lock = threading.Lock()
_T = TypeVar("_T")


def tuple_levels(data: bytes | bytearray) -> int:
    """An upper bound on how deeply tuples can nest in pickle ``data``: its number of tuple-building opcode bytes;
    its length when that is :data:`INLINE_TUPLE_LEVELS` or less (no count: a bound that says the same to
    :func:`call_with_stack`, for the many small pickles of a folder's scan)."""
    if len(data) <= INLINE_TUPLE_LEVELS:
        return len(data)
    t, t1, t2, t3 = _TUPLE_OPS
    return data.count(t) + data.count(t1) + data.count(t2) + data.count(t3)


def call_with_stack(fn: Callable[[], _T], levels: int, what: str = "pickle") -> _T:
    """``fn()``, run in a helper thread with a C stack large enough for ``levels`` of recursion in C (tuple hashing)
    when ``levels`` exceeds :data:`INLINE_TUPLE_LEVELS`, else in the calling thread. Exceptions propagate.

    Raises:
        UnsupportedError: the stack it would need exceeds :data:`MAX_UNPICKLE_STACK`, or no thread can be started.
    """
    if levels <= INLINE_TUPLE_LEVELS:
        return fn()
    need = _STACK_BASE + levels * _STACK_PER_LEVEL
    if need > MAX_UNPICKLE_STACK:
        raise UnsupportedError(
            f"{what} has {levels} tuple-building opcodes: reading it safely would need a "
            f"{need >> 20} MiB stack, over ckptool's {MAX_UNPICKLE_STACK >> 20} MiB limit")
    need = (need + (1 << 20) - 1) & ~((1 << 20) - 1)
    result: list[_T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # handed back to the caller's thread
            error.append(e)

    with _stack_lock:
        old = threading.stack_size()
        try:
            threading.stack_size(need)
            t = threading.Thread(target=run, name="ckptool-unpickle", daemon=True)
            t.start()
        except (RuntimeError, ValueError, MemoryError) as e:
            raise UnsupportedError(f"{what}: cannot start a reader thread with a {need >> 20} MiB stack ({e})") from e
        finally:
            threading.stack_size(old)
    t.join()
    if error:
        raise error[0]
    return result[0]
