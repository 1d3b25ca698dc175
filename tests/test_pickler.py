"""The restricted unpickler and the graph pickler: reading imports nothing, writing back gives the same objects."""

from __future__ import annotations

import collections
import pickle
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptool.errors import CorruptCheckpointError
from ckptool.formats.nodes import GlobalMeta, ObjectNode, ReduceNode
from ckptool.formats.pickler import dumps
from ckptool.formats.unpickler import load_structure

pytestmark = pytest.mark.torchfree  # needs no torch: .ci/run also runs it where torch is not installed

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False), st.text(max_size=20), st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.tuples(children, children),
        st.lists(children, max_size=6).map(tuple),
        st.dictionaries(st.text(max_size=8), children, max_size=5),
        st.dictionaries(st.integers(-5, 5), children, max_size=3).map(collections.OrderedDict),
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(values, st.integers(min_value=2, max_value=5))
def test_round_trip_equals_original(obj: object, protocol: int) -> None:
    data = pickle.dumps(obj, protocol=protocol)
    root, _ = load_structure(data)
    assert pickle.loads(dumps(root, protocol=protocol)) == obj


def test_shared_and_recursive_structure_survives() -> None:
    shared = [1, 2]
    rec: list[object] = [0]
    rec.append(rec)
    obj = {"a": shared, "b": shared, "t": (shared, shared), "rec": rec}
    root, _ = load_structure(pickle.dumps(obj, protocol=2))
    back = pickle.loads(dumps(root))
    assert back["a"] is back["b"] is back["t"][0] is back["t"][1]
    assert back["rec"][1] is back["rec"]


class Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("echo pwned > /dev/null",))


def test_reading_imports_and_runs_nothing() -> None:
    data = pickle.dumps({"x": Evil(), "y": collections.Counter("ab")}, protocol=2)
    data = data.replace(b"collections", b"collectionz")  # a module that does not exist
    before = set(sys.modules)
    calls: list[str] = []

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event in ("os.system", "subprocess.Popen", "import", "exec"):
            calls.append(event)

    sys.addaudithook(hook)
    root, up = load_structure(data)
    assert calls == []
    assert set(sys.modules) == before
    x = root["x"]
    assert isinstance(x, ReduceNode) and x.global_name in ("posix.system", "os.system", "nt.system")
    assert ("collectionz", "Counter") in up.globals_seen
    # and written back, the same globals are named (nothing resolved or dropped)
    back, _ = load_structure(dumps(root))
    assert back["x"].global_name == x.global_name


def test_newobj_build_and_setitems_are_recorded() -> None:
    class Obj:
        def __init__(self) -> None:
            self.a = 1

    Obj.__module__, Obj.__qualname__ = __name__, "Obj"
    globals()["Obj"] = Obj
    data = pickle.dumps(Obj(), protocol=2)
    root, _ = load_structure(data)
    assert isinstance(root, ObjectNode) and isinstance(type(root), GlobalMeta)
    assert root.state == {"a": 1} and root.order == ["build"]
    back = pickle.loads(dumps(root))
    assert isinstance(back, Obj) and back.a == 1


@pytest.mark.parametrize("data", [b"\x80\x02}q\x00(X\x01\x00\x00\x00a", b"\x80\x02\xff", b"", b"\x80\x02h\x05."])
def test_corrupt_pickles_raise_clear_error(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="corrupted or truncated"):
        load_structure(data)
