"""The non-tensor entries of a checkpoint as ``ckptool inspect`` shows them: key path, type, value or a short preview.

Everything comes from the node graph the restricted unpickler built (:mod:`ckptool.formats.unpickler`): plain
Python values are shown as they are, a ``func(*args)`` record by its global's name and arguments
(``torch.device('cuda', 0)``), a pickled object by its class with its attributes below it. Nothing is imported or
called. Tensors belong to the tensor table and are left out, with one exception: a ``uint8`` vector under a key
naming an RNG (``rng_state``, ``torch_rng_state``, ``cuda_rng_state``, ``rng_states.torch``), which is what
``torch.get_rng_state()`` / ``torch.cuda.get_rng_state()`` return, is shown as ``RNG state (N bytes)``; so are
numpy's ``RandomState.get_state()`` tuple and Python's ``random.getstate()``. State_dicts and pickled modules
(:func:`ckptool.model.graph.find_state_dicts`) are left out as a whole: the tensor table lists them.

Output stays bounded whatever the file holds (:class:`PreviewLimits`): long strings, lists and dicts are cut with a
count of what was left out, containers nested deeper than ``depth`` are previewed on one line, a container reached
twice (shared, or containing itself) is shown once and then as ``same object as <path>``.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias, cast

from ckptool.errors import CkptError
from ckptool.formats.dtypes import STRUCT_FORMATS, numel, tensor_dtype
from ckptool.formats.nodes import (
    BlobView,
    GlobalMeta,
    ObjectNode,
    ParameterNode,
    PersistentRef,
    PickledObject,
    ReduceNode,
    StorageRef,
    TensorNode,
)
from ckptool.model.graph import class_name, is_module, is_tensor, join, mapping_items, unwrap_tensor
from ckptool.model.numpy_nodes import NumpyArray, numpy_kind, read_array, read_dtype

JsonValue: TypeAlias = "bool | int | float | str | list[JsonValue] | dict[str, JsonValue] | None"

_ATOMS = (str, int, float, bool, type(None), bytes, bytearray, complex, BlobView)
_PLAIN = frozenset({*_ATOMS, GlobalMeta})
_TENSOR_NODES = frozenset({TensorNode, ParameterNode})  # exact types of the values a container may hold to be one entry
_RNG_KEY = re.compile(r"rng", re.IGNORECASE)
#: torch dtype name -> ``struct`` format, for numpy scalars and small arrays
_BIG_INT_BITS = 256  # larger ints are shown by their size (str() of a huge int is slow, or refused)
_PREVIEW_DEPTH = 3  # nesting shown inside a one-line preview
_MORE_ROOM = 24  # characters a preview keeps for its "… N more" ending


@dataclass(frozen=True)
class PreviewLimits:
    """How much of the non-tensor content :func:`value_infos` describes: ``entries`` in all, ``items`` per list
    or dict (further ones are counted, not shown), containers nested ``depth`` levels deep shown on one line, and
    at most ``width`` characters per value."""

    entries: int = 300
    items: int = 16
    depth: int = 8
    width: int = 100


#: what ``ckptool inspect --all`` shows
ALL_VALUES = PreviewLimits(entries=50_000, items=5_000, depth=64, width=400)


@dataclass
class ValueInfo:
    """One non-tensor entry: dotted ``path`` (as tensor keys are named), ``type`` (``int``, ``tuple``,
    ``collections.OrderedDict``, ``argparse.Namespace``...), ``shown`` the one-line text ``ckptool inspect``
    prints, and ``value``, the whole value as JSON, when ``exact`` (else ``shown`` is a preview)."""

    path: str
    type: str
    shown: str
    value: JsonValue = None
    exact: bool = False

    def to_dict(self) -> dict[str, JsonValue]:
        """``{"path", "type", "value"}`` for an exact value, else ``{"path", "type", "preview"}``."""
        if self.exact:
            return {"path": self.path, "type": self.type, "value": self.value}
        return {"path": self.path, "type": self.type, "preview": self.shown}


def value_infos(root: object, skip: Iterable[object] = (), limits: PreviewLimits = PreviewLimits()
                ) -> tuple[list[ValueInfo], bool]:
    """The non-tensor entries of node graph ``root`` in pickle order, and whether the list is complete (False when
    ``limits.entries`` cut it). ``skip``: containers left out (the state_dicts the tensor table shows).

    Reads the graph only: nothing is imported or called, and no tensor data is read. Time is linear in the size of
    the graph; the output is bounded by ``limits`` however large, deep or self-referencing the content is.
    """
    walker = _Walker(limits, {id(o) for o in skip})
    try:
        walker.visit("", root, 0)
    except _Full:
        return walker.out, False
    return walker.out, True


class _Full(Exception):
    """Raised inside the walk when ``limits.entries`` entries are there."""


class _Walker:
    def __init__(self, limits: PreviewLimits, skip: set[int]) -> None:
        self.limits = limits
        self.skip = skip
        self.seen: dict[int, str] = {}
        self.out: list[ValueInfo] = []

    def add(self, path: str, type_: str, shown: str, value: JsonValue = None, exact: bool = False) -> None:
        if len(self.out) >= self.limits.entries:
            raise _Full
        self.out.append(ValueInfo(path or "(top level)", type_, shown, value, exact))

    def visit(self, path: str, obj: object, depth: int) -> None:
        """Describe ``obj`` at ``path``: one entry, or its children's entries."""
        if self.shown_alone(path, obj):
            return
        items = mapping_items(obj)
        seq = _sequence(obj)
        if numpy_kind(obj) is not None or is_module(obj) or (items is None and seq is None
                                                             and not isinstance(obj, ObjectNode)):
            self.leaf(path, obj)
            return
        self.seen[id(obj)] = path
        if items is not None:
            self.container(path, obj, [k for k, _v in items], [v for _k, v in items], depth, "keys")
        elif seq is not None:
            self.container(path, obj, None, seq, depth, "items")
        else:
            assert isinstance(obj, ObjectNode)
            self.instance(path, obj, depth)

    def shown_alone(self, path: str, obj: object) -> bool:
        """True when ``obj`` is described without walking into it (added here, or left out): a tensor (an RNG
        state shown), a plain value, a skipped container, an RNG state tuple, an object met before."""
        if is_tensor(obj):
            rng = _rng_tensor(path, obj)
            if rng:
                self.add(path, "torch.ByteTensor", rng)
            return True
        if isinstance(obj, (*_ATOMS, GlobalMeta)):
            self.leaf(path, obj)
            return True
        if id(obj) in self.skip:
            return True
        rng = _rng_tuple(obj)
        if rng:
            self.add(path, type(obj).__name__, rng)
            return True
        first = self.seen.get(id(obj))
        if first is not None:
            self.add(path, _type_name(obj), f"same object as {first or '(top level)'}")
            return True
        return False

    def instance(self, path: str, obj: ObjectNode, depth: int) -> None:
        """A pickled object: one entry, then its attributes (a leaf when it has none readable, or is too deep)."""
        attrs = _attributes(obj)
        if attrs is None or depth >= self.limits.depth:
            self.leaf(path, obj)
            return
        self.add(path, obj.global_name, f"object ({len(attrs)} attributes)")
        self.children(path, obj, [k for k, _v in attrs], [v for _k, v in attrs], depth, "attributes")

    def leaf(self, path: str, obj: object) -> None:
        ok, value = _json_value(obj, self.limits)
        self.add(path, _type_name(obj), _preview(obj, self.limits.width), value, ok)

    def container(self, path: str, obj: object, keys: list[object] | None, values: Sequence[object], depth: int,
                  what: str) -> None:
        """A dict (``keys``) / list / tuple: one entry when it is empty, holds only plain values and fits on a line
        (a list or tuple: cut to fit), or is nested too deep; else its children's entries."""
        width = self.limits.width
        if not values or depth >= self.limits.depth or (all(type(v) in _PLAIN for v in values) and (
                keys is None or (len(values) <= 6 and len(_preview(obj, 4 * width)) <= width))):
            self.leaf(path, obj)
            return
        self.children(path, obj, keys, values, depth, what)

    def children(self, path: str, obj: object, keys: list[object] | None, values: Sequence[object], depth: int,
                 what: str) -> None:
        """The entries of ``values`` (named by ``keys``, else by index), up to ``limits.items`` of those that give
        one, then a line counting the rest."""
        shown = 0
        for i, v in enumerate(values):
            if shown >= self.limits.items:
                rest = sum(1 for w in values[i:] if not is_tensor(w))
                if rest:
                    self.add(path, _type_name(obj), f"... {rest} more {what} not shown (--all shows more)")
                return
            key = i if keys is None else keys[i]
            if type(v) in _TENSOR_NODES and not _RNG_KEY.search(path) and not (
                    type(key) is str and _RNG_KEY.search(key)):
                continue  # a tensor, and no RNG state: the tensor table's (the common case, made cheap)
            before = len(self.out)
            self.visit(join(path, key if type(key) is int else _key_text(key)), v, depth + 1)
            shown += len(self.out) > before


