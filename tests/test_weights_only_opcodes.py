"""The weights_only opcode list has one home (:data:`ckptool.formats.pickle_check.WEIGHTS_ONLY_OPCODES`): the
matcher of :func:`~ckptool.formats.pickle_check.weights_only_refusal` is built from the same table, and the list is
torch's own (the opcodes ``torch._weights_only_unpickler.Unpickler.load`` handles)."""

from __future__ import annotations

import inspect
import pickle
import re

import pytest

from ckptool.formats.pickle_check import WEIGHTS_ONLY_OPCODES, weights_only_refusal

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
