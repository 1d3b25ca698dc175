"""The placeholder pool of scan's unpickles (issue 52, many small files): a placeholder is a class, about 5 µs to
make, and a folder of small pickles names the same few globals in every file, so ``Scanner.load_at`` takes them from
a per-thread :class:`~ckptool.formats.unpickler.PlaceholderPool`. What one pickle did with a global (called it,
built on it, passed a stream to it) must not leak into the next pickle's answers, and an unpickler whose placeholders
were taken since must fail loudly rather than answer with another pickle's state.
"""

from __future__ import annotations

import pickletools
import threading
from pathlib import Path

import pytest

from ckptool.formats.nodes import LOAD_FROM_BYTES
from ckptool.formats.unpickler import PlaceholderPool, load_pickle_at, thread_pool
from ckptool.scanning.entry import scan_file

pytestmark = pytest.mark.torchfree

#: ``builtins.print`` called (GLOBAL, an empty tuple, REDUCE)
CALLS = b"\x80\x02cbuiltins\nprint\nq\x00)R."
#: ``builtins.print`` held as a value in a list (never called)
HOLDS = b"\x80\x02]cbuiltins\nprint\nq\x00a."
#: ``torch.storage._load_from_bytes(b"abc")``
STREAM = b"\x80\x02ctorch.storage\n_load_from_bytes\nq\x00C\x03abcq\x01\x85R."


def test_the_pickles_are_what_they_say() -> None:
    for data in (CALLS, HOLDS, STREAM):  # valid opcodes, to a STOP at the last byte
        *_, (op, _arg, pos) = pickletools.genops(data)
        assert op.name == "STOP" and pos == len(data) - 1


def test_a_reused_placeholder_forgets_the_last_pickle_s_calls() -> None:
    pool = PlaceholderPool()
    _, first, _ = load_pickle_at(CALLS, pool=pool)
    assert first.uncalled_globals() == set()
    _, second, _ = load_pickle_at(HOLDS, pool=pool)
    assert second.uncalled_globals() == {"builtins.print"}  # a new placeholder would say so
    assert pool.take("builtins", "print", None) is pool.take("builtins", "print", None)  # one class per name


def test_a_reused_placeholder_forgets_the_last_pickle_s_streams() -> None:
    pool = PlaceholderPool()
    load_pickle_at(STREAM, pool=pool)  # its stream never taken
    _, up, _ = load_pickle_at(HOLDS, pool=pool)
    g = pool.take(*LOAD_FROM_BYTES, up)
    assert not g.streams and not g.__dict__.get("called")


def test_an_unpickler_whose_placeholder_was_taken_since_raises() -> None:
    pool = PlaceholderPool()
    _, first, _ = load_pickle_at(CALLS, pool=pool)
    load_pickle_at(HOLDS, pool=pool)
    with pytest.raises(RuntimeError, match=r"builtins\.print was reused"):
        first.uncalled_globals()
    with pytest.raises(RuntimeError, match="reused"):
        first.streams()


def test_the_pool_holds_at_most_its_limit_of_names() -> None:
    pool = PlaceholderPool(limit=1)
    a = pool.take("m", "a", None)
    assert pool.take("m", "a", None) is a
    assert pool.take("m", "b", None) is not pool.take("m", "b", None)  # past the limit: a new one each time


def test_each_thread_has_its_own_pool() -> None:
    got: list[PlaceholderPool] = []
    t = threading.Thread(target=lambda: got.append(thread_pool()))
    t.start()
    t.join()
    assert got[0] is not thread_pool() and thread_pool() is thread_pool()


def test_scan_of_two_files_does_not_carry_a_call_from_one_to_the_other(tmp_path: Path) -> None:
    """``typing.Any`` is data when held as a value (OmegaConf metadata) and needs trust when called: a scan of a file
    that calls it, then of one that holds it, rates each as a scan of it alone does."""
    calls = tmp_path / "calls.pkl"
    holds = tmp_path / "holds.pkl"
    calls.write_bytes(b"\x80\x02ctyping\nAny\nq\x00)R.")
    holds.write_bytes(b"\x80\x02]ctyping\nAny\nq\x00a.")
    alone = scan_file(holds).to_dict()
    assert alone["verdict"] == "needs-trust"
    assert scan_file(calls).to_dict()["verdict"] == "dangerous"
    assert scan_file(holds).to_dict() == alone


def test_the_pool_keeps_no_unpickler_alive() -> None:
    """An unpickler holds its memo (every object the pickle built): the pool remembers which one took a placeholder
    by its id, so the graph goes with the last reference to it (a 50,000-tensor scan's peak memory)."""
    import gc
    import weakref

    pool = PlaceholderPool()
    _, up, _ = load_pickle_at(CALLS, pool=pool)
    gone = weakref.ref(up)
    del up
    gc.collect()
    assert gone() is None
