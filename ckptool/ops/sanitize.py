"""``ckptool.sanitize``: turn a checkpoint that ``torch.load(weights_only=True)`` refuses into one it accepts,
without running the file.

The file is read with the restricted unpickler (:func:`ckptool.formats.torchfile.read_checkpoint`: a node graph,
nothing imported or called), every object outside torch's weights_only allowlist is replaced by a rule below, and
the graph is written as a torch zip file (:func:`ckptool.ops.rewrite.stream.rewrite_file`: the existing storages copied
byte for byte, the new ones added as records). The rules, in the order they are tried:

1. ``nn.Module`` objects (a ``torch.save(model)`` pickle, or a module inside a dict) become their state_dict, as
   ``extract-state-dict`` computes it (:mod:`ckptool.ops.extract`: parameters and persistent buffers, detached,
   with ``_metadata``).
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

Anything else outside the allowlist (any other class or function, a dangerous global such as ``os.system``) is
reported with its key path, and nothing is written, unless ``drop_unknown`` leaves it out (a dict entry removed,
a list or tuple item replaced by None; each one listed in the result).
"""

from __future__ import annotations

import ntpath
import os
import posixpath
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ckptool._gc import gc_paused
from ckptool.errors import CkptError, UnsafeCheckpointError, UnsupportedError
from ckptool.formats.nodes import (
    CLASS_BUILD,
    GlobalMeta,
    ObjectNode,
    ParameterNode,
    PersistentRef,
    PickledObject,
    ReduceNode,
    StorageRef,
    TensorNode,
    global_placeholder,
    qualified_name,
    split_use,
)
from ckptool.model.allocations import oversized_use
from ckptool.model.allowlist import DANGEROUS, classify_global, is_allowed, level_of, level_word
from ckptool.model.graph import ATOMS, is_module, join, mapping_items, set_mapping_items, too_deep
from ckptool.model.module_state import detached, module_state_dict, state_dict_node
from ckptool.model.numpy_nodes import numpy_kind, numpy_type_dtype, read_array, read_dtype
from ckptool.model.tensor_nodes import tensor_node
from ckptool.model.units import plural, retagged_words, wrote_line
from ckptool.ops.rewrite.stream import ProgressFn, output_path, refuse_unwritable, retag_function, rewrite_file
from ckptool.readers import Checkpoint, Opened, open_checkpoint

__all__ = ["Conversion", "SanitizeResult", "sanitize"]

_PATHS = {f"pathlib.{m}{c}": j for m in ("", "_local.") for c, j in (
    ("Path", posixpath), ("PosixPath", posixpath), ("PurePosixPath", posixpath), ("WindowsPath", ntpath),
    ("PureWindowsPath", ntpath))}
#: the globals a refusal names, at most
_LISTED = 5

_RECONSTRUCTOR = ("copyreg._reconstructor", "copy_reg._reconstructor")
#: record classes converted although their module is on the dangerous list (``types``)
_KNOWN_RECORDS = frozenset({"argparse.Namespace", "types.SimpleNamespace"})


class _Drop:
    """Marks a value ``drop_unknown`` leaves out."""


_DROP = _Drop()


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


@dataclass
class SanitizeResult:
    """What :func:`sanitize` wrote: ``dst``, the input format, every object ``converted`` and ``dropped``
    (:class:`Conversion`, in graph order), the ``storages`` written (of which ``new_storages`` hold converted
    numpy data), ``bytes_written``, the output's storage tags ``devices`` (``{tag: storage count}``) and the
    storages re-tagged by ``to`` / ``mapping`` (``{(old, new): count}``)."""

    src: str
    dst: str
    format_in: str
    converted: list[Conversion] = field(default_factory=list)
    dropped: list[Conversion] = field(default_factory=list)
    storages: int = 0
    new_storages: int = 0
    bytes_written: int = 0
    devices: dict[str, int] = field(default_factory=dict)
    retagged: dict[tuple[str, str], int] = field(default_factory=dict)

    def __str__(self) -> str:
        """What ``ckptool sanitize`` prints (before its load hint): each object converted and dropped, then the
        ``Wrote DST (SIZE, N storages, M new; re-tagged ...)`` line."""
        lines = [f"Converted {plural(len(self.converted), 'object')}; nothing from the file was imported or run"
                 + (":" if self.converted else "")]
        lines += [f"  {c.label}: {c.source} -> {c.detail}" for c in self.converted]
        if self.dropped:
            lines.append(f"Dropped {plural(len(self.dropped), 'object')} no rule converts (--drop-unknown):")
            lines += [f"  {c.label}: {c.source} ({c.why})" for c in self.dropped]
        retagged = retagged_words(self.retagged)
        lines.append(wrote_line(self.dst, self.bytes_written, f"{plural(self.storages, 'storage')}, "
                                f"{self.new_storages} new" + (f"; {retagged}" if retagged else "")))
        return "\n".join(lines)


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