def _sequence(obj: object) -> Sequence[object] | None:
    """The items of a list / tuple (itself) or set (as a list), else None."""
    if type(obj) is list or type(obj) is tuple:
        return obj
    return list(obj) if isinstance(obj, (list, tuple, set, frozenset)) else None


def _attributes(obj: ObjectNode) -> list[tuple[str, object]] | None:
    """The attributes of a pickled instance (BUILD state: ``__dict__``, or ``(__dict__, slots)``), else None."""
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
        pairs = [*(state[0] or {}).items(), *(state[1] or {}).items()]
    elif isinstance(state, dict):
        pairs = list(state.items())
    else:
        return None
    return [(_key_text(k), v) for k, v in pairs]


def _key_text(k: object) -> str:
    if type(k) is str:
        return k if len(k) <= 1000 else k[:999] + "…"
    if type(k) is int and k.bit_length() <= _BIG_INT_BITS:
        return str(k)
    return _preview(k, 60)


def _type_name(obj: object) -> str:
    if obj is None:
        return "None"
    if isinstance(obj, GlobalMeta):
        return "global"
    if isinstance(obj, BlobView):
        return obj.kind
    kind = numpy_kind(obj)
    if kind == "array" and isinstance(obj, PickledObject):
        try:
            arr = read_array(obj)
        except CkptError:
            return "numpy.ndarray"
        return "numpy.ndarray" if arr.shape else "numpy." + arr.dtype
    if kind == "dtype":
        return "numpy.dtype"
    if kind == "scalar" and isinstance(obj, ReduceNode):
        try:
            return "numpy." + read_dtype(obj.args[0])[0]
        except (CkptError, IndexError):
            return "numpy scalar"
    return class_name(obj)


