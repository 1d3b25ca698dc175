"""The rules of ``ckptool sanitize`` (:mod:`ckptool.ops.sanitize`): one pass over a checkpoint's node graph that
replaces every object outside torch's weights_only allowlist by what ``torch.load(weights_only=True)`` accepts,
reading nothing and running nothing. The rules, in the order they are tried:

1. ``nn.Module`` objects (a ``torch.save(model)`` pickle, or a module inside a dict) become their state_dict, as
   ``extract-state-dict`` computes it (:mod:`ckptool.model.module_state`: parameters and persistent buffers,
   detached, with ``_metadata``).
2. numpy arrays become tensors of the same dtype, shape and values (Fortran order kept as strides), in new
   storages tagged ``cpu``; numpy scalars (``numpy.float64(0.5)``) become 0-d tensors. Which dtypes:
   :mod:`ckptool.model.numpy_nodes`.
3. numpy dtypes (``numpy.dtype('float16')``) and numpy scalar types (``numpy.float32``) become the torch dtype of
   the same name (``torch.float16``).
4. plain records become dicts: an object made without constructor arguments whose whole content is an attribute
   dict (``argparse.Namespace``, ``types.SimpleNamespace``, dataclasses, simple config classes; ``__slots__``
   values included) or dict items (dict subclasses such as Lightning's ``AttributeDict``). Classes classified
   dangerous by :mod:`ckptool.model.allowlist` never are (``types.SimpleNamespace`` excepted).
5. ``pathlib`` paths become their string.

Anything else outside the allowlist (any other class or function, a dangerous global such as ``os.system``, a call
that asks to allocate past the reader's limit: :func:`ckptool.model.allocations.oversized_use`) is listed in
:attr:`Sanitizer.left` with its key path and the level ``ckptool scan`` gives it, and kept, or left out
(:data:`DROP`) with ``drop_unknown``.
"""

from __future__ import annotations

import ntpath
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckptool.errors import UnsupportedError
from ckptool.formats.nodes import (
    GlobalMeta,
    ObjectNode,
    ParameterNode,
    PersistentRef,
    PickledObject,
    ReduceNode,
    StorageRef,
    TensorNode,
    global_placeholder,
)
from ckptool.model.allocations import oversized_use
from ckptool.model.allowlist import DANGEROUS, classify_global, is_allowed, level_of, level_word
from ckptool.model.graph import ATOMS, is_module, join, mapping_items, set_mapping_items
from ckptool.model.module_state import detached, module_state_dict, state_dict_node
from ckptool.model.numpy_nodes import numpy_kind, numpy_type_dtype, read_array, read_dtype
from ckptool.model.tensor_nodes import tensor_node
from ckptool.model.units import plural

__all__ = ["DROP", "Conversion", "Drop", "Sanitizer", "left_over"]

_PATHS = {f"pathlib.{m}{c}": j for m in ("", "_local.") for c, j in (
    ("Path", posixpath), ("PosixPath", posixpath), ("PurePosixPath", posixpath), ("WindowsPath", ntpath),
    ("PureWindowsPath", ntpath))}

_RECONSTRUCTOR = ("copyreg._reconstructor", "copy_reg._reconstructor")
#: record classes converted although their module is on the dangerous list (``types``)
_KNOWN_RECORDS = frozenset({"argparse.Namespace", "types.SimpleNamespace"})


class Drop:
    """Marks a value ``drop_unknown`` leaves out."""


DROP = Drop()


@dataclass(frozen=True)
class Conversion:
    """One object sanitize replaced (or, in ``dropped`` / the error, could not): its dotted key ``path`` (``""``
    = the top level), ``kind`` (``module``, ``array``, ``scalar``, ``dtype``, ``record``, ``path``, or
    ``unknown``), the global it was (``source``: ``numpy.ndarray``, ``argparse.Namespace``...) and what it became
    or why not (``detail``: ``tensor float16 [3, 4]``, ``dict (4 entries)``)."""

    path: str
    kind: str
    source: str
    detail: str
    #: for a global no rule converts, the level ``ckptool scan`` gives it (``needs-trust`` or ``dangerous``:
    #: :func:`ckptool.model.allowlist.level_of`), else ``""``
    level: str = ""

    @property
    def label(self) -> str:
        """The key path as shown to the user (``(top level)`` for the root)."""
        return self.path or "(top level)"

    @property
    def why(self) -> str:
        """:attr:`detail`, led by the scan level in scan's words when there is one (``DANGEROUS: runs processes and
        changes files``, ``needs-trust: a class on no list...``)."""
        return f"{level_word(self.level)}: {self.detail}" if self.level else self.detail


def _global_of(obj: object) -> str:
    if isinstance(obj, ObjectNode):
        return obj.global_name
    if isinstance(obj, ReduceNode):
        return obj.global_name or "a call of a computed function"
    if isinstance(obj, GlobalMeta):
        return obj.qualified_name
    return type(obj).__name__