class _Sanitizer:
    """One pass over a graph, replacing what is outside the allowlist (see the module docstring)."""

    def __init__(self, ck: Checkpoint, drop_unknown: bool) -> None:
        self.drop_unknown = drop_unknown
        self.memo: dict[int, Any] = {}
        self.used: set[str] = set()
        self.new_records: list[tuple[str, bytes]] = []
        self.converted: list[Conversion] = []
        self.left: list[Conversion] = []
        taken = {r.name for r in ck.records}
        self._next = max((int(k) for k in ck.storages if k.isascii() and k.isdigit()), default=-1) + 1
        self._taken = taken

    def _new_key(self) -> str:
        while f"data/{self._next}" in self._taken:
            self._next += 1
        key = str(self._next)
        self._taken.add(f"data/{key}")
        return key

    def _unknown(self, obj: object, path: str) -> Any:
        name = oversized_use(obj) or _global_of(obj)  # bytearray(1500000000): rated as the use it is
        self.left.append(_left_over(path, name) if "." in name and not isinstance(obj, PersistentRef) else Conversion(
            path, "unknown", name, "a persistent id torch.load cannot resolve" if isinstance(obj, PersistentRef)
            else "no rule converts it"))
        return _DROP if self.drop_unknown else obj

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
            return t(v for v in vals if v is not _DROP)
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
            if key is not _DROP and val is not _DROP:
                out.append((key, val))
        return out

    def _sequence(self, items: list[Any] | tuple[Any, ...], path: str) -> list[Any]:
        out = []
        for i, v in enumerate(items):
            val = self.value(v, join(path, i))
            out.append(None if val is _DROP else val)
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
            return _DROP if self.drop_unknown else obj
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


def _left_over(path: str, name: str) -> Conversion:
    """The :class:`Conversion` of global ``name`` at ``path`` that no rule converts: rated as ``ckptool scan`` rates
    it (:func:`ckptool.model.allowlist.classify_global`), its level and reason."""
    status, reason = classify_global(name)
    return Conversion(path, "unknown", name, reason, level_of(status))


def _refuse_unwritable(opened: Opened, src: str) -> None:
    """The format's refusal to rewrite (a plain pickle, safetensors, ...), naming each global outside the
    weights_only allowlist with the level ``ckptool scan`` gives it: a plain pickle calling ``os.system`` is no
    mere "nothing to sanitize"."""
    try:
        refuse_unwritable(opened.spec, src, "sanitize")
    except UnsupportedError as e:
        try:
            names = [qualified_name(m, n) for m, n in opened.graph().globals]
        except CkptError:  # no pickle to read (safetensors): the refusal as it is
            raise e from None
        named = [(n, classify_global(n)) for n in dict.fromkeys(names) if not is_allowed(n)]
        if not named:
            raise
        words = ", ".join(f"{n} ({level_word(level_of(status))})" for n, (status, _why) in named[:_LISTED])
        more = f" and {len(named) - _LISTED} more" if len(named) > _LISTED else ""
        raise UnsupportedError(f"{e}; it names {words}{more}: see `ckptool scan {shlex.quote(src)}`") from None


def _refusal(src: str, left: list[Conversion]) -> UnsafeCheckpointError:
    shown = "; ".join(f"{c.label}: {c.source} ({c.why})" for c in left[:8])
    more = f" and {len(left) - 8} more" if len(left) > 8 else ""
    return UnsafeCheckpointError(
        f"{src}: {len(left)} object(s) have no weights_only equivalent: {shown}{more}; nothing was written. "
        "Remove them from the checkpoint, or pass --drop-unknown (drop_unknown=True) to leave them out",
        sorted({c.source for c in left}))