# ------------------------------------------------------------------------------------------------ RNG states
def _rng_tensor(path: str, obj: object) -> str | None:
    """``RNG state (N bytes)`` for a 1-d uint8 tensor under a key naming an RNG, else None."""
    t = unwrap_tensor(obj)
    if t is None or not _RNG_KEY.search(path) or len(t.shape) != 1:
        return None
    try:
        dtype = tensor_dtype(t)
    except CkptError:
        return None
    return f"RNG state ({t.shape[0]} bytes)" if dtype == "uint8" else None


def _rng_tuple(obj: object) -> str | None:
    """numpy's ``RandomState.get_state()`` (``('MT19937', uint32 array, pos, has_gauss, cached_gaussian)``) or
    Python's ``random.getstate()`` (``(version, 625 ints, gauss_next)``) as ``RNG state (N bytes, ...)``."""
    if type(obj) is not tuple:
        return None
    if len(obj) == 5 and obj[0] == "MT19937" and isinstance(obj[1], PickledObject) and numpy_kind(obj[1]):
        try:
            nbytes = len(read_array(obj[1]).data)
        except CkptError:
            return None
        return f"RNG state ({nbytes} bytes, numpy MT19937)"
    if (len(obj) == 3 and type(obj[0]) is int and type(obj[1]) is tuple and len(obj[1]) == 625
            and all(type(x) is int for x in obj[1])):
        return f"RNG state ({4 * len(obj[1])} bytes, Python random)"
    return None


