"""``ckptool.diff``: what changed between two checkpoints, of any formats ckptool reads, streamed tensor by tensor.

Each side is opened once through the readers layer and read by the readers the other operations use, without torch
(:mod:`ckptool.ops.diff.sides`: a torch file compared whole through :meth:`ckptool.readers.Opened.all_tensors`,
safetensors, sharded sets, ``.pt2`` archives, DeepSpeed ZeRO folders, DCP folders and a selected state_dict through
:meth:`ckptool.readers.Opened.state_dict`): every tensor is the readers' :class:`~ckptool.formats.tensors.Tensor`,
its bytes read where its :class:`~ckptool.formats.tensors.Storage` says (:func:`ckptool.readers.data.read_range`).
A training checkpoint against a bare state_dict is compared through the state_dict ``convert`` picks in it.

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
from dataclasses import dataclass, replace

from ckptool._gc import gc_paused
from ckptool.errors import CorruptCheckpointError, UsageError
from ckptool.formats.dtypes import contiguous_stride, element_size, numel
from ckptool.formats.tensors import Tensor, is_contiguous
from ckptool.model.keys import WRAPPER_ONLY_COMPONENTS, reconcile
from ckptool.ops.diff.quantized import dequantize_side
from ckptool.ops.diff.result import CLOSE, DIFFER, EQUAL, NOT_COMPARED, DiffResult, KeyDiff, ValueDiff
from ckptool.ops.diff.sides import UNREAD, Side, read_pair, readable
from ckptool.readers import Opened
from ckptool.readers.budget import check_expansion
from ckptool.readers.data import FileRanges, read_range
from ckptool.readers.structures import gather
from ckptool.torch_ops.cast import dequantized, tensor_buffer
from ckptool.torch_ops.value_stats import ValueStats, is_numeric, require_numpy, squared_norms

#: bytes of each side read at a time when comparing values (a strided view reads its storage's span instead)
CHUNK_BYTES = 4 << 20
#: why a quantized weight is not compared bit-exact (its dequantized values need torch and tolerances)
QUANTIZED_NOTE = "quantized: pass --rtol/--atol to compare its dequantized values"
#: the dtypes ``convert --dtype`` dequantizes to: a quantized weight compared by value against one is rounded to it
_DEQUANTIZED_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: the most elements compared at a time (bounds numpy's float64 temporaries in tolerance mode)
CHUNK_ELEMENTS = 128 << 10

# ------------------------------------------------------------------------------------------------ streaming values
def _chunks(t: Tensor, files: FileRanges, per: int) -> Iterator[bytes | bytearray]:
    """The elements of ``t`` (a :func:`~ckptool.ops.diff.sides.readable` tensor: its storage a byte range or
    ``segments``) in row-major order as bytes, ``per`` elements per chunk (the last may be shorter), read through
    :func:`ckptool.readers.data.read_range` (byte-swapped or gathered as its storage says).

    Raises:
        CorruptCheckpointError: the view runs past its storage, or the file ends first.
    """
    st = t.storage
    es = element_size(t.dtype)
    shape, stride = t.shape, t.stride
    n = numel(shape)
    if n == 0:
        return
    if st.scaled is not None:  # a quantized weight: its values dequantized (torch), rounded once to ``t.dtype``
        values = tensor_buffer(dequantized(st.scaled, files.read, t.dtype)[0])
        for pos in range(0, n * es, per * es):
            yield bytes(values[pos:pos + per * es])
        return
    lo, hi = t.span
    limit = st.nbytes // es
    if len(stride) != len(shape) or min(stride, default=0) < 0 or lo < 0 or hi > limit:
        raise CorruptCheckpointError(f"{st.path}: a tensor view (offset {t.offset}, shape {list(shape)}, stride "
                                     f"{list(stride)}) runs past its storage of {limit} elements; the file is "
                                     "damaged")
    if is_contiguous(shape, stride):
        pos, left = lo * es, n * es
        while left:
            k = min(left, per * es)
            yield read_range(st, pos, k, files.read)
            pos += k
            left -= k
        return
    span_bytes = read_range(st, lo * es, (hi - lo) * es, files.read)  # the storage span, once
    if not isinstance(span_bytes, bytearray):
        span_bytes = bytearray(span_bytes)
    yield from gather(span_bytes, es, t.offset - lo, shape, stride, chunk=per * es)


def _not_comparable(dtype_a: str, dtype_b: str, tolerance: bool) -> str:
    """Why two tensors of the same shape cannot be compared by value (``""``: they can)."""
    if dtype_a == dtype_b:
        return ""
    if not tolerance:
        return "dtypes differ: pass --rtol/--atol to compare by value"
    if not (is_numeric(dtype_a) and is_numeric(dtype_b)):
        return f"{dtype_a if not is_numeric(dtype_a) else dtype_b} cannot be compared by value"
    return ""


@dataclass
class _Streamed:
    """What streaming two tensors' elements found: whether every byte is equal, the element statistics (None:
    not decodable, or numpy missing in bit-exact mode) and the squared norms ``||A||**2``, ``||B - A||**2``."""

    same_bytes: bool
    stats: ValueStats | None
    sq_a: float = 0.0
    sq_d: float = 0.0


def _stream(ta: Tensor, tb: Tensor, files: FileRanges, tolerances: tuple[float | None, float | None] | None,
            measure: bool) -> _Streamed:
    """Compare the elements of ``ta`` and ``tb`` (same shape) chunk by chunk; ``tolerances`` ``(rtol, atol)``, or
    None for bit-exact; ``measure``: also sum the squared norms (every chunk is then decoded, equal or not)."""
    numeric = is_numeric(ta.dtype) and is_numeric(tb.dtype)
    rtol, atol = tolerances or (None, None)
    per = max(1, min(CHUNK_ELEMENTS, CHUNK_BYTES // max(element_size(ta.dtype), element_size(tb.dtype))))
    out = _Streamed(ta.dtype == tb.dtype, ValueStats() if numeric else None)
    for ca, cb in zip(_chunks(ta, files, per), _chunks(tb, files, per)):
        if measure:
            na, nd = squared_norms(ca, cb, ta.dtype, tb.dtype)
            out.sq_a, out.sq_d = out.sq_a + na, out.sq_d + nd
        if ca == cb and out.same_bytes:
            continue
        out.same_bytes = False
        if out.stats is None:
            break  # bit-exact and not decodable: that the bytes differ is all there is to say
        try:
            out.stats.update(ca, cb, ta.dtype, tb.dtype, rtol=rtol, atol=atol)
        except ModuleNotFoundError:
            if tolerances is not None:
                raise
            out.stats = None  # bit-exact mode without numpy: no figures
            break
    return out


def _compare_values(ta: Tensor, tb: Tensor, files: FileRanges, rtol: float | None, atol: float | None,
                    d: KeyDiff, norms: dict[str, tuple[float, float]] | None = None) -> None:
    """Fill ``d.values`` (and the differences) for two readable tensors of the same shape
    (:func:`~ckptool.ops.diff.sides.readable`); with ``norms``, also record ``(||A||**2, ||B - A||**2)`` under
    ``d.key`` (every chunk is then decoded, equal or not)."""
    tolerance = rtol is not None or atol is not None
    note = _not_comparable(ta.dtype, tb.dtype, tolerance)
    if note:
        d.values, d.note = NOT_COMPARED, note
        return
    numeric = is_numeric(ta.dtype) and is_numeric(tb.dtype)
    tolerance = tolerance and numeric  # float8, quantized...: bit-exact
    res = _stream(ta, tb, files, (rtol, atol) if tolerance else None, norms is not None and numeric)
    if norms is not None and numeric:
        norms[d.key] = (res.sq_a, res.sq_d)
    if res.same_bytes:
        d.values = EQUAL
        d.max_abs, d.max_rel, d.mismatched = 0.0, 0.0, 0
        return
    if res.stats is not None:
        d.max_abs, d.max_rel, d.mismatched = res.stats.max_abs, res.stats.max_rel, res.stats.mismatched
    d.values = CLOSE if tolerance and res.stats is not None and res.stats.mismatched == 0 else DIFFER


def _dequantized_as(ta: Tensor, tb: Tensor, tolerance: bool) -> tuple[Tensor, Tensor]:
    """The pair as compared when a side's tensor is a quantized weight (:mod:`ckptool.ops.diff.quantized`): with
    tolerances, its values rounded once to the other side's dtype (a float dtype ``convert --dtype`` writes), as
    ``convert`` computes them; bit-exact, its stored dtype (a layout change) and values not compared."""
    def as_(t: Tensor, other: Tensor) -> Tensor:
        sc = t.storage.scaled
        if sc is None:
            return t
        if tolerance and other.dtype in _DEQUANTIZED_DTYPES and other.storage.scaled is None:
            return replace(t, dtype=other.dtype)
        return replace(t, dtype=sc.weight.dtype)

    return as_(ta, tb), as_(tb, ta)


def _as_stored(t: Tensor) -> bool:
    """True for a quantized weight left in its stored dtype by :func:`_dequantized_as` (its values not computed)."""
    return t.storage.scaled is not None and t.dtype == t.storage.scaled.weight.dtype


# ------------------------------------------------------------------------------------------------ matching keys
def _carrying(comp: str, keys: list[str]) -> int:
    """How many of ``keys`` carry the dotted components ``comp`` (``"module."``): at the front, or for a
    component only wrappers use (``_checkpoint_wrapped_module.``) anywhere between dots."""
    if comp.split(".")[0] in WRAPPER_ONLY_COMPONENTS:
        return sum(f".{comp}" in f".{k}" for k in keys)
    return sum(k.startswith(comp) for k in keys)


def _on(comps: list[str], keys: list[str]) -> str:
    """```module.` on every key`` / ```module.` on 7 of 11 keys``, each component counted in ``keys``."""
    parts = []
    for c in comps:
        n = _carrying(c, keys)
        parts.append(f"`{c}` on " + ("every key" if n == len(keys) else f"{n} of {len(keys)} keys"))
    return " and ".join(parts)


def _match(keys_a: list[str], keys_b: list[str]) -> tuple[dict[str, str], str | None, list[str]]:
    """``{key in B: key in A}`` for the keys that match after reconciling wrapper prefixes (renaming B's keys onto
    A's or A's onto B's, whichever matches more), the sentence that says which side has which prefix on how many
    of its keys (counted in the keys themselves; None when the keys match as they are) and those prefixes."""
    set_a, set_b = set(keys_a), set(keys_b)
    same = sum(k in set_a for k in keys_b)
    b_to_a, a_to_b = reconcile(keys_b, keys_a), reconcile(keys_a, keys_b)
    if b_to_a.changed and b_to_a.matched > same and b_to_a.matched >= a_to_b.matched:
        pairs = {kb: ka for kb, ka in b_to_a.mapping.items() if ka in set_a}
        a_has, b_has = b_to_a.added, b_to_a.removed
    elif a_to_b.changed and a_to_b.matched > same:
        pairs = {kb: ka for ka, kb in a_to_b.mapping.items() if kb in set_b}
        a_has, b_has = a_to_b.removed, a_to_b.added
    else:
        return {k: k for k in keys_b if k in set_a}, None, []
    has = [(who, _on(comps, keys)) for who, comps, keys in (("A", a_has, keys_a), ("B", b_has, keys_b)) if comps]
    comps = list(dict.fromkeys(a_has + b_has))
    if len(has) == 1:
        who, on = has[0]
        return pairs, f"{who} has {on}, {'B' if who == 'A' else 'A'} has none; keys matched without it", comps
    return pairs, f"A has {has[0][1]} and B has {has[1][1]}; keys matched without them", comps


def _device_changes(da: str | None, db: str | None) -> tuple[list[str], list[str]]:
    """``(changes, not_stored)`` of the saved devices ``da`` / ``db`` (None: the format records none)."""
    if da is not None and db is not None:
        return ([f"device {da} -> {db}"] if da != db else []), []
    if da not in (None, "cpu") or db not in (None, "cpu"):
        return [], [f"device {da or db} not stored in {'B' if db is None else 'A'}"]
    return [], []


def _stride_changes(shape: tuple[int, ...], sa: tuple[int, ...] | None, sb: tuple[int, ...] | None
                    ) -> tuple[list[str], list[str]]:
    """``(changes, not_stored)`` of the recorded strides ``sa`` / ``sb`` of a tensor of ``shape`` on both sides
    (None: the format records none, the tensor is contiguous)."""
    if sa is not None and sb is not None:
        return ([f"stride {list(sa)} -> {list(sb)}"] if sa != sb else []), []
    kept = sa if sa is not None else sb
    if kept is not None and kept != contiguous_stride(shape):
        return [], [f"stride {list(kept)} not stored in {'B' if sb is None else 'A'}"]
    return [], []


def _layout_changes(a: Side, ta: Tensor, b: Side, tb: Tensor) -> tuple[list[str], list[str]]:
    """``(changes, not_stored)`` between two matched tensors (see :class:`KeyDiff`). A property that one side's
    format does not record (:meth:`Side.device`, :meth:`Side.stride`: None) takes that format's implied value,
    the CPU and a contiguous layout: a side that records the same is no difference, one that records another is
    ``not stored`` in the first side."""
    out: list[str] = []
    if ta.shape != tb.shape:
        out.append(f"shape {list(ta.shape)} -> {list(tb.shape)}")
    if ta.dtype != tb.dtype:
        out.append(f"dtype {ta.dtype} -> {tb.dtype}")
    changes, lost = _device_changes(a.device(ta), b.device(tb))
    out += changes
    if ta.shape != tb.shape or numel(ta.shape) <= 1:
        return out, lost
    changes, lost_stride = _stride_changes(ta.shape, a.stride(ta), b.stride(tb))
    return out + changes, lost + lost_stride


def _sharing(pairs: dict[str, str], a: Side, b: Side) -> list[str]:
    """The differences in storage sharing among matched tensors (named by their A keys): one line per group of
    tensors that share a storage on one side and not, or not all, on the other."""
    members: list[dict[object, list[str]]] = [{}, {}]
    for kb, ka in pairs.items():
        members[0].setdefault(a.tensors[ka].storage, []).append(ka)
        members[1].setdefault(b.tensors[kb].storage, []).append(ka)
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


def _shared_differences(pairs: dict[str, str], a: Side, b: Side, res: DiffResult) -> None:
    """Set ``res.shared`` (:func:`_sharing`); when a side's format cannot store sharing (:attr:`Side.stores_sharing`)
    that is no difference (a note says so) unless ``res.strict``, as for the other properties a format cannot
    store."""
    res.shared = _sharing(pairs, a, b)
    lost = [(s, side.format) for s, side in (("A", a), ("B", b)) if not side.stores_sharing]
    if res.shared and lost and not res.strict:
        res.notes.append(f"storage sharing is not stored in {' or '.join(f'{s} ({f})' for s, f in lost)}: "
                         f"{len(res.shared)} group(s) shared on the other side not compared")
        res.shared = []


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
    streamed from both files (unless ``keys_only``, the shapes differ, or a side's values are not read); fills
    ``res``."""
    rtol, atol = tolerances
    tolerance = rtol is not None or atol is not None
    position = {k: i for i, k in enumerate(side_a.tensors)}
    with FileRanges() as files:
        for kb, ka in sorted(pairs.items(), key=lambda p: position[p[1]]):
            ta, tb = _dequantized_as(side_a.tensors[ka], side_b.tensors[kb], tolerance)
            changes, lost = _layout_changes(side_a, ta, side_b, tb)
            d = KeyDiff(ka, kb, changes, numel=numel(ta.shape), not_stored=lost)
            res.compared += 1
            ra, rb = readable(ta), readable(tb)
            if keys_only:
                d.values, d.note = NOT_COMPARED, "--keys-only"
            elif ta.shape != tb.shape:
                d.values, d.note = NOT_COMPARED, "shapes differ"
            elif ka in side_a.unread or kb in side_b.unread or ra is None or rb is None:
                d.values, d.note = NOT_COMPARED, side_a.unread.get(ka) or side_b.unread.get(kb, "")
            elif _as_stored(ta) or _as_stored(tb):
                d.values, d.note = NOT_COMPARED, (QUANTIZED_NOTE if not tolerance
                                                  else "a quantized weight against one not dequantized")
            else:
                _compare_values(ra, rb, files, rtol, atol, d, res.norms if norms else None)
            if d.values in (EQUAL, CLOSE):
                res.values_equal += 1
            if d.changes or d.not_stored or d.values in (DIFFER, CLOSE):
                res.tensors.append(d)


def _check_options(rtol: float | None, atol: float | None, keys_only: bool, norms: bool) -> None:
    """Refuse bad tolerances before anything is read; with tolerances or ``norms``, numpy must be installed.

    Raises:
        UsageError: a negative or non-finite tolerance, tolerances with ``keys_only``.
        ModuleNotFoundError: numpy is missing.
    """
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if tol is not None and not (tol >= 0 and math.isfinite(tol)):
            raise UsageError(f"--{name} must be a finite number >= 0, not {tol}")
    if keys_only and (rtol is not None or atol is not None):
        raise UsageError("--keys-only skips values: it cannot be combined with --rtol / --atol")
    if rtol is not None or atol is not None or norms:
        require_numpy()  # fail before reading anything


def _match_keys(side_a: Side, side_b: Side, res: DiffResult) -> dict[str, str]:
    """Match the two sides' keys: fills ``res.prefix``, ``only_a`` / ``only_b``, ``plain_values`` and the plain
    ``values`` that differ; returns the matched tensors (key in B -> key in A)."""
    pairs, res.prefix, res.prefixes = _match(list(side_a.tensors), list(side_b.tensors))
    matched_a = set(pairs.values())
    value_pairs = {k: k for k in side_b.values if k in side_a.values}
    res.only_a = [k for k in side_a.tensors if k not in matched_a] + [k for k in side_a.values if k not in value_pairs]
    res.only_b = [k for k in side_b.tensors if k not in pairs] + [k for k in side_b.values if k not in value_pairs]
    res.plain_values = len(value_pairs)
    for kb, ka in value_pairs.items():
        va, vb = side_a.values[ka], side_b.values[kb]
        if va is not UNREAD and vb is not UNREAD and not _same_value(va, vb):
            res.values.append(ValueDiff(ka, kb, va, vb))
    return pairs


def _unread_note(side_a: Side, side_b: Side, pairs: dict[str, str]) -> str | None:
    """The note naming how many matched tensors' values were not read and why (the first reason), else None."""
    why = [side_a.unread.get(ka) or side_b.unread.get(kb) or "a view of a shared storage that no stored tensor holds"
           for kb, ka in pairs.items()
           if ka in side_a.unread or kb in side_b.unread
           or readable(side_a.tensors[ka]) is None or readable(side_b.tensors[kb]) is None]
    return f"values of {len(why)} tensor(s) were not compared: {why[0]}" if why else None


@gc_paused
def diff(a: str | os.PathLike[str] | Opened, b: str | os.PathLike[str] | Opened, *, rtol: float | None = None,
         atol: float | None = None, keys_only: bool = False, strict: bool = False,
         norms: bool = False, key: str | None = None, max_expand: float | None = None) -> DiffResult:
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
    and no stride, a DCP folder neither) is no change: it is listed in :attr:`KeyDiff.not_stored` when the
    other side's value is not the one that format implies (the CPU, contiguous), and counts as a difference only
    with ``strict``. Also reported are differences in which tensors share a storage (tied weights, views) and
    in plain values (epoch, hyper-parameters; torch files only). Values are compared tensor by tensor, streamed
    in chunks of :data:`CHUNK_BYTES`: bit-exact by default (with numpy installed, a tensor that differs also gets
    its greatest absolute and relative differences and the count of differing elements); with ``rtol`` / ``atol``
    (either one; the other is then 0) an element of B is close when ``|b - a| <= atol + rtol * |a|``, as
    ``torch.testing.assert_close(actual=b, expected=a)`` decides, and tensors of different dtypes are compared by
    value. A quantized side (FP8, MXFP4) against one without its scales is compared as ``convert --dtype``
    dequantizes it (:mod:`ckptool.ops.diff.quantized`; with tolerances its values are computed with torch).
    ``keys_only`` skips values. Sources: ``torch.testing.assert_close`` for the tolerances, GNU ``diff`` for
    the equal / different outcome. ``norms`` (needs numpy) also records, per matched numeric tensor pair of equal
    shapes, ``||A||**2`` and ``||B - A||**2`` in :attr:`DiffResult.norms` (every element of both is then decoded).
    Unless ``keys_only``, each side's tensors are held to ``max_expand`` (:mod:`ckptool.readers.budget`: a view
    that repeats its storage's elements, as ``expand()`` saves, is compared element by element, so the dense
    bytes of a side may be at most that many times what its storages hold; None: the default factor).

    Returns a :class:`DiffResult` (``identical`` is True when nothing differs).

    Raises:
        UsageError: a negative tolerance, tolerances with ``keys_only``, a path that is missing or not a
            checkpoint set (see :func:`ckptool.readers.open_checkpoint`), a ``key`` that resolves on neither side.
        NotACheckpointError / CorruptCheckpointError / UnsupportedError: a side cannot be read (see
            :func:`ckptool.readers.open_checkpoint` and ``convert``'s readers; a plain pickle), or its tensors are
            over the ``max_expand`` budget.
        ModuleNotFoundError: tolerances given and numpy is not installed.
    """
    _check_options(rtol, atol, keys_only, norms)
    tolerance = rtol is not None or atol is not None
    side_a, side_b, key_a, key_b = read_pair(a if isinstance(a, Opened) else os.fspath(a),
                                             b if isinstance(b, Opened) else os.fspath(b), key)
    if not keys_only:
        for side in (side_a, side_b):
            check_expansion(side.tensors.values(), max_expand, side.path, "compare")
    mode = "keys-only" if keys_only else "tolerance" if tolerance else "exact"
    res = DiffResult(side_a.path, side_b.path, side_a.format, side_b.format, mode,
                     rtol=(rtol or 0.0) if tolerance else None, atol=(atol or 0.0) if tolerance else None,
                     strict=strict, key_a=key_a, key_b=key_b)
    res.notes += side_a.notes + side_b.notes
    res.notes += dequantize_side(side_a.tensors, side_a.path, side_b.tensors, side_a.format)
    res.notes += dequantize_side(side_b.tensors, side_b.path, side_a.tensors, side_b.format)
    pairs = _match_keys(side_a, side_b, res)
    _compare_pairs(side_a, side_b, pairs, res, (rtol, atol), keys_only, norms)
    _shared_differences(pairs, side_a, side_b, res)
    res.not_compared = res.compared - res.values_equal - sum(t.values == DIFFER for t in res.tensors)
    note = None if keys_only else _unread_note(side_a, side_b, pairs)
    if note:
        res.notes.append(note)
    return res