@gc_paused
def sanitize(src: str | os.PathLike[str], dst: str | os.PathLike[str] | None = None, *, to: str | None = None,
             mapping: Mapping[str, str] | None = None, allow_missing: bool = False, drop_unknown: bool = False,
             in_place: bool = False, progress: ProgressFn | None = None) -> SanitizeResult:
    """Write ``src`` as a torch zip file that ``torch.load(path, weights_only=True)`` accepts, without importing
    or running anything from ``src`` (the rules: see the module docstring).

    Args:
        src: a torch zip or legacy checkpoint (``torch.save``), e.g. one holding numpy arrays, an
            ``argparse.Namespace`` or a pickled ``nn.Module``.
        dst: the output file; default ``<stem>.sanitized<ext>`` beside ``src``.
        to: re-tag every storage for this device (``"cpu"``) in the same pass; converted arrays are tagged
            ``cpu`` before it.
        mapping: re-tag only the storages whose tag matches (``{"cuda:1": "cpu"}``).
        allow_missing: write the file even when a ``mapping`` source matches no storage.
        drop_unknown: leave out what no rule converts (listed in ``dropped``) instead of refusing.
        in_place: replace ``src`` itself (atomically).
        progress: ``progress(nbytes)`` is called as the existing storage records are copied (bytes since the last
            call).

    Returns:
        A :class:`SanitizeResult`: every converted object with its key path.

    Raises:
        UnsafeCheckpointError: something no rule converts (each one named with its key path and global), without
            ``drop_unknown``; or the top-level object itself. Nothing is written.
        UnsupportedError: safetensors, TorchScript or plain-pickle input; a module whose state_dict needs its own
            code (quantized, lazy, state_dict hooks).
        UsageError: ``dst`` is ``src`` without ``in_place``, a bad device, both ``to`` and ``mapping``.
        DeviceNotFoundError: a ``mapping`` source matches no storage, without ``allow_missing``.
        CorruptCheckpointError / NotACheckpointError: a damaged or foreign file; a numpy array whose data does not
            match its shape; a graph nested too deep to walk.
        OutputError: writing failed (nothing is left behind).
    """
    src = os.fspath(src)
    out = sanitize_output(src, dst, in_place)
    opened = open_checkpoint(src).require_file()
    _refuse_unwritable(opened, src)
    ck = opened.graph()
    location_fn = retag_function(ck, to, mapping, allow_missing=allow_missing)
    s = _Sanitizer(ck, drop_unknown)
    try:
        root = s.value(ck.root, "")
    except RecursionError as e:
        raise too_deep(e) from None
    for name in dict.fromkeys(qualified_name(m, n) for m, n in ck.globals):  # BUILD on a class: never written
        if split_use(name)[1] == CLASS_BUILD:
            s.left.append(_left_over("", name))
    if s.left and (not drop_unknown or root is _DROP):
        raise _refusal(src, s.left)
    keep = {"data/" + k for k in s.used}
    kept = replace(ck, protocol=2, _records=[r for r in ck.records if not r.name.startswith("data/") or r.name in keep],
                   storages={k: v for k, v in ck.storages.items() if k in s.used},
                   globals=[g for g in ck.globals if split_use(g[1])[1] != CLASS_BUILD])  # dropped: listed in left
    written = rewrite_file(kept, out, root, location_fn, s.new_records, progress)
    res = SanitizeResult(src, out, opened.format, s.converted, s.left, storages=len(kept.storages) + len(s.new_records),
                         new_storages=len(s.new_records), bytes_written=written.bytes_written,
                         retagged=written.retagged)
    for ref in kept.storages.values():
        tag = location_fn(ref.location) if location_fn else ref.location
        res.devices[tag] = res.devices.get(tag, 0) + 1
    if s.new_records:
        tag = location_fn("cpu") if location_fn else "cpu"
        res.devices[tag] = res.devices.get(tag, 0) + len(s.new_records)
    return res


def sanitize_output(src: str | os.PathLike[str], dst: str | os.PathLike[str] | None, in_place: bool = False) -> str:
    """The file :func:`sanitize` writes: ``dst``, ``src`` with ``in_place``, or ``<stem>.sanitized<ext>`` beside it.

    Raises:
        UsageError: as :func:`ckptool.ops.rewrite.stream.output_path`.
    """
    return output_path(os.fspath(src), os.fspath(dst) if dst is not None else None, in_place, "sanitized")