# ------------------------------------------------------------------------------------------------ values
def _numpy_values(arr: NumpyArray, limit: int) -> list[bool | int | float] | None:
    """The first ``limit`` elements of a numpy array read from the graph (None for complex dtypes)."""
    fmt = STRUCT_FORMATS.get(arr.dtype)
    if fmt is None:
        return None
    size = struct.calcsize(fmt)
    data = arr.data[:size * limit]
    return [v for (v,) in struct.iter_unpack("<" + fmt, data[:len(data) - len(data) % size])]


def _json_scalar(obj: object, limits: PreviewLimits) -> tuple[bool, JsonValue] | None:
    """:func:`_json_value` of a plain scalar (None, bool, int, float, str, a numpy scalar); None for anything
    else."""
    if obj is None or isinstance(obj, bool):
        return True, obj
    if isinstance(obj, int):
        return (True, obj) if obj.bit_length() <= 64 else (False, None)
    if isinstance(obj, float):
        return (True, obj) if math.isfinite(obj) else (False, None)
    if isinstance(obj, str):
        return (True, obj) if len(obj) <= limits.width else (False, None)
    if numpy_kind(obj) == "scalar" and isinstance(obj, PickledObject):
        try:
            values = _numpy_values(read_array(obj), 1)
        except CkptError:
            return False, None
        return (True, values[0]) if values and not (isinstance(values[0], float) and not math.isfinite(values[0])) \
            else (False, None)
    return None


def _json_value(obj: object, limits: PreviewLimits, depth: int = 0) -> tuple[bool, JsonValue]:
    """``(True, value)`` when ``obj`` is a plain value (or a short flat list / dict of them) that JSON carries
    whole, else ``(False, None)``."""
    scalar = _json_scalar(obj, limits)
    if scalar is not None:
        return scalar
    if depth > 0:
        return False, None
    if isinstance(obj, (list, tuple)) and len(obj) <= limits.items:
        values = [_json_value(v, limits, depth + 1) for v in obj]
        return (True, [jv for _ok, jv in values]) if all(ok for ok, _jv in values) else (False, None)
    items = mapping_items(obj)
    if items is not None and len(items) <= limits.items and all(type(k) is str for k, _v in items):
        pairs = [(k, _json_value(v, limits, depth + 1)) for k, v in items]
        if all(ok for _k, (ok, _jv) in pairs):
            return True, {cast(str, k): jv for k, (_ok, jv) in pairs}
    return False, None


def _preview(obj: object, width: int) -> str:
    """``obj`` on one line of at most ``width`` characters (Python-like syntax; cut with ``…``)."""
    parts: list[str] = []
    _Render(parts, width + 1).emit(obj, 0)
    text = "".join(parts)
    return text if len(text) <= width else text[:width - 1] + "…"