def _record_class(obj: PickledObject) -> str | None:
    """The class of a record made without constructor arguments (NEWOBJ ``cls.__new__(cls)``, REDUCE ``cls()``
    or protocol 0/1's ``copyreg._reconstructor(cls, object, None)``), else None."""
    if isinstance(obj, ObjectNode):
        return obj.global_name if not obj.args and not obj.kwargs else None
    if not isinstance(obj, ReduceNode) or not isinstance(obj.func, GlobalMeta):
        return None
    if not obj.args:
        return obj.func.qualified_name
    a = obj.args
    if (obj.func.qualified_name in _RECONSTRUCTOR and len(a) == 3 and isinstance(a[0], GlobalMeta)
            and isinstance(a[1], GlobalMeta) and a[1].qualified_name == "builtins.object" and a[2] is None):
        return a[0].qualified_name
    return None


def _record_items(obj: PickledObject) -> list[tuple[Any, Any]] | None:
    """The ``(name, value)`` pairs of a plain record: its dict items (a dict subclass) or its attribute dict
    (BUILD state: a dict, or ``(dict, slots dict)``), when it holds nothing else; else None."""
    if obj.listitems is not None or obj.setitems is not None:
        return None
    parts = obj.state if isinstance(obj.state, tuple) and len(obj.state) == 2 else (obj.state,)
    if not all(p is None or (type(p) is dict and all(isinstance(k, str) for k in p)) for p in parts):
        return None
    attrs = [kv for p in parts if p for kv in p.items()]
    if obj.dictitems is not None and attrs:
        return None  # a dict subclass with attributes too: no one dict says both
    return list(obj.dictitems) if obj.dictitems is not None else attrs


