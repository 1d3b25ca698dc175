"""What ``ckptool diff`` found (:class:`DiffResult`, one :class:`KeyDiff` per matched tensor, :class:`ValueDiff`
per plain value), its JSON (:meth:`DiffResult.to_dict`) and its text (:func:`diff_text`, also ``str(result)``): the
lines the command prints, the closing summary counted from the rows so that it cannot contradict them. The
comparison itself is :func:`ckptool.ops.diff.compare.diff`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ckptool.model.notebook import facts_table

SCHEMA = "ckptool.diff/2"

EQUAL, CLOSE, DIFFER, NOT_COMPARED = "equal", "close", "differ", "not compared"


@dataclass
class KeyDiff:
    """One row of a diff (not a tensor model: the tensors are the readers' :class:`~ckptool.formats.tensors.Tensor`;
    called ``TensorDiff`` before issue 35): a key whose tensor is present in both checkpoints and differs: ``key``
    in A (``key_b`` in B), ``changes`` in shape, dtype, saved device or stride (``"dtype float32 -> float16"``),
    ``not_stored`` the properties one side holds that the other side's format cannot store (``"device cuda:0 not
    stored in B"`` for a safetensors B, ``"stride [1, 6] not stored in B"``: safetensors stores every tensor
    contiguous; counted as differences only with ``strict``), ``values`` one of ``equal`` (bit-exact), ``close``
    (within the tolerances), ``differ`` or ``not compared`` (``note`` says why). ``max_abs`` / ``max_rel`` are the
    greatest absolute / relative differences (``|b - a| / |a|``) and ``mismatched`` the number of elements that
    differ (bit-exact mode) or are not close (tolerance mode), out of ``numel``; None where they were not measured
    (without numpy, bit-exact mode only says that the bytes differ)."""

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
    matched tensors that differ, and in tolerance mode those close but not bit-identical (:class:`KeyDiff`),
    ``values`` the plain values that differ, ``shared`` the
    differences in storage sharing (tied weights, views). ``compared`` counts matched tensors, ``values_equal``
    those whose values are equal or close. ``mode`` is ``exact``, ``tolerance`` or ``keys-only``. ``strict``:
    the properties a side's format cannot store (:attr:`KeyDiff.not_stored`) count as differences.
    """

    a: str
    b: str
    format_a: str
    format_b: str
    mode: str
    rtol: float | None = None
    atol: float | None = None
    prefix: str | None = None
    #: the wrapper prefixes the keys differ by (``["module."]``), each once; empty when they match as they are
    prefixes: list[str] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    tensors: list[KeyDiff] = field(default_factory=list)
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
        difference; nor do properties a format cannot store, :attr:`KeyDiff.not_stored`, unless ``strict``)."""
        return not (self.prefix or self.only_a or self.only_b or self.values or self.shared
                    or any(t.changes or t.values == DIFFER or (self.strict and t.not_stored) for t in self.tensors))

    def _key_differences(self) -> list[str]:
        """The phrases of :meth:`differences` about keys: the wrapper prefixes, the keys on one side only."""
        out = []
        if self.prefix:
            named = " and ".join(f"`{c}`" for c in self.prefixes)
            out.append("keys differ by " + (f"a {named} prefix" if len(self.prefixes) == 1 else
                                            f"the prefixes {named}" if self.prefixes else "a wrapper prefix"))
        only = [(len(k), who) for who, k in (("A", self.only_a), ("B", self.only_b)) if k]
        if only:
            out.append(", ".join(f"{_count(n, 'key') if i == 0 else n} only in {who}"
                                 for i, (n, who) in enumerate(only)))
        return out

    def differences(self) -> list[str]:
        """What makes A and B differ, one phrase each, counted from the result itself (empty when
        :attr:`identical`): the wrapper prefixes the keys differ by, the keys on one side only, the tensors whose
        shape, dtype, saved device or stride changed, those whose values differ, the plain values that differ,
        the sharing that differs and, with ``strict``, the properties one format cannot store."""
        out = self._key_differences()
        kinds: dict[str, int] = {}
        for t in self.tensors:
            for what in dict.fromkeys(c.split(" ", 1)[0] for c in t.changes):
                kinds[what] = kinds.get(what, 0) + 1
        out += [f"{_count(n, 'tensor')} change{'s' if n == 1 else ''} {what}" for what, n in kinds.items()]
        differ = sum(t.values == DIFFER for t in self.tensors)
        if differ:
            out.append(f"values differ in {_count(differ, 'tensor')}")
        if self.values:
            out.append(f"{_count(len(self.values), 'plain value')} differ{'s' if len(self.values) == 1 else ''}")
        if self.shared:
            out.append(f"storage sharing differs ({_count(len(self.shared), 'group')})")
        lost = sum(bool(t.not_stored) for t in self.tensors) if self.strict else 0
        if lost:
            out.append(f"{_count(lost, 'tensor')} hold{'s' if lost == 1 else ''} what the other format cannot "
                       "store (--strict)")
        return out

    def __str__(self) -> str:
        """The text ``ckptool diff`` prints (:func:`diff_text`)."""
        return diff_text(self)

    def summary(self) -> str:
        """The line that closes ``ckptool diff``: ``identical: `` or ``different: `` and what differs
        (:meth:`differences`), then how many matched tensors are equal (``11 of 11 matched tensors equal
        (bit-exact)``); every figure is counted from the rows, so the line cannot contradict them."""
        if self.mode == "keys-only":
            counted = f"{self.compared} tensors matched (values not compared)"
        else:
            how = "bit-exact" if self.mode == "exact" else f"within rtol={self.rtol:g}, atol={self.atol:g}"
            counted = f"{self.values_equal} of {self.compared} matched tensors equal ({how})"
            if self.not_compared:
                counted += f", {self.not_compared} not compared"
        if self.plain_values:
            counted += f", {_count(self.plain_values, 'plain value')} compared"
        if self.identical:
            return f"identical: {counted}"
        return f"different: {'; '.join([*self.differences(), counted])}"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict with ``"schema": "ckptool.diff/2"``; non-finite numbers and values that are not
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
            "prefix": self.prefix, "prefixes": self.prefixes, "summary": self.summary(),
            "only_a": self.only_a, "only_b": self.only_b,
            "tensors": [{**t.__dict__, "max_abs": plain(t.max_abs), "max_rel": plain(t.max_rel)} for t in self.tensors],
            "values": [{"key": v.key, "key_b": v.key_b, "a": plain(v.a), "b": plain(v.b)} for v in self.values],
            "shared": self.shared, "compared": self.compared, "values_equal": self.values_equal,
            "plain_values": self.plain_values, "not_compared": self.not_compared, "notes": self.notes,
        }


def _count(n: int, word: str) -> str:
    """``1 tensor`` / ``2 tensors``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def _number(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


def _not_stored_lines(res: DiffResult) -> list[str]:
    """One line per property and side for :attr:`KeyDiff.not_stored` (``"72 tensors: device
    cuda:0 in A, not stored in B (safetensors)"``), saying whether it counts (``--strict``)."""
    lost: dict[tuple[str, str], Counter[str]] = {}
    for t in res.tensors:
        for entry in t.not_stored:  # "device cuda:0 not stored in B", "stride [1, 6] not stored in B"
            what, side = entry.rsplit(" not stored in ", 1)
            prop, value = what.split(" ", 1)
            lost.setdefault((prop, side), Counter())[value] += 1
    counted = "counted (--strict)" if res.strict else "not counted as a difference (--strict counts it)"
    lines = []
    for (prop, side), values in lost.items():
        n = sum(values.values())
        other, fmt = ("A", res.format_b) if side == "B" else ("B", res.format_a)
        shown = ", ".join(values) if len(values) <= 3 else f"({len(values)} different)"
        what = f"non-contiguous stride {shown}" if prop == "stride" else f"{prop} {shown}"
        lines.append(f"{_tensors(n)}: {what} in {other}, not stored in {side} ({fmt}): {counted}")
    return lines


def _tensors(n: int) -> str:
    return f"{n} tensor{'' if n == 1 else 's'}"


def _folded_lines(res: DiffResult, out: list[str]) -> set[str]:
    """Add to ``out`` every change repeated over several tensors as one summary line (``"72 tensors: device cuda:0 ->
    cpu"``) and every property a format cannot store (:func:`_not_stored_lines`); return the changes folded. A
    shape change is never folded: its tensor's values are not compared, so it has a row, which shows it."""
    counts = Counter(c for t in res.tensors for c in t.changes if not c.startswith("shape "))
    repeated = {c for c, n in counts.items() if n > 1}
    for c, n in counts.items():
        if n > 1:
            out.append(f"{_tensors(n)}: {c}")
    out += _not_stored_lines(res)
    return repeated


def _row(t: KeyDiff, changes: list[str]) -> tuple[str, ...]:
    """One table row: key (``A / B`` when renamed), changes, values verdict, max abs, max rel, mismatched."""
    return (t.key if t.key == t.key_b else f"{t.key} / {t.key_b}", "; ".join(changes) or "-",
            t.values + (f" ({t.note})" if t.note else ""), _number(t.max_abs), _number(t.max_rel),
            "-" if t.mismatched is None else f"{t.mismatched}/{t.numel}")


def _tensor_lines(res: DiffResult, verbose: bool, out: list[str]) -> None:
    """The tensors that differ: one row each with ``verbose``; else every change repeated over several tensors
    (and every property a format cannot store) as one summary line, and rows only for what is left (a shape
    change is never folded: it stays in its row)."""
    from tabulate import tabulate

    repeated = set() if verbose else _folded_lines(res, out)
    rows = []
    for t in res.tensors:
        changes = [c for c in t.changes if c not in repeated] + (t.not_stored if verbose else [])
        if verbose or changes or t.values != EQUAL:
            rows.append(_row(t, changes))
    if rows:
        out.append(tabulate(rows, headers=["tensor", "changes", "values", "max abs", "max rel", "mismatched"]))


def diff_text(res: DiffResult, verbose: bool = False) -> str:
    """The text ``ckptool diff`` prints for ``res`` (``verbose``: one row per tensor, as ``--verbose``): both sides,
    the prefix line, the keys on one side only, the tensors that differ (repeated changes folded into one line), the
    plain values, storage sharing, notes, and the closing :meth:`DiffResult.summary` line."""
    from tabulate import tabulate

    out: list[str] = []
    for who, path, fmt, key in (("A", res.a, res.format_a, res.key_a), ("B", res.b, res.format_b, res.key_b)):
        out.append(f"{who}: {path} ({fmt})" + ("" if key is None else f", state_dict {key!r}"))
    if res.prefix:
        out.append(f"keys: {res.prefix}")
    for who, keys in (("A", res.only_a), ("B", res.only_b)):
        if keys:
            shown = ", ".join(keys[:20]) + (f" (and {len(keys) - 20} more)" if len(keys) > 20 else "")
            out.append(f"only in {who} ({len(keys)}): {shown}")
    _tensor_lines(res, verbose, out)
    if res.values:
        out.append(tabulate([(v.key, repr(v.a), repr(v.b)) for v in res.values], headers=["value", "A", "B"]))
    out += [f"shared storage differs: {line}" for line in res.shared]
    out += [f"note: {note}" for note in res.notes]
    out.append(res.summary())
    return "\n".join(out)