class _Render:
    """Writes a bounded preview into ``parts``: stops once ``budget`` characters are written."""

    def __init__(self, parts: list[str], budget: int) -> None:
        self.parts = parts
        self.budget = budget

    def put(self, s: str) -> None:
        self.parts.append(s)
        self.budget -= len(s)

    def emit(self, obj: object, depth: int) -> None:
        if not self.atom(obj):
            self.structure(obj, depth)

    def atom(self, obj: object) -> bool:
        """Write ``obj`` when it is a plain value or a global (True), else write nothing (False)."""
        if isinstance(obj, str):
            suffix = f"… ({len(obj)} chars)"
            short = len(obj) + 2 <= self.budget
            self.put(repr(obj) if short else repr(obj[:max(self.budget - len(suffix) - 3, 4)]) + suffix)
        elif isinstance(obj, (bytes, bytearray)):
            self.put(f"{type(obj).__name__} ({len(obj)} bytes)" + (f" {bytes(obj[:16])!r}" if obj else ""))
        elif isinstance(obj, BlobView):  # a long value left in the file (scan's and inspect's reads): as above
            if obj.kind == "str":
                self.put(repr(obj.head[:max(self.budget - len(f"… ({obj.chars} chars)") - 3, 4)])
                         + f"… ({obj.chars} chars)")
            else:
                self.put(f"{obj.kind} ({obj.length} bytes) {obj.head!r}")
        elif isinstance(obj, int) and not isinstance(obj, bool) and obj.bit_length() > _BIG_INT_BITS:
            self.put(f"<int of {obj.bit_length()} bits>")
        elif isinstance(obj, _ATOMS):
            self.put(repr(obj))
        elif isinstance(obj, GlobalMeta):
            self.put(obj.qualified_name)
        else:
            return False
        return True

    def structure(self, obj: object, depth: int) -> None:
        """Write a tensor, a numpy value, a storage, a container or a pickled object."""
        if is_tensor(obj):
            self.tensor(obj)
        elif numpy_kind(obj) is not None and isinstance(obj, ReduceNode):
            self.numpy(obj)
        elif isinstance(obj, (StorageRef, PersistentRef)):
            self.put(repr(obj)[:200])
        elif mapping_items(obj) is not None:
            items = mapping_items(obj) or []
            head = "" if type(obj) is dict else f"{class_name(obj)}("
            self.seq(head + "{", [k for k, _v in items], [v for _k, v in items], "}" + (")" if head else ""), depth)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            opening, closing = {list: ("[", "]"), tuple: ("(", ")")}.get(type(obj), ("{", "}"))
            seq = _sequence(obj) or []
            self.seq(opening, None, seq, ("," if type(obj) is tuple and len(seq) == 1 else "") + closing, depth)
        elif isinstance(obj, ReduceNode):
            self.seq(f"{class_name(obj)}(", None, obj.args, ")", depth)
        elif isinstance(obj, ObjectNode):
            self.put(f"{obj.global_name}(…)")
        else:
            self.put(f"<{type(obj).__name__}>")

    def seq(self, opening: str, keys: Sequence[object] | None, values: Sequence[object], closing: str,
            depth: int) -> None:
        self.put(opening)
        if values and depth >= _PREVIEW_DEPTH:
            self.put(f"…{len(values)}")
        else:
            for i, v in enumerate(values):
                if self.budget < _MORE_ROOM:
                    self.put(f"{', ' if i else ''}… {len(values) - i} more")
                    break
                if i:
                    self.put(", ")
                if keys is not None:
                    self.emit(keys[i], depth + 1)
                    self.put(": ")
                self.emit(v, depth + 1)
        self.put(closing)

    def tensor(self, obj: object) -> None:
        t = unwrap_tensor(obj)
        try:
            dtype = tensor_dtype(t) if t is not None else "?"
        except CkptError:
            dtype = "?"
        self.put(f"tensor({dtype}, {list(t.shape) if t is not None else []})")

    def numpy(self, obj: ReduceNode) -> None:
        kind = numpy_kind(obj)
        try:
            if kind == "dtype":
                self.put(f"numpy.dtype({read_dtype(obj)[0]!r})")
                return
            arr = read_array(obj)
        except CkptError as e:
            self.put(f"numpy {kind} (unreadable: {str(e)[:60]})")
            return
        values = _numpy_values(arr, 8)
        if not arr.shape:
            self.put(repr(values[0]) if values else f"numpy.{arr.dtype}(…)")
            return
        shown = ""
        if values is not None and len(arr.shape) == 1:
            shown = " " + repr(values)[:-1] + (", …]" if numel(arr.shape) > len(values) else "]")
        self.put(f"numpy.ndarray({arr.dtype}, {list(arr.shape)}){shown}")
