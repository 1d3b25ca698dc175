"""``ckptool.diff``: what changed between two checkpoints, of any formats ckptool reads, streamed tensor by tensor.

Each side is opened once through the readers layer and read by the readers the other operations use, without torch
(:mod:`ckptool.ops.diff.sides`: torch files through their node graph, safetensors, sharded sets, ``.pt2``
archives, DeepSpeed ZeRO folders and DCP folders through :meth:`ckptool.readers.Opened.state_dict`); a training
checkpoint against a bare state_dict is compared through the state_dict ``convert`` picks in it.

Keys are matched after wrapper-prefix reconciliation (:func:`ckptool.model.keys.reconcile`, tried in both
directions). Values are compared tensor by tensor from the files' bytes, one chunk of each at a time
(:data:`CHUNK_BYTES`; a strided view reads its storage's span once), so memory stays bounded by the largest tensor
and neither file is ever loaded whole: bit-exact by default, or with tolerances in the manner of
``torch.testing.assert_close`` (:mod:`ckptool.torch_ops.value_stats`, which needs numpy).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptool._gc import gc_paused
from ckptool.errors import CorruptCheckpointError, UsageError
from ckptool.formats.dtypes import contiguous_stride, element_size, numel
from ckptool.formats.segments import byteswap
from ckptool.formats.strided import gather
from ckptool.formats.tensors import is_contiguous, span
from ckptool.model.keys import reconcile
from ckptool.model.notebook import facts_table
from ckptool.ops.convert.write import Files
from ckptool.ops.diff.sides import UNREAD, Side, SideTensor, read_pair
from ckptool.readers import Opened
from ckptool.torch_ops.value_stats import ValueStats, is_numeric, require_numpy, squared_norms

SCHEMA = "ckptool.diff/1"
#: bytes of each side read at a time when comparing values (a strided view reads its storage's span instead)
CHUNK_BYTES = 4 << 20
#: the most elements compared at a time (bounds numpy's float64 temporaries in tolerance mode)
CHUNK_ELEMENTS = 128 << 10

EQUAL, CLOSE, DIFFER, NOT_COMPARED = "equal", "close", "differ", "not compared"


@dataclass
class TensorDiff:
    """A tensor present in both checkpoints that differs: ``key`` in A (``key_b`` in B), ``changes`` in shape,
    dtype, saved device or stride (``"dtype float32 -> float16"``), ``not_stored`` the properties one side holds
    that the other side's format cannot store (``"device cuda:0 not stored in B"`` for a safetensors B,
    ``"stride [1, 6] not stored in B"``: safetensors stores every tensor contiguous; counted as differences only
    with ``strict``), ``values`` one of ``equal`` (bit-exact),
    ``close`` (within the tolerances), ``differ`` or ``not compared`` (``note`` says why). ``max_abs`` /
    ``max_rel`` are the greatest absolute / relative differences (``|b - a| / |a|``) and ``mismatched`` the number
    of elements that differ (bit-exact mode) or are not close (tolerance mode), out of ``numel``; None where they
    were not measured (without numpy, bit-exact mode only says that the bytes differ)."""

    key: str
    key_b: str
    changes: list[str] = field(default_factory=list)
    values: str = EQUAL
    max_abs: float | None = None
    max_rel: float | None = None
    mismatched: int | None = None
    numel: int = 0
    note: str = ""
    not_stored: list[str] = field(default_factory=list)


@dataclass
class ValueDiff:
    """A plain (non-tensor) value that differs: ``key`` in A (``key_b`` in B), and its value on each side."""

    key: str
    key_b: str
    a: object
    b: object


@dataclass
class DiffResult:
    """The result of :func:`diff`; :meth:`to_dict` is what ``ckptool diff --json`` prints.

    ``a`` / ``b`` are the paths and ``format_a`` / ``format_b`` their formats. ``prefix`` says how keys were
    matched when the sides differ by wrapper prefixes (``"B has `module.` on every key"``), else None.
    ``only_a`` / ``only_b`` list the keys (tensors and plain values) found on one side only. ``tensors`` lists the
    matched tensors that differ, and in tolerance mode those close but not bit-identical (:class:`TensorDiff`),
    ``values`` the plain values that differ, ``shared`` the
    differences in storage sharing (tied weights, views). ``compared`` counts matched tensors, ``values_equal``
    those whose values are equal or close. ``mode`` is ``exact``, ``tolerance`` or ``keys-only``. ``strict``:
    the properties a side's format cannot store (:attr:`TensorDiff.not_stored`) count as differences.
    """

    a: str
    b: str
    format_a: str
    format_b: str
    mode: str
    rtol: float | None = None
    atol: float | None = None
    prefix: str | None = None
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[ValueDiff] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)
    compared: int = 0
    values_equal: int = 0
    plain_values: int = 0
    not_compared: int = 0
    notes: list[str] = field(default_factory=list)
    strict: bool = False
    #: the dotted path of the state_dict compared in A / B (``--key``, or chosen as ``convert`` chooses it); None
    #: where the side is compared whole
    key_a: str | None = None
    key_b: str | None = None
    #: with ``diff(..., norms=True)``: key in A -> (``||A||**2``, ``||B - A||**2``) of each matched numeric tensor
    #: pair of equal shapes (``ckptool report``'s relative changes per module)
    norms: dict[str, tuple[float, float]] = field(default_factory=dict, repr=False)

    def _repr_html_(self) -> str:
        """The outcome in counts, for Jupyter (``ckptool.diff(a, b)`` as a cell's last line)."""
        changed = sum(1 for t in self.tensors if t.values == DIFFER)
        facts = [("identical", self.identical), ("mode", self.mode), ("matched tensors", self.compared),
                 ("values equal", self.values_equal), ("values differ", changed),
                 ("layout changes", sum(1 for t in self.tensors if t.changes)),
                 ("only in A", len(self.only_a)), ("only in B", len(self.only_b)),
                 ("plain values that differ", len(self.values)), ("wrapper prefix", self.prefix or "-")]
        return facts_table(f"{self.a} vs {self.b}", facts)

    @property
    def identical(self) -> bool:
        """True when nothing differs: same keys (no prefix difference), layouts, sharing and values (values within
        the tolerances count as equal; values not compared, counted in ``not_compared``, do not count as a
        difference; nor do properties a format cannot store, :attr:`TensorDiff.not_stored`, unless ``strict``)."""
        return not (self.prefix or self.only_a or self.only_b or self.values or self.shared
                    or any(t.changes or t.values == DIFFER or (self.strict and t.not_stored) for t in self.tensors))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict with ``"schema": "ckptool.diff/1"``; non-finite numbers and values that are not
        JSON types are written as their ``repr``."""
        def plain(v: object) -> object:
            if v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
                return v
            return repr(v)

        return {
            "schema": SCHEMA, "a": self.a, "b": self.b, "format_a": self.format_a, "format_b": self.format_b,
            "key_a": self.key_a, "key_b": self.key_b,
            "identical": self.identical, "mode": self.mode, "strict": self.strict, "rtol": self.rtol,
            "atol": self.atol,
            "prefix": self.prefix, "only_a": self.only_a, "only_b": self.only_b,
            "tensors": [{**t.__dict__, "max_abs": plain(t.max_abs), "max_rel": plain(t.max_rel)} for t in self.tensors],
            "values": [{"key": v.key, "key_b": v.key_b, "a": plain(v.a), "b": plain(v.b)} for v in self.values],
            "shared": self.shared, "compared": self.compared, "values_equal": self.values_equal,
            "plain_values": self.plain_values, "not_compared": self.not_compared, "notes": self.notes,
        }


# ------------------------------------------------------------------------------------------------ streaming values
def _read(t: SideTensor, files: Files, pos: int, n: int) -> bytes | bytearray:
    """``n`` bytes of ``t``'s storage from byte ``pos`` of its file (of its gathered storage, through its segments,
    :meth:`Files.storage_bytes`), byte-swapped when the file is big-endian.

    Raises:
        CorruptCheckpointError: a file ends first.
    """
    if t.gathered is not None:
        return files.storage_bytes(t.gathered, pos, n)
    assert t.path is not None
    data = files.read(t.path, pos, n)
    return byteswap(data, t.swap) if t.swap else data


def _chunks(t: SideTensor, files: Files, per: int) -> Iterator[bytes | bytearray]:
    """The elements of ``t`` in row-major order as bytes, ``per`` elements per chunk (the last may be shorter).

    Raises:
        CorruptCheckpointError: the view runs past its storage, or the file ends first.
    """
    assert t.path is not None
    es = element_size(t.dtype)
    shape, stride = t.shape, t.read_stride
    n = numel(shape)
    if n == 0:
        return
    lo, hi = span(t.offset, shape, stride)
    if len(stride) != len(shape) or min(stride, default=0) < 0 or lo < 0 or hi > t.limit:
        raise CorruptCheckpointError(f"{t.path}: a tensor view (offset {t.offset}, shape {list(shape)}, stride "
                                     f"{list(stride)}) runs past its storage of {t.limit} elements; the file is "
                                     "damaged")
    if is_contiguous(shape, stride):
        pos, left = t.base + lo * es, n * es
        while left:
            k = min(left, per * es)
            yield _read(t, files, pos, k)
            pos += k
            left -= k
        return
    span_bytes = _read(t, files, t.base + lo * es, (hi - lo) * es)  # the storage span, once
    if not isinstance(span_bytes, bytearray):
        span_bytes = bytearray(span_bytes)
    yield from gather(span_bytes, es, t.offset - lo, shape, stride, chunk=per * es)


def _compare_values(ta: SideTensor, tb: SideTensor, files: Files, rtol: float | None, atol: float | None,
                    d: TensorDiff, norms: dict[str, tuple[float, float]] | None = None) -> None:
    """Fill ``d.values`` (and the differences) for two tensors of the same shape; with ``norms``, also record
    ``(||A||**2, ||B - A||**2)`` under ``d.key`` (every chunk is then decoded, equal or not)."""
    tolerance = rtol is not None or atol is not None
    if ta.path is None or tb.path is None:
        d.values, d.note = NOT_COMPARED, ta.unread or tb.unread
        return
    if ta.dtype != tb.dtype and not tolerance:
        d.values, d.note = NOT_COMPARED, "dtypes differ: pass --rtol/--atol to compare by value"
        return
    numeric = is_numeric(ta.dtype) and is_numeric(tb.dtype)
    if ta.dtype != tb.dtype and not numeric:
        odd = ta.dtype if not is_numeric(ta.dtype) else tb.dtype
        d.values, d.note = NOT_COMPARED, f"{odd} cannot be compared by value"
        return
    tolerance = tolerance and numeric  # float8, quantized...: bit-exact
    per = max(1, min(CHUNK_ELEMENTS, CHUNK_BYTES // max(element_size(ta.dtype), element_size(tb.dtype))))
    stats: ValueStats | None = ValueStats() if numeric else None
    same_bytes = ta.dtype == tb.dtype
    measure = norms is not None and numeric
    sq_a = sq_d = 0.0
    for ca, cb in zip(_chunks(ta, files, per), _chunks(tb, files, per)):
        if measure:
            na, nd = squared_norms(ca, cb, ta.dtype, tb.dtype)
            sq_a, sq_d = sq_a + na, sq_d + nd
        if ca == cb and same_bytes:
            continue
        same_bytes = False
        if stats is None:
            break  # bit-exact and not decodable: that the bytes differ is all there is to say
        try:
            if tolerance:
                stats.update(ca, cb, ta.dtype, tb.dtype, rtol=rtol, atol=atol)
            else:
                stats.update(ca, cb, ta.dtype, tb.dtype)
        except ModuleNotFoundError:
            if tolerance:
                raise
            stats = None  # bit-exact mode without numpy: no figures
            break
    if measure and norms is not None:
        norms[d.key] = (sq_a, sq_d)
    if same_bytes:
        d.values = EQUAL
        d.max_abs, d.max_rel, d.mismatched = 0.0, 0.0, 0
        return
    if stats is not None:
        d.max_abs, d.max_rel, d.mismatched = stats.max_abs, stats.max_rel, stats.mismatched
    d.values = CLOSE if tolerance and stats is not None and stats.mismatched == 0 else DIFFER


# ------------------------------------------------------------------------------------------------ matching keys
def _match(keys_a: list[str], keys_b: list[str]) -> tuple[dict[str, str], str | None]:
    """``{key in B: key in A}`` for the keys that match after reconciling wrapper prefixes (renaming B's keys onto
    A's or A's onto B's, whichever matches more), and the sentence that says which side has which prefix (None when
    the keys match as they are)."""
    set_a, set_b = set(keys_a), set(keys_b)
    same = sum(k in set_a for k in keys_b)
    b_to_a, a_to_b = reconcile(keys_b, keys_a), reconcile(keys_a, keys_b)
    if b_to_a.changed and b_to_a.matched > same and b_to_a.matched >= a_to_b.matched:
        best = b_to_a
        pairs = {kb: ka for kb, ka in b_to_a.mapping.items() if ka in set_a}
        a_has, b_has = b_to_a.added, b_to_a.removed
    elif a_to_b.changed and a_to_b.matched > same:
        best = a_to_b
        pairs = {kb: ka for ka, kb in a_to_b.mapping.items() if kb in set_b}
        a_has, b_has = a_to_b.removed, a_to_b.added
    else:
        return {k: k for k in keys_b if k in set_a}, None
    renamed = sum(old != new for old, new in best.mapping.items())  # keys of the side renamed
    where = "every key" if renamed == len(best.mapping) else f"{renamed} of {len(best.mapping)} keys"
    has = [(who, ", ".join(f"`{c}`" for c in comps)) for who, comps in (("A", a_has), ("B", b_has)) if comps]
    if len(has) == 1:
        who, comps = has[0]
        return pairs, f"{who} has {comps} on {where}, {'B' if who == 'A' else 'A'} has none; keys matched without it"
    return pairs, f"A has {has[0][1]} and B has {has[1][1]} on {where}; keys matched without them"


def _layout_changes(ta: SideTensor, tb: SideTensor) -> tuple[list[str], list[str]]:
    """``(changes, not_stored)`` between two matched tensors (see :class:`TensorDiff`). A property that one side's
    format does not record (None) takes that format's implied value, the CPU and a contiguous layout: a side
    that records the same is no difference, one that records another is ``not stored`` in the first side."""
    out: list[str] = []
    lost: list[str] = []
    if ta.shape != tb.shape:
        out.append(f"shape {list(ta.shape)} -> {list(tb.shape)}")
    if ta.dtype != tb.dtype:
        out.append(f"dtype {ta.dtype} -> {tb.dtype}")
    if ta.device is not None and tb.device is not None:
        if ta.device != tb.device:
            out.append(f"device {ta.device} -> {tb.device}")
    elif ta.device not in (None, "cpu") or tb.device not in (None, "cpu"):
        lost.append(f"device {ta.device or tb.device} not stored in {'B' if tb.device is None else 'A'}")
    if ta.shape != tb.shape or numel(ta.shape) <= 1:
        return out, lost
    if ta.stride is not None and tb.stride is not None:
        if ta.stride != tb.stride:
            out.append(f"stride {list(ta.stride)} -> {list(tb.stride)}")
    else:
        kept = ta.stride if ta.stride is not None else tb.stride
        if kept is not None and kept != contiguous_stride(ta.shape):
            lost.append(f"stride {list(kept)} not stored in {'B' if tb.stride is None else 'A'}")
    return out, lost


def _sharing(pairs: dict[str, str], a: Side, b: Side) -> list[str]:
    """The differences in storage sharing among matched tensors (named by their A keys): one line per group of
    tensors that share a storage on one side and not, or not all, on the other."""
    members: list[dict[object, list[str]]] = [{}, {}]
    for kb, ka in pairs.items():
        members[0].setdefault(a.tensors[ka].group, []).append(ka)
        members[1].setdefault(b.tensors[kb].group, []).append(ka)
    group_of = [{k: frozenset(g) for g in m.values() for k in g} for m in members]
    lines: dict[str, None] = {}
    for i, (this, other) in enumerate((("A", "B"), ("B", "A"))):
        for g in members[i].values():
            if len(g) < 2:
                continue
            split = list(dict.fromkeys(group_of[1 - i][k] for k in g))
            if len(split) == 1:
                continue
            names = ", ".join(sorted(g))
            if all(len(s) == 1 for s in split):
                lines[f"{names} share a storage in {this} but not in {other}"] = None
            else:
                parts = " | ".join(", ".join(sorted(s & frozenset(g))) for s in split)
                lines[f"{names} share a storage in {this}; in {other}: {parts}"] = None
    return list(lines)


def _same_value(x: object, y: object) -> bool:
    if type(x) is not type(y):
        return False
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return bool(x == y)


# ------------------------------------------------------------------------------------------------ the operation
def _compare_pairs(side_a: Side, side_b: Side, pairs: dict[str, str], res: DiffResult,
                   tolerances: tuple[float | None, float | None], keys_only: bool, norms: bool) -> None:
    """Compare every matched tensor pair (``pairs``: key in B -> key in A), in A's order: layout, then values
    streamed from both files (unless ``keys_only`` or the shapes differ); fills ``res``."""
    rtol, atol = tolerances
    files = Files()
    try:
        position = {k: i for i, k in enumerate(side_a.tensors)}
        for kb, ka in sorted(pairs.items(), key=lambda p: position[p[1]]):
            ta, tb = side_a.tensors[ka], side_b.tensors[kb]
            changes, lost = _layout_changes(ta, tb)
            d = TensorDiff(ka, kb, changes, numel=numel(ta.shape), not_stored=lost)
            res.compared += 1
            if keys_only:
                d.values = NOT_COMPARED
                d.note = "--keys-only"
            elif ta.shape != tb.shape:
                d.values, d.note = NOT_COMPARED, "shapes differ"
            else:
                _compare_values(ta, tb, files, rtol, atol, d, res.norms if norms else None)
            if d.values in (EQUAL, CLOSE):
                res.values_equal += 1
            if d.changes or d.not_stored or d.values in (DIFFER, CLOSE):
                res.tensors.append(d)
    finally:
        files.close()


@gc_paused
def diff(a: str | os.PathLike[str] | Opened, b: str | os.PathLike[str] | Opened, *, rtol: float | None = None,
         atol: float | None = None, keys_only: bool = False, strict: bool = False,
         norms: bool = False, key: str | None = None) -> DiffResult:
    """Compare checkpoints ``a`` and ``b`` (any formats ckptool reads: torch zip, legacy, safetensors, sharded sets
    given by their ``*.index.json`` or folder, DCP folders, ``.pt2`` archives, DeepSpeed ZeRO folders: their
    consolidated fp32 state_dict as ``convert`` reads it) without torch and without loading either whole.

    Which part of a torch file is compared (:func:`ckptool.ops.diff.sides.choose_keys`): a training checkpoint
    against a bare state_dict (safetensors, sharded, DCP, DeepSpeed, a torch file holding only a state_dict) is
    compared through the state_dict ``convert`` selects in it (``key_a`` / ``key_b`` of the result; what else it
    holds is named in ``notes``); two torch files whose state_dicts sit at the same path are compared whole.
    ``key`` (a dotted path, ``--key``) selects the state_dict on each torch side where it resolves.

    Keys are matched after wrapper-prefix reconciliation (``module.``, ``_orig_mod.``..., reported once in
    ``prefix``); keys on one side only, and shape, dtype, saved device (location tag) and stride changes of the
    matched tensors are reported. A property that one side's format cannot store (safetensors records no device
    and no stride, a DCP folder neither) is no change: it is listed in :attr:`TensorDiff.not_stored` when the
    other side's value is not the one that format implies (the CPU, contiguous), and counts as a difference only
    with ``strict``. Also reported are differences in which tensors share a storage (tied weights, views) and
    in plain values (epoch, hyper-parameters; torch files only). Values are compared tensor by tensor, streamed
    in chunks of :data:`CHUNK_BYTES`: bit-exact by default (with numpy installed, a tensor that differs also gets
    its greatest absolute and relative differences and the count of differing elements); with ``rtol`` / ``atol``
    (either one; the other is then 0) an element of B is close when ``|b - a| <= atol + rtol * |a|``, as
    ``torch.testing.assert_close(actual=b, expected=a)`` decides, and tensors of different dtypes are compared by
    value. ``keys_only`` skips values. Sources: ``torch.testing.assert_close`` for the tolerances, GNU ``diff`` for
    the equal / different outcome. ``norms`` (needs numpy) also records, per matched numeric tensor pair of equal
    shapes, ``||A||**2`` and ``||B - A||**2`` in :attr:`DiffResult.norms` (every element of both is then decoded).

    Returns a :class:`DiffResult` (``identical`` is True when nothing differs).

    Raises:
        UsageError: a negative tolerance, tolerances with ``keys_only``, a path that is missing or not a
            checkpoint set (see :func:`ckptool.ops.inspect.entry.inspect`), a ``key`` that resolves on neither side.
        NotACheckpointError / CorruptCheckpointError / UnsupportedError: a side cannot be read (see
            :func:`ckptool.ops.inspect.entry.inspect` and ``convert``'s readers).
        ModuleNotFoundError: tolerances given and numpy is not installed.
    """
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if tol is not None and not (tol >= 0 and math.isfinite(tol)):
            raise UsageError(f"--{name} must be a finite number >= 0, not {tol}")
    if keys_only and (rtol is not None or atol is not None):
        raise UsageError("--keys-only skips values: it cannot be combined with --rtol / --atol")
    tolerance = rtol is not None or atol is not None
    if tolerance or norms:
        require_numpy()  # fail before reading anything

    side_a, side_b, key_a, key_b = read_pair(a if isinstance(a, Opened) else os.fspath(a),
                                             b if isinstance(b, Opened) else os.fspath(b), key)
    mode = "keys-only" if keys_only else "tolerance" if tolerance else "exact"
    res = DiffResult(side_a.path, side_b.path, side_a.format, side_b.format, mode,
                     rtol=(rtol or 0.0) if tolerance else None, atol=(atol or 0.0) if tolerance else None,
                     strict=strict, key_a=key_a, key_b=key_b)
    res.notes += side_a.notes + side_b.notes
    pairs, res.prefix = _match(list(side_a.tensors), list(side_b.tensors))
    matched_a = set(pairs.values())
    value_pairs = {k: k for k in side_b.values if k in side_a.values}
    res.only_a = [k for k in side_a.tensors if k not in matched_a] + [k for k in side_a.values if k not in value_pairs]
    res.only_b = [k for k in side_b.tensors if k not in pairs] + [k for k in side_b.values if k not in value_pairs]
    res.plain_values = len(value_pairs)
    for kb, ka in value_pairs.items():
        va, vb = side_a.values[ka], side_b.values[kb]
        if va is not UNREAD and vb is not UNREAD and not _same_value(va, vb):
            res.values.append(ValueDiff(ka, kb, va, vb))
    _compare_pairs(side_a, side_b, pairs, res, (rtol, atol), keys_only, norms)
    res.shared = _sharing(pairs, side_a, side_b)
    unread = sum(1 for kb, ka in pairs.items() if side_a.tensors[ka].path is None or side_b.tensors[kb].path is None)
    res.not_compared = res.compared - res.values_equal - sum(t.values == DIFFER for t in res.tensors)
    if unread and not keys_only:
        res.notes.append(f"values of {unread} tensor(s) were not compared: "
                         + next(side_a.tensors[ka].unread or side_b.tensors[kb].unread for kb, ka in pairs.items()
                                if side_a.tensors[ka].path is None or side_b.tensors[kb].path is None))
    return res
