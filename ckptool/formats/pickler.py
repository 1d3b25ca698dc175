"""Writes a node graph from :mod:`ckptool.formats.unpickler` back to pickle bytes, importing nothing.

The standard ``pickle.Pickler`` cannot be used: it verifies every global by importing its module, and the
classes a checkpoint names (``__main__.Net``, torch internals) are placeholders here. This writer emits the
opcodes itself (protocol 2, the one ``torch.save`` uses, plus the protocol 3-5 opcodes for values that only
those protocols can express), so that ``torch.load`` of the result builds the same objects the source pickle
built:

* placeholders become GLOBAL; :class:`ReduceNode` becomes ``func args REDUCE``; :class:`ObjectNode` becomes
  ``cls args NEWOBJ``; the recorded APPENDS / SETITEMS / ADDITEMS / BUILD follow in their original order;
* :class:`StorageRef` becomes its persistent-id tuple and BINPERSID (with the possibly rewritten location tag);
* every object is memoized by identity (so shared and recursive structure survives) and strings by value.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from ckptool.formats.nodes import GlobalMeta, ObjectNode, PersistentRef, ReduceNode, StorageRef

_pack_i = struct.Struct("<i").pack
_pack_u32 = struct.Struct("<I").pack
_pack_u64 = struct.Struct("<Q").pack
_pack_d = struct.Struct(">d").pack

PROTO, STOP, MARK, POP, POP_MARK = b"\x80", b".", b"(", b"0", b"1"
NONE, NEWTRUE, NEWFALSE = b"N", b"\x88", b"\x89"
BININT1, BININT2, BININT, LONG1, LONG4, BINFLOAT = b"K", b"M", b"J", b"\x8a", b"\x8b", b"G"
BINUNICODE, BINUNICODE8 = b"X", b"\x8d"
SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8 = b"C", b"B", b"\x8e", b"\x96"
EMPTY_TUPLE, TUPLE, TUPLE1, TUPLE2, TUPLE3 = b")", b"t", b"\x85", b"\x86", b"\x87"
EMPTY_LIST, APPENDS, EMPTY_DICT, SETITEMS = b"]", b"e", b"}", b"u"
EMPTY_SET, ADDITEMS, FROZENSET = b"\x8f", b"\x90", b"\x91"
GLOBAL, REDUCE, NEWOBJ, NEWOBJ_EX, BUILD, BINPERSID = b"c", b"R", b"\x81", b"\x92", b"b", b"Q"
BINPUT, LONG_BINPUT, BINGET, LONG_BINGET = b"q", b"r", b"h", b"j"

_BATCH = 1000


class PicklerError(Exception):
    """The graph holds a value this writer cannot express (a global name with a newline, an unknown type)."""


_ATOMS = (int, float, bool, str, type(None))


def _atoms_only(t: tuple[Any, ...]) -> bool:
    """A tuple of ints / floats / strings (a shape or stride): its identity cannot matter to the loader, so it is
    written without a memo entry (smaller pickle, faster write)."""
    return all(type(x) in _ATOMS for x in t)


class GraphPickler:
    """Serialise one graph. ``dumps(root)`` returns the pickle bytes (PROTO ... STOP).

    ``storage_hook(ref) -> tuple`` may return a replacement persistent id for a :class:`StorageRef` (used by
    remap to rewrite location tags without mutating the graph); the default writes ``ref.pid()``.
    """

    def __init__(self, protocol: int = 2, storage_hook: Any = None) -> None:
        self.protocol = max(2, min(protocol, 5))
        self.storage_hook = storage_hook
        # one growing buffer, not a list of per-opcode bytes objects (about 50 bytes each: a 1,000,000-tensor
        # state_dict writes some 30 million of them)
        self.out = bytearray()
        self.memo: dict[int, int] = {}
        self.str_memo: dict[str, int] = {}
        self.next_memo = 0
        self.keep: list[Any] = []  # objects memoized by id stay alive until the end
        # the writer of each type met so far: the exact types of _WRITERS, then node classes as they come
        self.writers: dict[type, _Writer] = dict(_WRITERS)

    # ------------------------------------------------------------------ helpers
    def _put(self) -> int:
        idx = self.next_memo
        self.next_memo = idx + 1
        self.out.extend(BINPUT + bytes((idx,)) if idx < 256 else LONG_BINPUT + _pack_u32(idx))
        return idx

    def _get(self, idx: int) -> None:
        self.out.extend(BINGET + bytes((idx,)) if idx < 256 else LONG_BINGET + _pack_u32(idx))

    def _memoize(self, obj: Any) -> None:
        self.memo[id(obj)] = self._put()
        self.keep.append(obj)

    def dumps(self, root: Any) -> bytes:
        self.out.extend(PROTO + bytes((self.protocol,)))
        self.save(root)
        self.out.extend(STOP)
        return bytes(self.out)

    # ------------------------------------------------------------------ dispatch
    def save(self, obj: Any) -> None:
        """Write ``obj``: an atom (int, str, float, bool, None) by value, an object seen before by its memo entry,
        any other by the writer of its type (:data:`_WRITERS`; node types resolved once per class).

        Raises:
            PicklerError: a value of a type this writer cannot express.
        """
        t = type(obj)
        atom = _ATOM_WRITERS.get(t)
        if atom is not None:
            atom(self, obj)
            return
        idx = self.memo.get(id(obj))
        if idx is not None:
            self._get(idx)
            return
        writer = self.writers.get(t)
        if writer is None:
            writer = self.writers[t] = _writer_for(t)
        writer(self, obj)

    # ------------------------------------------------------------------ atoms (never memoized by identity)
    def _save_str(self, obj: str) -> None:
        idx = self.str_memo.get(obj)
        if idx is not None:
            self._get(idx)
            return
        b = obj.encode("utf-8", "surrogatepass")
        n = len(b)
        self.out.extend((BINUNICODE + _pack_u32(n) if n < 0xFFFFFFFF else BINUNICODE8 + _pack_u64(n)) + b)
        self.str_memo[obj] = self._put()

    def _save_int(self, obj: int) -> None:
        w = self.out.extend
        if 0 <= obj < 256:
            w(BININT1 + bytes((obj,)))
        elif 0 <= obj < 65536:
            w(BININT2 + obj.to_bytes(2, "little"))
        elif -0x80000000 <= obj <= 0x7FFFFFFF:
            w(BININT + _pack_i(obj))
        else:
            n = (obj.bit_length() >> 3) + 1
            enc = obj.to_bytes(n, "little", signed=True)
            if obj < 0 and n > 1 and enc[-1] == 0xFF and (enc[-2] & 0x80):
                enc = enc[:-1]
            w((LONG1 + bytes((len(enc),)) if len(enc) < 256 else LONG4 + _pack_i(len(enc))) + enc)

    def _save_none(self, obj: None) -> None:
        self.out.extend(NONE)

    def _save_bool(self, obj: bool) -> None:
        self.out.extend(NEWTRUE if obj else NEWFALSE)

    def _save_float(self, obj: float) -> None:
        self.out.extend(BINFLOAT + _pack_d(obj))

    # ------------------------------------------------------------------ objects (memoized by identity)
    def _save_tuple_value(self, obj: tuple[Any, ...]) -> None:
        self._save_tuple(obj, memoize=not _atoms_only(obj))

    def _save_storage(self, obj: StorageRef) -> None:
        pid = self.storage_hook(obj) if self.storage_hook else obj.pid()
        self._save_tuple(pid, memoize=False)
        self.out.extend(BINPERSID)

    def _save_global(self, obj: GlobalMeta) -> None:
        mod, name = obj.module, obj.name
        if "\n" in mod or "\n" in name:
            raise PicklerError(f"global name {mod!r}.{name!r} holds a newline")
        self.out.extend(GLOBAL + mod.encode("utf-8") + b"\n" + name.encode("utf-8") + b"\n")
        self._memoize(obj)

    def _save_object(self, obj: ObjectNode) -> None:
        self.save(type(obj))
        self._save_tuple(obj.args)
        if obj.kwargs:
            self.save(obj.kwargs)
            self.out.extend(NEWOBJ_EX)
        else:
            self.out.extend(NEWOBJ)
        self._memoize(obj)
        self._save_ops(obj)

    def _save_reduce(self, obj: ReduceNode) -> None:
        self.save(obj.func)
        self._save_tuple(obj.args)
        self.out.extend(REDUCE)
        self._memoize(obj)
        self._save_ops(obj)

    def _save_dict(self, obj: dict[Any, Any]) -> None:
        self.out.extend(EMPTY_DICT)
        self._memoize(obj)
        self._save_setitems(list(obj.items()))

    def _save_list(self, obj: list[Any]) -> None:
        self.out.extend(EMPTY_LIST)
        self._memoize(obj)
        self._save_appends(obj)

    def _save_persistent(self, obj: PersistentRef) -> None:
        self.save(obj.pid)
        self.out.extend(BINPERSID)

    def _save_bytes(self, obj: bytes) -> None:
        w = self.out.extend
        n = len(obj)
        if n < 256:
            w(SHORT_BINBYTES + bytes((n,)) + obj)
        elif n <= 0xFFFFFFFF:
            w(BINBYTES + _pack_u32(n) + obj)
        else:
            w(BINBYTES8 + _pack_u64(n) + obj)
        self._memoize(obj)

    def _save_bytearray(self, obj: bytearray) -> None:
        self.out.extend(BYTEARRAY8 + _pack_u64(len(obj)) + bytes(obj))
        self._memoize(obj)

    def _save_set(self, obj: set[Any]) -> None:
        self.out.extend(EMPTY_SET)
        self._memoize(obj)
        self._save_additems(list(obj))

    def _save_frozenset(self, obj: frozenset[Any]) -> None:
        w = self.out.extend
        w(MARK)
        for x in obj:
            self.save(x)
        w(FROZENSET)
        self._memoize(obj)

    def _save_tuple(self, obj: tuple[Any, ...], memoize: bool = True) -> None:
        w = self.out.extend
        n = len(obj)
        if n == 0:
            w(EMPTY_TUPLE)
            return
        if n > 3:
            w(MARK)
        for x in obj:
            self.save(x)
        if memoize and id(obj) in self.memo:
            # the tuple was reached recursively through its own items: drop what we pushed, fetch the memo
            w(POP_MARK if n > 3 else POP * n)
            self._get(self.memo[id(obj)])
            return
        w((TUPLE1, TUPLE2, TUPLE3)[n - 1] if n <= 3 else TUPLE)
        if memoize:
            self._memoize(obj)

    def _save_appends(self, items: list[Any]) -> None:
        w = self.out.extend
        for i in range(0, len(items), _BATCH):
            w(MARK)
            for x in items[i:i + _BATCH]:
                self.save(x)
            w(APPENDS)

    def _save_setitems(self, items: list[tuple[Any, Any]]) -> None:
        w = self.out.extend
        save = self.save
        for i in range(0, len(items), _BATCH):
            w(MARK)
            for k, v in items[i:i + _BATCH]:
                save(k)
                save(v)
            w(SETITEMS)

    def _save_additems(self, items: list[Any]) -> None:
        w = self.out.extend
        for i in range(0, len(items), _BATCH):
            w(MARK)
            for x in items[i:i + _BATCH]:
                self.save(x)
            w(ADDITEMS)

    def _save_ops(self, node: Any) -> None:
        for op in node.order:
            if op == "setitems":
                self._save_setitems(node.dictitems)
            elif op == "appends":
                self._save_appends(node.listitems)
            elif op == "additems":
                self._save_additems(node.setitems)
            elif op == "build":
                self.save(node.state)
                self.out.extend(BUILD)


_Writer = Callable[[GraphPickler, Any], None]

#: writers of the values that are written by value, never memoized by identity (strings by value)
_ATOM_WRITERS: dict[type, _Writer] = {
    str: GraphPickler._save_str, int: GraphPickler._save_int, type(None): GraphPickler._save_none,
    bool: GraphPickler._save_bool, float: GraphPickler._save_float,
}

#: writers of the exact types the graph holds besides atoms and node classes (see :func:`_writer_for`)
_WRITERS: dict[type, _Writer] = {
    tuple: GraphPickler._save_tuple_value, StorageRef: GraphPickler._save_storage, dict: GraphPickler._save_dict,
    list: GraphPickler._save_list, PersistentRef: GraphPickler._save_persistent, bytes: GraphPickler._save_bytes,
    bytearray: GraphPickler._save_bytearray, set: GraphPickler._save_set, frozenset: GraphPickler._save_frozenset,
}


def _writer_for(t: type) -> _Writer:
    """The writer of a type outside :data:`_WRITERS`: a global placeholder (an instance of :class:`GlobalMeta`),
    an object node (an instance of a placeholder class) or a reduce node.

    Raises:
        PicklerError: any other type.
    """
    if issubclass(t, GlobalMeta):
        return GraphPickler._save_global
    if issubclass(t, ObjectNode):
        return GraphPickler._save_object
    if issubclass(t, ReduceNode):
        return GraphPickler._save_reduce
    raise PicklerError(f"cannot write a value of type {t.__name__}")


def dumps(root: Any, *, protocol: int = 2, storage_hook: Any = None) -> bytes:
    """Pickle the node graph ``root`` (see :class:`GraphPickler`).

    Raises:
        PicklerError: a value this writer cannot express, or a graph nested deeper than Python's recursion limit.
    """
    try:
        return GraphPickler(protocol, storage_hook).dumps(root)
    except RecursionError:
        raise PicklerError("the graph is nested deeper than Python's recursion limit allows writing") from None