class Sanitizer:
    """One pass over a graph, replacing what is outside the allowlist (see the module docstring)."""

    def __init__(self, records: Iterable[str], storage_keys: Iterable[str], drop_unknown: bool) -> None:
        """A pass over the graph of a checkpoint whose zip ``records`` have these names (``data/0``, ...) and whose
        storages these keys: converted arrays get new storage keys after them. ``drop_unknown``: leave out (as
        :data:`DROP`) what no rule converts, instead of keeping it (to be refused)."""
        self.drop_unknown = drop_unknown
        self.memo: dict[int, Any] = {}
        #: the keys of the storages the new graph uses
        self.used: set[str] = set()
        #: ``(record name, bytes)`` of each converted array's new storage
        self.new_records: list[tuple[str, bytes]] = []
        self.converted: list[Conversion] = []
        #: what no rule converts (refused, or with ``drop_unknown`` dropped)
        self.left: list[Conversion] = []
        self._next = max((int(k) for k in storage_keys if k.isascii() and k.isdigit()), default=-1) + 1
        self._taken = set(records)

    def _new_key(self) -> str:
        while f"data/{self._next}" in self._taken:
            self._next += 1
        key = str(self._next)
        self._taken.add(f"data/{key}")
        return key

    def _unknown(self, obj: object, path: str) -> Any:
        name = oversized_use(obj) or _global_of(obj)  # bytearray(1500000000): rated as the use it is
        self.left.append(left_over(path, name) if "." in name and not isinstance(obj, PersistentRef) else Conversion(
            path, "unknown", name, "a persistent id torch.load cannot resolve" if isinstance(obj, PersistentRef)
            else "no rule converts it"))
        return DROP if self.drop_unknown else obj

    def value(self, obj: Any, path: str) -> Any:
        """The sanitized ``obj`` found at key ``path`` (shared objects stay shared: one result per object)."""
        if type(obj) in ATOMS:
            return obj
        done = self.memo.get(id(obj), self)
        if done is not self:
            return done
        new = self._value(obj, path)
        self.memo[id(obj)] = new
        return new

    def _value(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if t is TensorNode or t is ParameterNode:
            self._use_tensor(obj)
            return obj
        if t is StorageRef:
            self.used.add(obj.key)
            return obj
        if t is dict:
            new: dict[Any, Any] = {}
            self.memo[id(obj)] = new
            new.update(self._items(list(obj.items()), path))
            return new
        if t is list:
            out: list[Any] = []
            self.memo[id(obj)] = out
            out.extend(self._sequence(obj, path))
            return out
        if t is tuple:
            return tuple(self._sequence(obj, path))
        if t is set or t is frozenset:
            vals = (self.value(v, join(path, i)) for i, v in enumerate(obj))
            return t(v for v in vals if v is not DROP)
        if isinstance(obj, GlobalMeta):
            return self._global(obj, path)
        if isinstance(obj, PickledObject):
            return self._node(obj, path)
        if isinstance(obj, PersistentRef):
            return self._unknown(obj, path)
        return obj  # bytearray, complex...: values torch's unpickler reads itself

    def _items(self, items: list[tuple[Any, Any]], path: str) -> list[tuple[Any, Any]]:
        out = []
        for k, v in items:
            key = self.value(k, join(path, k))
            val = self.value(v, join(path, k))
            if key is not DROP and val is not DROP:
                out.append((key, val))
        return out

    def _sequence(self, items: list[Any] | tuple[Any, ...], path: str) -> list[Any]:
        out = []
        for i, v in enumerate(items):
            val = self.value(v, join(path, i))
            out.append(None if val is DROP else val)
        return out

    def _use_tensor(self, obj: TensorNode | ParameterNode) -> None:
        t = obj.tensor if isinstance(obj, ParameterNode) else obj
        if isinstance(t, TensorNode) and t.storage is not None:
            self.used.add(t.storage.key)

    def _global(self, g: GlobalMeta, path: str) -> Any:
        if is_allowed(g.qualified_name):
            return g
        dtype = numpy_type_dtype(g)
        if dtype is None:
            return self._unknown(g, path)
        self.converted.append(Conversion(path, "dtype", g.qualified_name, f"torch.{dtype}"))
        return global_placeholder("torch", dtype)

    def _node(self, obj: PickledObject, path: str) -> Any:
        if is_module(obj):
            return self._module(obj, path)
        kind = numpy_kind(obj)
        if kind is not None:
            return self._numpy(obj, kind, path)
        name = _global_of(obj)
        if is_allowed(name) and oversized_use(obj) is None:
            return self._allowed(obj, path)
        if name in _PATHS and isinstance(obj, ReduceNode) and all(isinstance(a, str) for a in obj.args):
            text = _PATHS[name].join(*obj.args) if obj.args else "."
            self.converted.append(Conversion(path, "path", name, f"str {text!r}"))
            return text
        cls = _record_class(obj)
        items = _record_items(obj) if cls is not None else None
        if cls is None or items is None or (cls not in _KNOWN_RECORDS and classify_global(cls)[0] == DANGEROUS):
            return self._unknown(obj, path)
        new: dict[Any, Any] = {}
        self.memo[id(obj)] = new
        at = len(self.converted)  # the record is listed before what it holds
        new.update(self._items(items, path))
        self.converted.insert(at, Conversion(path, "record", cls, f"dict ({plural(len(new), 'entry', 'entries')})"))
        return new

    def _allowed(self, obj: PickledObject, path: str) -> PickledObject:
        """An allowed node (an OrderedDict, ``torch.Size``, ``torch.device``...) with its contents sanitized, in
        place (the graph is this pass's own)."""
        self.memo[id(obj)] = obj
        items = mapping_items(obj)
        if items is not None:
            set_mapping_items(obj, self._items(list(items), path))
        else:
            obj.args = tuple(self._sequence(obj.args, path))  # type: ignore[attr-defined]  # Reduce/ObjectNode
            if obj.listitems is not None:
                obj.listitems = self._sequence(obj.listitems, path)
        if obj.state is not None:
            obj.state = self.value(obj.state, path)
        return obj

    def _numpy(self, obj: PickledObject, kind: str, path: str) -> Any:
        what = path or "the top level"
        try:
            if kind == "dtype":
                dtype, _big = read_dtype(obj)
                self.converted.append(Conversion(path, "dtype", "numpy.dtype", f"torch.{dtype}"))
                return global_placeholder("torch", dtype)
            arr = read_array(obj, what)
        except UnsupportedError as e:
            left = Conversion(path, "unknown", _global_of(obj), str(e))
            self.left.append(left)
            return DROP if self.drop_unknown else obj
        key = self._new_key()
        self.new_records.append((f"data/{key}", arr.data))
        self.used.add(key)
        node = tensor_node(key, arr.dtype, arr.shape, arr.stride)
        self.converted.append(Conversion(path, kind, "numpy.ndarray" if kind == "array" else "numpy scalar",
                                         f"tensor {arr.dtype} {list(arr.shape)}"))
        return node

    def _module(self, obj: PickledObject, path: str) -> Any:
        entries, meta = module_state_dict(obj)
        items = [(k, detached(t)) for k, t in entries]
        for _k, t in items:
            self._use_tensor(t)
        detail = f"state_dict ({plural(len(items), 'tensor')})"
        self.converted.append(Conversion(path, "module", _global_of(obj), detail))
        return state_dict_node(items, meta)


def left_over(path: str, name: str) -> Conversion:
    """The :class:`Conversion` of global ``name`` at ``path`` that no rule converts: rated as ``ckptool scan`` rates
    it (:func:`ckptool.model.allowlist.classify_global`), its level and reason."""
    status, reason = classify_global(name)
    return Conversion(path, "unknown", name, reason, level_of(status))
