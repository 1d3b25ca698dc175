"""``ckptool.inspect``: what a checkpoint holds, read without torch and without reading tensor bytes.

For torch zip / legacy / TorchScript files the pickle is read with :mod:`ckptool.formats.unpickler` (nothing
imported or run); for safetensors only the JSON header is read (:mod:`ckptool.formats.safetensors`). A sharded set
(:mod:`ckptool.formats.sharded`: an ``*.index.json`` or the folder holding one) is described as one checkpoint
from its shards, a DCP folder from its ``.metadata`` (:mod:`ckptool.formats.dcp`).

Bytes are counted one way everywhere (the totals, the per-device / dtype table, ``--json``): the bytes of each
storage, once, however many tensors (tied weights, views) use it; a tensor's own ``nbytes`` is its numel * element
size. The non-tensor entries (epoch, steps, learning rates, hyper-parameters, RNG states) are described by
:mod:`ckptool.ops.inspect_values`.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from itertools import chain, islice, repeat
from json.encoder import encode_basestring_ascii
from operator import itemgetter, mul
from typing import Any, cast

from ckptool import _source as source
from ckptool._gc import gc_paused
from ckptool.errors import CkptError, CorruptCheckpointError
from ckptool.formats import detect as formats
from ckptool.formats.dcp import read_dcp_metadata
from ckptool.formats.deepspeed import is_deepspeed_folder
from ckptool.formats.dtypes import (
    DTYPE_SIZES,
    contiguous_stride,
    numel,
    safetensors_dtype,
    storage_element,
    tensor_dtype,
)
from ckptool.formats.nodes import GlobalMeta, ParameterNode, StorageRef, TensorNode, qualified_name
from ckptool.formats.safetensors import read_header
from ckptool.formats.sharded import is_checkpoint_set, read_index, set_kind
from ckptool.formats.torch_package import read_package
from ckptool.formats.torchfile import Checkpoint, read_checkpoint, read_pickle_file
from ckptool.model.allowlist import (
    ALLOWED,
    DANGEROUS,
    NEEDS_TRUST,
    UNKNOWN,
    classify_global,
    is_allowed,
    level_of,
    worst_level,
)
from ckptool.model.graph import (
    StateDictRef,
    depth_first,
    find_state_dicts,
    is_module,
    is_state_dict,
    mapping_items,
    node_children,
    parameter_requires_grad,
    tensor_leaf,
    too_deep,
)
from ckptool.model.keys import has_flat_param_key, shared_prefixes, suggest_command
from ckptool.model.notebook import facts_table, tree_html
from ckptool.model.tree import TensorRow, TreeNode, build_tree
from ckptool.model.units import human_bytes
from ckptool.ops.dcp_safety import is_dcp_allowed
from ckptool.ops.deepspeed import describe_deepspeed
from ckptool.ops.inspect_values import PreviewLimits, ValueInfo, value_infos
from ckptool.ops.pt2 import describe_pt2
from ckptool.ops.scan import ScanResult, combine_results, scan_file

#: the ``"schema"`` of :meth:`CheckpointInfo.to_dict` (``ckptool inspect --json``)
SCHEMA = "ckptool.inspect/2"


@dataclass(slots=True)  # no __dict__: one per tensor (a million in a big state_dict)
class TensorInfo:
    """One tensor: dotted ``key``; ``shape`` / ``stride`` in elements; ``dtype`` torch name (``float32``);
    ``device`` the saved location tag; ``nbytes`` = numel * element size; ``storage_key`` the record it lives in
    (tensors that share a storage share the key); ``storage_offset`` in elements."""

    key: str
    shape: list[int]
    dtype: str
    device: str
    nbytes: int
    stride: list[int] = field(default_factory=list)
    storage_offset: int = 0
    storage_key: str | None = None
    requires_grad: bool = False


#: the fields of :class:`TensorInfo`, in order (the keys of each tensor in ``inspect --json``)
_TENSOR_FIELDS = tuple(f.name for f in fields(TensorInfo))


_BOOL_JSON = {True: "true", False: "false"}


def _json_column(values: list[Any]) -> str | list[str]:
    """``json.dumps(v)`` of each of ``values`` (not empty), in order, or that text once when it is the same for
    all: a value at a time only for a column that is not all strings, ints, bools, lists of ints, or strings and
    None (what the fields of :class:`TensorInfo` hold)."""
    first = values[0]
    if type(first) is str:  # only a str equals a str, and encode_basestring_ascii takes nothing else
        if values.count(first) == len(values):
            return json.dumps(first)
        try:
            return list(map(encode_basestring_ascii, values))  # what json.dumps writes for a str (ensure_ascii)
        except TypeError:  # not only strings
            pass
    types = set(map(type, values))  # strings are done: one type here is int, bool, list or another
    if len(types) == 1:
        kind = types.pop()
        if kind is list and not set(map(type, chain.from_iterable(values))) <= {int}:
            kind = object  # not only ints (True, 1.0, "a", None, nodes...)
        if kind in (int, bool, list) and values.count(first) == len(values):  # one type: == is exact here
            return json.dumps(first)
        if kind is int:
            return list(map(int.__repr__, values))  # json.dumps's own rule for ints
        if kind is bool:
            return list(map(_BOOL_JSON.__getitem__, values))
        if kind is list:
            return list(map(list.__repr__, values))  # "[1, 2]": ints joined by ", ", as json.dumps writes them
    if types == {str, type(None)}:
        return [encode_basestring_ascii(v) if v is not None else "null" for v in values]
    return list(map(json.dumps, values))


#: rows of ``"tensors"`` per piece of :meth:`CheckpointInfo.json_pieces`
_JSON_ROWS_PER_PIECE = 2000


def _tensor_rows_json(tensors: list[TensorInfo]) -> Iterator[str]:
    """The inside of ``"tensors": [...]`` in :meth:`CheckpointInfo.to_dict`'s JSON (``", ".join(json.dumps(row)
    for row in rows)``), in pieces of :data:`_JSON_ROWS_PER_PIECE` rows, built column by column: each field's
    values are encoded in one pass (:func:`_json_column`), a field with one value for every tensor is written once
    into the row template, and the rows of a piece are joined in one call. Every value is encoded before this
    returns (an error is raised here, not while the pieces are read). ``tensors`` must not be empty."""
    n = len(tensors)
    columns: tuple[list[Any], ...] = (  # the fields of TensorInfo (_TENSOR_FIELDS), in order
        [t.key for t in tensors], [t.shape for t in tensors], [t.dtype for t in tensors],
        [t.device for t in tensors], [t.nbytes for t in tensors], [t.stride for t in tensors],
        [t.storage_offset for t in tensors], [t.storage_key for t in tensors], [t.requires_grad for t in tensors])
    pieces: list[Iterable[str]] = []  # a row, in order: constant text, then the texts of a varying field, ...
    text = "{"
    for i, (name, values) in enumerate(zip(_TENSOR_FIELDS, columns, strict=True)):
        col = _json_column(values)
        text += f'{", " if i else ""}"{name}": '
        if type(col) is str:  # one value in every row: part of the template
            text += col
            continue
        # the first constant text of a row starts it: ", " before it in every row but the first
        pieces += (repeat(text) if pieces else chain((text,), repeat(", " + text)), col)
        text = ""
    text += "}"
    if not pieces:  # every field the same in every row (one tensor, or copies of one)
        return (", ".join(repeat(text, min(_JSON_ROWS_PER_PIECE, n - i))) if i == 0 else
                ", " + ", ".join(repeat(text, min(_JSON_ROWS_PER_PIECE, n - i)))
                for i in range(0, n, _JSON_ROWS_PER_PIECE))
    pieces.append(repeat(text))
    texts = chain.from_iterable(zip(*pieces))
    size = _JSON_ROWS_PER_PIECE * len(pieces)
    return ("".join(islice(texts, size)) for _ in range(0, n, _JSON_ROWS_PER_PIECE))


@dataclass
class StateDictInfo:
    """A state_dict in the file: dotted ``path`` (``""`` = top level), tensor count, shared wrapper ``prefixes``
    (``["module."]``), the ckptool command that removes them, and whether it holds FSDP flat parameters."""

    path: str
    tensors: int
    prefixes: list[str]
    fix: str | None = None
    flat_params: bool = False


@dataclass
class GlobalInfo:
    """A global the pickle would import (``module.qualname``), and whether ``torch.load(weights_only=True)``
    accepts it (``allowed``). ``status`` is how ``ckptool scan`` classifies it (``allowed``, ``dangerous`` or
    ``unknown``, see :func:`ckptool.model.allowlist.classify_global`; filled in from ``name`` when not given) and
    ``reason`` says why."""

    name: str
    allowed: bool
    status: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.status:
            self.status, self.reason = classify_global(self.name)
            if self.allowed and self.status != ALLOWED:  # allowed by a caller's own list (DCP metadata)
                self.status, self.reason = ALLOWED, "allowed for this format"


@dataclass
class ByteTotal:
    """The tensors of one location tag and dtype: ``tensors`` counts every tensor (views and tied weights
    included), ``storages`` the distinct storages they use and ``bytes`` those storages' bytes, each storage once
    (a storage shared by tensors of several dtypes counts under the first one's). A storage no tensor uses counts
    under its own storage class's dtype, with ``tensors`` 0."""

    device: str
    dtype: str
    tensors: int = 0
    storages: int = 0
    bytes: int = 0


@dataclass
class CheckpointInfo:
    """The result of :func:`inspect`; :meth:`to_dict` is what ``ckptool inspect --json`` prints.

    ``size`` is the file size in bytes; ``devices`` maps location tag -> tensor count; ``storage_bytes`` maps
    location tag -> bytes of distinct storages there (each storage once); ``totals`` the same per location tag and
    dtype (:class:`ByteTotal`); ``storages`` counts distinct storages; ``metadata`` holds safetensors
    ``__metadata__``; ``values`` the non-tensor entries (:class:`~ckptool.ops.inspect_values.ValueInfo`), all of
    them unless ``values_complete`` is False (cut by :class:`~ckptool.ops.inspect_values.PreviewLimits`);
    ``programs`` the signature of each exported program of a ``torch.export`` archive
    (:meth:`ckptool.formats.pt2.Program.signature`);
    ``bytes_read`` the bytes transferred to read a URL (range requests: the zip directory, the pickle, headers),
    None for a local path.
    """

    path: str
    format: str
    kind: str
    size: int
    tensors: list[TensorInfo]
    devices: dict[str, int]
    storage_bytes: dict[str, int]
    state_dicts: list[StateDictInfo]
    globals: list[GlobalInfo]
    storages: int = 0
    metadata: dict[str, str] | None = None
    totals: list[ByteTotal] = field(default_factory=list)
    values: list[ValueInfo] = field(default_factory=list)
    values_complete: bool = True
    #: the safety analysis, the one ``ckptool scan`` makes (every pickle in the file, hidden ones included)
    scan: ScanResult | None = field(default=None, repr=False)
    #: the signature of each exported program of a ``torch.export`` archive (``.pt2``), else empty
    programs: list[dict[str, Any]] = field(default_factory=list)
    bytes_read: int | None = None
    #: why torch 2.13's ``torch.load(weights_only=True)`` refuses the file whatever its globals (an opcode its
    #: unpickler does not read: ``pickle_protocol=4`` saves), None when only the globals decide
    #: (:attr:`ckptool.formats.torchfile.Checkpoint.weights_only_refusal`)
    weights_only_refusal: str | None = None
    #: a ``torch.package`` archive (:func:`_inspect_package`): ``resources`` (each pickle: ``member``, ``package``,
    #: ``resource``, ``kind``, ``tensors``, ``globals``), ``modules`` (the Python modules it ships, which
    #: ``PackageImporter`` runs), ``extern_modules``, ``python_version``, ``version``; else None
    package: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (``dataclasses.asdict`` without its deep copies: fast for 50,000 tensors), with
        ``"schema": "ckptool.inspect/2"``, ``total_bytes`` (storage bytes, each storage once), ``totals`` and
        ``values`` (``{"path", "type", "value"}`` or ``{"path", "type", "preview"}``)."""
        d = self._dict_without_tensors()
        d["tensors"] = [{  # the fields of TensorInfo (_TENSOR_FIELDS), in order: a dict display, built fastest
            "key": t.key, "shape": t.shape, "dtype": t.dtype, "device": t.device, "nbytes": t.nbytes,
            "stride": t.stride, "storage_offset": t.storage_offset, "storage_key": t.storage_key,
            "requires_grad": t.requires_grad} for t in self.tensors]
        return d

    def to_json(self, indent: int | None = None) -> str:
        """``json.dumps(self.to_dict(), indent=indent)``: the same text (what ``ckptool inspect --json`` prints),
        made faster (:meth:`json_pieces`).

        Raises:
            ValueError / TypeError: as ``json.dumps`` (a value JSON cannot hold)."""
        return "".join(self.json_pieces(indent))

    def json_pieces(self, indent: int | None = None) -> Iterator[str]:
        """The text of :meth:`to_json` in pieces (a few thousand tensor rows each), to write one after another:
        without a dict per tensor when ``indent`` is None (the tensor rows column by column). Everything is
        encoded before this returns: an error is raised here, not while the pieces are read.

        Raises:
            ValueError / TypeError: as ``json.dumps`` (a value JSON cannot hold)."""
        if indent is not None or not self.tensors:
            return iter((json.dumps(self.to_dict(), indent=indent),))
        d = self._dict_without_tensors()
        items = list(d.items())
        at = list(d).index("tensors")
        head = json.dumps(dict(items[:at]))[:-1]  # "{...": the entries before "tensors"
        tail = json.dumps(dict(items[at + 1:]))[1:]  # "...}": the entries after it
        rows = _tensor_rows_json(self.tensors)
        return chain((f'{head}{", " if at else ""}"tensors": [',), rows,
                     (f']{", " if tail != "}" else ""}{tail}',))

    def _dict_without_tensors(self) -> dict[str, Any]:
        """:meth:`to_dict` with ``"tensors"`` left as the list of :class:`TensorInfo` (in its place)."""
        d = {"schema": SCHEMA, **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "scan"}}
        d["total_bytes"] = self.total_bytes
        d["totals"] = [r.__dict__.copy() for r in self.totals]
        d["values"] = [v.to_dict() for v in self.values]
        d["state_dicts"] = [sd.__dict__.copy() for sd in self.state_dicts]
        d["globals"] = [{"name": g.name, "allowed": g.allowed} for g in self.globals]
        d["security"] = self.security()
        return d

    def security(self) -> dict[str, Any]:
        """The ``security`` object of ``inspect --json``: the verdict of ``ckptool scan`` on the same file, from
        the same analysis (:attr:`scan`: every pickle in the file, not only the ones ``torch.load`` reads).

        ``verdict`` ``safe`` / ``unsafe`` (scan ``--strict``), ``level`` (safe, needs-trust, dangerous),
        ``scan_verdict`` (that, or ``error`` for a file scan could not read to its end) and its ``exit_code``,
        ``dangerous`` (name, reason, ``where``), ``unknown`` and ``needs_trust`` names, ``hidden_pickles`` (the
        pickles ``torch.load`` does not read today: ``where``, ``globals``, ``level``, ``error``), ``notes``, ``code``
        (code that ships in the file: ``member``, ``kind``, ``level``, ``reason``, ``detail``) and
        ``recognised`` (a known library file type)."""
        sc = self.scan
        if sc is None:  # built by hand: the globals listed are all there is
            globs: list[tuple[str, str, str, list[str]]] = [(g.name, g.status, g.reason, []) for g in self.globals]
            return {"verdict": self.verdict, "level": worst_level(g[1] for g in globs), "scan_verdict": None,
                    "exit_code": None,
                    "dangerous": [{"name": n, "reason": r, "where": w} for n, st, r, w in globs if st == DANGEROUS],
                    "unknown": [n for n, st, _r, _w in globs if st == UNKNOWN],
                    "needs_trust": [n for n, st, _r, _w in globs if level_of(st) == NEEDS_TRUST],
                    "hidden_pickles": [], "notes": [], "code": [], "recognised": None}
        return {
            "verdict": self.verdict, "level": sc.level, "scan_verdict": sc.verdict, "exit_code": sc.exit_code,
            "dangerous": [{"name": g.name, "reason": g.reason, "where": list(g.where)} for g in sc.globals
                          if g.status == DANGEROUS],
            "unknown": list(dict.fromkeys(g.name for g in sc.globals if g.status == UNKNOWN)),
            "needs_trust": list(dict.fromkeys(g.name for g in sc.globals if g.level == NEEDS_TRUST)),
            "hidden_pickles": [{"where": p.where, "globals": list(p.globals), "error": p.error,
                                "level": sc.pickle_level(p)} for p in sc.hidden],
            "notes": list(sc.notes),
            "code": [c.to_dict() for c in sc.code],
            "recognised": None if sc.recognised is None else {"kind": sc.recognised[0],
                                                              "description": sc.recognised[1]},
        }

    @property
    def unsafe_globals(self) -> list[str]:
        return [g.name for g in self.globals if not g.allowed]

    @property
    def weights_only_loads(self) -> bool:
        """True when ``torch.load(weights_only=True)`` (torch 2.13's rules) reads the file: every global on its
        allowlist and every opcode one its unpickler reads."""
        return not self.unsafe_globals and self.weights_only_refusal is None

    @property
    def verdict(self) -> str:
        """``safe`` when every global of every pickle in the file is allowed (``ckptool scan --strict``'s verdict
        from :attr:`scan`, ``error`` when a hidden part could not be read), else ``unsafe``."""
        if self.scan is not None:
            return self.scan.strict_verdict
        return "unsafe" if any(g.status != ALLOWED for g in self.globals) else "safe"

    @property
    def total_bytes(self) -> int:
        """Bytes of all storages, each counted once (tied weights and views share theirs)."""
        return sum(self.storage_bytes.values())

    def tree(self, *, fold: bool = True) -> TreeNode:
        """The module tree of :attr:`tensors` by dotted key (:func:`ckptool.model.tree.build_tree`; repeated
        numbered blocks folded into one node unless ``fold`` is False)."""
        return build_tree((TensorRow(t.key, tuple(t.shape), t.dtype, t.device, t.nbytes) for t in self.tensors),
                          fold=fold)

    def _repr_html_(self) -> str:
        """The summary and the module tree, for Jupyter (``ckptool.inspect(path)`` as a cell's last line)."""
        facts = [("format", self.format), ("kind", self.kind), ("size", human_bytes(self.size)),
                 ("tensors", f"{len(self.tensors)} in {self.storages} storages, {human_bytes(self.total_bytes)}"),
                 ("devices", ", ".join(f"{d} ({n})" for d, n in self.devices.items()) or "-"),
                 ("wrapper prefixes", "; ".join(f"{sd.path or '(top level)'}: {' '.join(sd.prefixes)}"
                                                for sd in self.state_dicts if sd.prefixes) or "-"),
                 ("safety", self.security().get("level") or self.verdict)]
        return facts_table(self.path, facts) + tree_html(self.tree())


def tensor_infos(root: Any, storages: dict[str, StorageRef] | None = None) -> list[TensorInfo]:
    """A :class:`TensorInfo` for every tensor reachable from ``root`` (see :func:`ckptool.model.graph.iter_tensors`);
    when ``storages`` is given, the storage of each is added to it by key.

    Raises:
        UnsupportedError: a tensor's storage class is unknown.
        CorruptCheckpointError: containers nested deeper than :data:`ckptool.model.graph.MAX_DEPTH`."""
    out: list[TensorInfo] = []
    append = out.append
    v2: Any = None  # the placeholder of torch._utils._rebuild_tensor_v2, once a tensor names it
    last_class: Any = None  # the storage class of the last tensor of the common case, and its (dtype, element size)
    element = ("", 1)
    ref: StorageRef | None
    for key, x in depth_first(root, "", node_children, tensor_leaf, TensorNode):
        if type(x) is TensorNode:
            t = x
            f = t.func
            if f is not v2 and f.node_type is TensorNode and f.name == "_rebuild_tensor_v2":
                v2 = f
            a = t.args
            if f is v2 and len(a) >= 4:  # the common case, fast: a plain strided tensor of a storage
                ref, size, stride = a[0], a[2], a[3]
                if type(ref) is StorageRef and type(size) is tuple and type(stride) is tuple:
                    if ref.storage_type is not last_class:
                        dtype = tensor_dtype(t)
                        element, last_class = (dtype, DTYPE_SIZES.get(dtype, 1)), ref.storage_type
                    nbytes = element[1]
                    for d in size:  # numel(shape) * element size, inline: this runs for every tensor
                        nbytes *= int(d)
                    if storages is not None:
                        storages.setdefault(ref.key, ref)
                    rg = a[4] if len(a) > 4 and type(a[4]) is bool else t.requires_grad
                    append(TensorInfo(key, list(size), element[0], ref.location, nbytes, list(stride), a[1], ref.key,
                                      rg))
                    continue
            rg = t.requires_grad
        else:  # a Parameter node holding a tensor node (tensor_leaf)
            p = cast(ParameterNode, x)
            t, rg = p.tensor, parameter_requires_grad(p)
        out.append(_general_info(key, t, rg, storages))
    return out


def _general_info(key: str, t: TensorNode, rg: bool, storages: dict[str, StorageRef] | None) -> TensorInfo:
    """The :class:`TensorInfo` of any tensor node (the properties of :class:`TensorNode`)."""
    ref, shape = t.storage, list(t.shape)
    dtype = tensor_dtype(t)
    nbytes = numel(shape) * DTYPE_SIZES.get(dtype, 1)
    if storages is not None and ref is not None:
        storages.setdefault(ref.key, ref)
    return TensorInfo(key, shape, dtype, ref.location if ref else "meta", nbytes, list(t.stride), t.storage_offset,
                      ref.key if ref else None, rg)


def _state_dict_info(path: str, keys: list[str]) -> StateDictInfo:
    prefixes = shared_prefixes(keys)
    return StateDictInfo(path, len(keys), prefixes, suggest_command(prefixes), has_flat_param_key(keys))


def _kind(root: Any, sds: list[StateDictRef]) -> str:
    if sds and sds[0].obj is root and not sds[0].is_module:  # find_state_dicts already tested the root
        return "state_dict"
    if is_state_dict(root):
        return "state_dict"
    if is_module(root):
        return "full_model"
    if mapping_items(root) is not None and sds:
        return "training_checkpoint"
    return "tensors"


def byte_totals(tensors: list[TensorInfo], storages: dict[str, tuple[str, str, int]]) -> list[ByteTotal]:
    """One :class:`ByteTotal` per (location tag, dtype), sorted, from ``tensors`` and ``storages`` (storage key ->
    ``(location tag, dtype, bytes)`` of every storage in the file): each storage's bytes are counted once, under the
    first tensor that uses it; storages no tensor uses under their own tag and dtype."""
    devices, dtypes = [t.device for t in tensors], [t.dtype for t in tensors]
    keys = [t.storage_key for t in tensors]
    # the storages tensors use, in order of first use (a tensor without storage, key None, uses none)
    used = cast(list[str], list(filter(storages.__contains__, dict.fromkeys(keys))))
    if None in storages:
        used = [key for key in used if key is not None]
    rows: dict[tuple[str, str], ByteTotal]
    if tensors and devices.count(devices[0]) == len(devices) and dtypes.count(dtypes[0]) == len(dtypes):
        # one location tag and dtype (the common case; == groups as the dict below does): no lookup per storage
        r = ByteTotal(devices[0], dtypes[0], len(tensors), len(used),
                      sum(map(itemgetter(2), map(storages.__getitem__, used))))
        rows = {(r.device, r.dtype): r}
    else:
        groups = list(zip(devices, dtypes))
        rows = {g: ByteTotal(g[0], g[1], n) for g, n in Counter(groups).items()}
        first = dict(zip(reversed(keys), reversed(groups)))  # storage key -> (location tag, dtype) of its first user
        for key in used:
            r = rows[first[key]]
            r.storages += 1
            r.bytes += storages[key][2]
    if len(used) < len(storages):  # storages no tensor uses
        counted = set(used)
        for key, (device, dtype, nbytes) in storages.items():
            if key not in counted:
                r = rows.get((device, dtype))  # type: ignore[assignment]
                if r is None:
                    r = rows[device, dtype] = ByteTotal(device, dtype)
                r.storages += 1
                r.bytes += nbytes
    return [rows[k] for k in sorted(rows)]


def _merge_totals(groups: list[list[ByteTotal]]) -> list[ByteTotal]:
    """The rows of several disjoint sets of storages (the shards of a set) added up per (location tag, dtype)."""
    rows: dict[tuple[str, str], ByteTotal] = {}
    for group in groups:
        for r in group:
            acc = rows.setdefault((r.device, r.dtype), ByteTotal(r.device, r.dtype))
            acc.tensors += r.tensors
            acc.storages += r.storages
            acc.bytes += r.bytes
    return [rows[k] for k in sorted(rows)]


def _device_bytes(totals: list[ByteTotal]) -> dict[str, int]:
    """Location tag -> storage bytes, from :func:`byte_totals` rows."""
    out: dict[str, int] = {}
    for r in totals:
        out[r.device] = out.get(r.device, 0) + r.bytes
    return out


def _one_storage_each(tensors: list[TensorInfo]) -> list[ByteTotal]:
    """:func:`byte_totals` for formats where every tensor has its own data (safetensors, DCP)."""
    return byte_totals(tensors, {t.storage_key or t.key: (t.device, t.dtype, t.nbytes) for t in tensors})


@gc_paused
def inspect(path: str | os.PathLike[str], limits: PreviewLimits | None = None) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` without importing torch or reading tensor data.

    Returns a :class:`CheckpointInfo`: format (``torch-zip``, ``torch-legacy``, ``torchscript``, ``safetensors``,
    ``pickle``, ``torch-export`` (a ``.pt2``, kind ``exported_program``, see :func:`ckptool.ops.pt2.describe_pt2`),
    ``torch-package`` (kind ``package``: a ``torch.package`` archive, its pickles and modules in
    :attr:`CheckpointInfo.package`);
    for an ``*.index.json`` or a folder ``sharded-safetensors``, ``sharded-torch`` or ``dcp``, see
    :func:`inspect_set`; ``deepspeed`` for a DeepSpeed ZeRO folder,
    :func:`ckptool.ops.deepspeed.describe_deepspeed`), kind (``state_dict``, ``training_checkpoint``, ``full_model``,
    ``torchscript``, ``tensors``), every tensor (shared storages included), tensor counts per location tag, storage
    bytes per location tag and dtype (each storage once), the state_dicts found with their wrapper prefixes, the
    globals the pickle names with their ``weights_only=True`` status, and the non-tensor entries, as many as
    ``limits`` allow (default :class:`~ckptool.ops.inspect_values.PreviewLimits`; ``ALL_VALUES`` for more).

    Raises:
        UsageError: missing path, or a folder that is neither a DCP checkpoint nor holds one ``*.index.json``.
        NotACheckpointError: empty file, unknown bytes or another file type.
        CorruptCheckpointError: truncated, damaged or hostile file (see
            :func:`ckptool.formats.torchfile.read_checkpoint`), or a pickle nested deeper than ckptool can walk.
        UnsupportedError: tuple nesting too deep to read safely.
    """
    path = os.fspath(path)
    if not source.is_url(path):
        return _inspect(path, limits)
    start = source.bytes_transferred()
    info = _inspect(path, limits)
    info.bytes_read = source.bytes_transferred() - start
    return info


def _inspect(path: str, limits: PreviewLimits | None) -> CheckpointInfo:
    if is_deepspeed_folder(path):
        return _inspect_deepspeed(path)
    if is_checkpoint_set(path):  # sharded sets and DCP folders
        return inspect_set(path, limits)
    fmt = formats.detect_format(path)
    if fmt == formats.SAFETENSORS:
        info = _inspect_safetensors(path)
        info.scan = scan_file(path)
        return info
    if fmt == formats.PT2:
        info = _inspect_pt2(path)
        info.scan = scan_file(path)
        return info
    if fmt == formats.TORCH_PACKAGE:
        info = _inspect_package(path, limits)
        info.scan = scan_file(path)
        return info
    try:
        ck = read_pickle_file(path) if fmt == formats.PICKLE else read_checkpoint(path, fmt)
        info = describe(ck, limits)
    except RecursionError as e:
        raise CorruptCheckpointError(f"{path}: {too_deep(e)}") from None
    info.scan = scan_file(path, preparsed=_already_read(ck))
    return info


def _already_read(ck: Checkpoint) -> dict[str, tuple[list[str], Any, int | None]]:
    """The pickle :func:`inspect` read whole (the ``data.pkl`` of a torch zip, a plain pickle), by its ``where`` in
    :func:`ckptool.ops.scan.scan_file`, so that the scan does not read it a second time (for ``data.pkl``, not
    even its opcodes: where it ends is known)."""
    names = [qualified_name(m, n) for m, n in ck.globals]
    if ck.format == formats.PICKLE:
        return {"pickle at byte 0": (names, ck.root, None)}
    rec = ck.record("data.pkl")
    if ck.format == formats.TORCH_ZIP and rec is not None and rec.zipinfo is not None:
        return {rec.zipinfo.name: (names, ck.root, ck.pickle_size or None)}
    return {}


def _inspect_deepspeed(path: str) -> CheckpointInfo:
    """A DeepSpeed ZeRO folder (:func:`ckptool.ops.deepspeed.describe_deepspeed`): the tensors of its consolidated
    state_dict (tied names share a storage key), the ZeRO facts in ``metadata``."""
    d = describe_deepspeed(path)
    tensors = [TensorInfo(t.name, list(t.shape), t.dtype, "cpu", t.nbytes, list(contiguous_stride(t.shape)), 0,
                          t.tied_to or t.name) for t in d.tensors]
    totals = _one_storage_each([t for t in tensors if t.storage_key == t.key])
    for row in totals:
        row.tensors = sum(1 for t in tensors if (t.device, t.dtype) == (row.device, row.dtype))
    return CheckpointInfo(path, "deepspeed", "training_checkpoint", d.size, tensors, {"cpu": len(tensors)},
                          _device_bytes(totals), [_state_dict_info("", [t.key for t in tensors])],
                          [GlobalInfo(n, is_allowed(n)) for n in d.globals], storages=sum(r.storages for r in totals),
                          metadata=d.metadata, totals=totals)


def _storage_row(ref: StorageRef) -> tuple[str, str, int]:
    """``(location tag, dtype, bytes)`` of a storage (an unknown storage class: its numel, as bytes)."""
    try:
        dtype, size = storage_element(ref)  # once: this runs for every storage (50,000 in a big state_dict)
        return ref.location, dtype, ref.numel * size
    except CkptError:
        return ref.location, "unknown", ref.numel


def _one_storage_class(refs: dict[str, StorageRef]) -> StorageRef | None:
    """The first of ``refs`` when they all name one storage class placeholder (the common case), else None."""
    types = [ref.storage_type for ref in refs.values()]
    # == of a placeholder (a class) is identity
    if types and isinstance(types[0], GlobalMeta) and types.count(types[0]) == len(types):
        return next(iter(refs.values()))
    return None


def _storage_rows(refs: dict[str, StorageRef]) -> dict[str, tuple[str, str, int]]:
    """:func:`_storage_row` of each storage, by key: the element of a storage class looked up once."""
    first = _one_storage_class(refs)
    if first is None:  # several storage classes: one storage at a time
        return {key: _storage_row(ref) for key, ref in refs.items()}
    locations = [ref.location for ref in refs.values()]
    numels = [ref.numel for ref in refs.values()]
    try:
        dtype, size = storage_element(first)
    except CkptError:
        return dict(zip(refs, zip(locations, repeat("unknown"), numels)))
    return dict(zip(refs, zip(locations, repeat(dtype), map(mul, numels, repeat(size)))))


def _storage_totals(tensors: list[TensorInfo], refs: dict[str, StorageRef]) -> list[ByteTotal]:
    """:func:`byte_totals` of ``tensors`` and the storages ``refs`` (:func:`_storage_rows`), without a row per
    storage in the common case: one storage class, every storage used, one location tag and dtype for all tensors
    (the bytes are then the storages' elements times the element size)."""
    first = _one_storage_class(refs)
    if first is not None and tensors:
        devices, dtypes = [t.device for t in tensors], [t.dtype for t in tensors]
        if devices.count(devices[0]) == len(devices) and dtypes.count(dtypes[0]) == len(dtypes) and len(
                refs.keys() & [t.storage_key for t in tensors]) == len(refs):
            try:
                size = storage_element(first)[1]
            except CkptError:
                size = 1  # an unknown storage class: its numel, as bytes (_storage_row)
            return [ByteTotal(devices[0], dtypes[0], len(tensors), len(refs),
                              sum([ref.numel for ref in refs.values()]) * size)]
    return byte_totals(tensors, _storage_rows(refs))


def _extra_roots(ck: Checkpoint, tensors: list[TensorInfo]) -> tuple[int, list[ByteTotal]]:
    """Add the tensors of the extra roots of ``ck`` (a TorchScript archive's ``constants.pkl``) to ``tensors``,
    keyed ``<root>.<key>``, their storages ``<root>/<key>``; return the number of storages and the byte totals."""
    storages = _storage_rows(ck.storages)
    for name, extra in ck.extra_roots.items():
        refs: dict[str, StorageRef] = {}
        for t in tensor_infos(extra, refs):
            key = t.storage_key and f"{name}/{t.storage_key}"
            tensors.append(TensorInfo(**{**asdict(t), "key": f"{name}.{t.key}", "storage_key": key}))
        storages.update({f"{name}/{key}": row for key, row in _storage_rows(refs).items()})
    return len(storages), byte_totals(tensors, storages)


def describe(ck: Checkpoint, limits: PreviewLimits | None = None) -> CheckpointInfo:
    """Build the :class:`CheckpointInfo` of an already-read :class:`~ckptool.formats.torchfile.Checkpoint`
    (``limits``: as :func:`inspect`). Tensors of extra roots (a TorchScript archive's ``constants.pkl``) are keyed
    ``<root>.<key>``, their storages ``<root>/<key>``."""
    tensors = tensor_infos(ck.root)
    if not ck.extra_roots:  # the common case: no row per storage
        n_storages, totals = len(ck.storages), _storage_totals(tensors, ck.storages)
    else:
        n_storages, totals = _extra_roots(ck, tensors)
    sds = find_state_dicts(ck.root)
    sd_infos = [_state_dict_info(sd.path, sd.keys()) for sd in sds]
    if tensors and len(totals) == 1 and totals[0].tensors == len(tensors):  # one location tag and dtype for all
        devices = {tensors[0].device: len(tensors)}
    else:  # tensors per location tag, in order of first use
        devices = dict(Counter([t.device for t in tensors]))
    kind = "torchscript" if ck.format == formats.TORCHSCRIPT else _kind(ck.root, sds)
    names = [qualified_name(m, n) for m, n in ck.globals]
    torchscript = ck.format == formats.TORCHSCRIPT and ck.record("constants.pkl") is not None
    globs = [GlobalInfo(n, is_allowed(n), *classify_global(n, torchscript=torchscript)) for n in dict.fromkeys(names)]
    values, complete = ([], True) if kind == "torchscript" else value_infos(
        ck.root, [sd.obj for sd in sds], limits or PreviewLimits())
    return CheckpointInfo(ck.path, ck.format, kind, ck.size, tensors, devices, _device_bytes(totals), sd_infos, globs,
                          storages=n_storages, totals=totals, values=values, values_complete=complete,
                          weights_only_refusal=ck.weights_only_refusal)


def _inspect_safetensors(path: str) -> CheckpointInfo:
    header = read_header(path)
    meta = header.metadata
    tensors = []
    for name, e in header.entries.items():
        begin, end = e["data_offsets"]
        shape = e["shape"]
        tensors.append(TensorInfo(name, shape, safetensors_dtype(e["dtype"]), "cpu", end - begin,
                                  list(contiguous_stride(shape)), 0, name))
    sds = [_state_dict_info("", [t.key for t in tensors])]
    totals = _one_storage_each(tensors)
    return CheckpointInfo(
        path, formats.SAFETENSORS, "tensors", source.file_size(path), tensors,
        {"cpu": len(tensors)} if tensors else {}, {"cpu": sum(t.nbytes for t in tensors)}, sds, [],
        storages=len(tensors), metadata=meta if isinstance(meta, dict) else None, totals=totals,
    )


def _inspect_pt2(path: str) -> CheckpointInfo:
    """A ``torch.export`` archive (:func:`ckptool.ops.pt2.describe_pt2`): its weights and constants, the
    program's signature in ``programs``, its versions in ``metadata``."""
    d = describe_pt2(path)
    tensors = [TensorInfo(t.key, list(t.payload.shape), t.payload.dtype or "unknown", t.payload.device,
                          t.payload.nbytes, list(t.payload.stride), t.payload.storage_offset,
                          None if t.payload.pickled else t.payload.member, t.payload.requires_grad) for t in d.tensors]
    devices: dict[str, int] = {}
    for t in tensors:
        devices[t.device] = devices.get(t.device, 0) + 1
    totals = byte_totals(tensors, d.storages)
    return CheckpointInfo(path, formats.PT2, "exported_program", d.archive.size, tensors, devices,
                          _device_bytes(totals), [_state_dict_info(p, keys) for p, keys in d.state_dicts.items()],
                          [GlobalInfo(g.name, is_allowed(g.name), g.status, g.reason) for g in d.globals],
                          storages=len(d.storages), metadata=d.metadata, totals=totals, values=d.values,
                          programs=d.programs)


def _inspect_package(path: str, limits: PreviewLimits | None) -> CheckpointInfo:
    """A ``torch.package`` archive (:func:`ckptool.formats.torch_package.read_package`): the tensors of every
    pickle, keyed ``<member>:<key>`` (``weights/sd.pkl:fc.weight``), their storages shared across pickles as the
    archive shares them; the pickles, modules and extern modules in ``package``, its versions in ``metadata``."""
    try:
        pkg = read_package(path)
        tensors: list[TensorInfo] = []
        sd_infos: list[StateDictInfo] = []
        values: list[ValueInfo] = []
        complete, resources, names = True, [], {}
        for r in pkg.resources:
            mine = tensor_infos(r.root)
            for t in mine:
                t.key = f"{r.member}:{t.key}"
            sds = find_state_dicts(r.root)
            sd_infos += [_state_dict_info(f"{r.member}:{sd.path}", sd.keys()) for sd in sds]
            vals, done = value_infos(r.root, [sd.obj for sd in sds], limits or PreviewLimits())
            values += [ValueInfo(f"{r.member}:{v.path}", v.type, v.shown, v.value, v.exact) for v in vals]
            complete = complete and done
            resources.append({"member": r.member, "package": r.package, "resource": r.resource,
                              "kind": _kind(r.root, sds), "tensors": len(mine), "globals": r.globals})
            tensors += mine
            names.update(dict.fromkeys(r.globals))
    except RecursionError as e:
        raise CorruptCheckpointError(f"{path}: {too_deep(e)}") from None
    totals = _storage_totals(tensors, pkg.storages)
    devices = dict(Counter(t.device for t in tensors))
    return CheckpointInfo(path, formats.TORCH_PACKAGE, "package", pkg.size, tensors, devices,
                          _device_bytes(totals), sd_infos, [GlobalInfo(n, is_allowed(n)) for n in names],
                          storages=len(pkg.storages), totals=totals, values=values, values_complete=complete,
                          metadata={"python_version": pkg.python_version, "version": pkg.version},
                          package={"resources": resources, "modules": pkg.modules,
                                   "extern_modules": pkg.extern_modules, "python_version": pkg.python_version,
                                   "version": pkg.version})


@gc_paused
def inspect_set(path: str | os.PathLike[str], limits: PreviewLimits | None = None) -> CheckpointInfo:
    """Describe a sharded set (``*.index.json`` or the folder holding one) or a DCP folder as one checkpoint,
    without torch and without reading tensor data. Returns a :class:`CheckpointInfo` with format
    ``sharded-safetensors`` / ``sharded-torch`` (``sharded-mixed``) / ``dcp``; a model folder holding only
    ``model.safetensors`` or ``pytorch_model.bin`` is that file's :func:`inspect`.

    For a sharded set every shard is inspected and its tensors listed (storage keys prefixed by the shard file);
    ``metadata`` holds the index's ``metadata`` (values that are not strings as JSON) and the shard count. For DCP
    the tensors come from ``.metadata`` (names, dtypes, shapes; sizes = elements * element size; DCP records no
    device, so ``cpu`` is shown, where ``dcp_to_torch_save`` puts them); non-tensor entries are listed under
    ``metadata["non_tensor_entries"]``, and ``globals`` says which globals of ``.metadata`` ckptool accepts without
    ``--trust`` (:func:`ckptool.ops.dcp_safety.is_dcp_allowed`) and ``values`` names them (their bytes are not
    read). ``limits``: as :func:`inspect`.

    Raises:
        UsageError: a folder that is none of these; a missing shard.
        CorruptCheckpointError / NotACheckpointError: a damaged index, shard or ``.metadata``.
    """
    kind, set_path = set_kind(os.fspath(path))
    if kind == "file":
        return inspect(set_path, limits)
    if kind == "index":
        return _inspect_index(set_path, limits)
    return _inspect_dcp(set_path)


def _inspect_index(path: str, limits: PreviewLimits | None) -> CheckpointInfo:
    index = read_index(path)
    tensors: list[TensorInfo] = []
    devices: dict[str, int] = {}
    globs: dict[str, GlobalInfo] = {}
    totals: list[list[ByteTotal]] = []
    values: list[ValueInfo] = []
    complete = True
    size = source.file_size(path)
    storages = 0
    fmts = set()
    scans: list[tuple[str, ScanResult]] = []
    for shard in index.shards:
        info = inspect(index.shard_path(shard), limits)
        if info.scan is not None:
            scans.append((shard, info.scan))
        fmts.add("safetensors" if info.format == formats.SAFETENSORS else "torch")
        size += info.size
        storages += info.storages
        for t in info.tensors:
            t.storage_key = f"{shard}:{t.storage_key}"
            tensors.append(t)
        for d, n in info.devices.items():
            devices[d] = devices.get(d, 0) + n
        totals.append(info.totals)
        values += info.values
        complete = complete and info.values_complete
        for g in info.globals:
            globs.setdefault(g.name, g)
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (index.metadata or {}).items()}
    meta["shards"] = str(len(index.shards))
    fmt = "sharded-" + (fmts.pop() if len(fmts) == 1 else "mixed")
    merged = _merge_totals(totals)
    return CheckpointInfo(path, fmt, "state_dict", size, tensors, devices, _device_bytes(merged),
                          [_state_dict_info("", [t.key for t in tensors])], list(globs.values()), storages=storages,
                          metadata=meta, totals=merged, values=values, values_complete=complete,
                          scan=combine_results(path, fmt, [(shard, r) for shard, r in scans]))


_OPTIMIZER_STATE_RE = re.compile(r"(^|\.)state\.\d+$")  # an optimizer's per-parameter state: no state_dict


def _inspect_dcp(folder: str) -> CheckpointInfo:
    meta = read_dcp_metadata(folder)
    tensors = []
    groups: dict[str, list[str]] = {}
    for fqn, dt, shape in meta.entries:
        if dt is None:
            continue
        dims = shape or ()
        tensors.append(TensorInfo(fqn, list(dims), dt, "cpu", numel(dims) * DTYPE_SIZES.get(dt, 1),
                                  list(contiguous_stride(dims)), 0, fqn))
        comps = meta.planner_data.get(fqn) if meta.planner_data is not None else None
        if isinstance(comps, tuple) and comps:
            parent, leaf = ".".join(map(str, comps[:-1])), str(comps[-1])
        else:
            parent, leaf = "", fqn
        if not _OPTIMIZER_STATE_RE.search(parent):
            groups.setdefault(parent, []).append(leaf)
    non_tensor = [e.fqn for e in meta.entries if e.dtype is None]
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
               if os.path.isfile(os.path.join(folder, n)))
    extra = {"non_tensor_entries": ", ".join(non_tensor)} if non_tensor else {}
    if meta.version is not None:
        extra["dcp_version"] = meta.version
    kind = "state_dict" if len(groups) == 1 and not non_tensor else "training_checkpoint"
    nbytes = sum(t.nbytes for t in tensors)
    values = [ValueInfo(fqn, "object", "pickled in a .distcp file (not read)") for fqn in non_tensor]
    return CheckpointInfo(folder, "dcp", kind, size, tensors, {"cpu": len(tensors)} if tensors else {},
                          {"cpu": nbytes} if tensors else {}, [_state_dict_info(g, keys) for g, keys in groups.items()],
                          [GlobalInfo(n, is_dcp_allowed(n)) for n in dict.fromkeys(meta.globals)],
                          storages=len(tensors), metadata=extra or None, totals=_one_storage_each(tensors),
                          values=values, scan=scan_file(folder))
