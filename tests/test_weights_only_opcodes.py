"""The weights_only opcode list has one home (:data:`ckptool.formats.pickle_check.WEIGHTS_ONLY_OPCODES`): the
matcher of :func:`~ckptool.formats.pickle_check.weights_only_refusal` is built from the same table, and the list is
torch's own (the opcodes ``torch._weights_only_unpickler.Unpickler.load`` handles)."""

from __future__ import annotations

import inspect
import pickle
import re

import pytest

from ckptool.formats.pickle_check import WEIGHTS_ONLY_OPCODES, check_pickle, weights_only_refusal

#: every one-byte opcode of the ``pickle`` module, by byte
OPCODES = {v[0]: k for k, v in vars(pickle).items()
           if k.isupper() and isinstance(v, bytes) and len(v) == 1 and not k.startswith(("HIGHEST", "DEFAULT"))}
#: a well-formed argument for the opcodes whose argument is not a run of bytes
ARGUMENTS = {ord("c"): b"mod\nname\n", ord("X"): b"\x00\x00\x00\x00", ord("U"): b"\x00", 0x8A: b"\x00"}


@pytest.mark.parametrize("op", sorted(OPCODES), ids=[OPCODES[o] for o in sorted(OPCODES)])
def test_refusal_follows_the_list(op: int) -> None:
    """An opcode of the list is read past (a refusal, if any, is for a later byte); any other is refused where it
    stands, by name."""
    data = b"\x80\x02" + bytes([op]) + ARGUMENTS.get(op, b"\x00" * 8) + b"."
    refusal = weights_only_refusal(data)
    if op in WEIGHTS_ONLY_OPCODES:
        assert refusal is None or not refusal.endswith(" at byte 2"), refusal
    else:
        assert refusal == f"opcode {OPCODES[op]} (0x{op:02x}) at byte 2"


def test_list_is_torchs() -> None:
    """The list names exactly the opcodes torch's weights_only unpickler handles."""
    unpickler = pytest.importorskip("torch._weights_only_unpickler")
    src = inspect.getsource(unpickler.Unpickler.load)
    handled = set(re.findall(r"\b([A-Z][A-Z_0-9]*)\[0\]", src)) & set(OPCODES.values())
    assert handled == {OPCODES[o] for o in WEIGHTS_ONLY_OPCODES}


def _walked(data: bytes) -> str | None:
    found: list[str | None] = ["not set"]
    check_pickle(data, weights_only=found)
    return found[0]


@pytest.mark.parametrize("op", sorted(OPCODES), ids=[OPCODES[o] for o in sorted(OPCODES)])
def test_check_pickle_finds_the_same_refusal_in_its_walk(op: int) -> None:
    """check_pickle's weights_only answer (one walk for both) is weights_only_refusal's, opcode by opcode."""
    data = b"\x80\x02" + bytes([op]) + ARGUMENTS.get(op, b"\x00" * 8) + b"."
    try:
        got = _walked(data)
    except Exception:  # an opcode whose argument above is no valid one: check_pickle refuses the pickle itself
        return
    assert got == weights_only_refusal(data)


@pytest.mark.parametrize("protocol", range(6))
@pytest.mark.parametrize("size", [10, 100_000])
def test_check_pickle_finds_the_same_refusal_in_big_pickles(protocol: int, size: int) -> None:
    """Pickles of every protocol, short and long strings (past the expression's 127 bytes), many memo entries
    (LONG_BINPUT) and frames: the walk with the weights_only expression gives weights_only_refusal's answer."""
    from collections import OrderedDict

    obj = OrderedDict((f"k{i}" + "x" * (i % 300), [i, float(i), b"b" * (i % 3), (i, i)]) for i in range(size // 10))
    obj["set"] = {1, 2}  # type: ignore[assignment]
    data = pickle.dumps(obj, protocol=protocol)
    assert _walked(data) == weights_only_refusal(data)
    plain = pickle.dumps([["a" * 200, 1, 2.5, None, True]] * (size // 10 or 1), protocol=protocol)
    assert _walked(plain) == weights_only_refusal(plain)
    late = pickle.dumps([*(f"s{i}" for i in range(size)), b"bytes"], protocol=max(protocol, 3))  # SHORT_BINBYTES
    assert _walked(late) == weights_only_refusal(late) is not None
