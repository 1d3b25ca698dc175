"""What a dtype cast did to the values it rounded (``convert --dtype``): the counts of the cast report, as data.

The counting itself needs torch and lives in :func:`ckptool.torch_ops.cast.cast_counting`; this module holds the
result, how results add up, and the refusal of a cast that made ``inf`` or NaN from finite values.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptool.errors import UnsupportedError


@dataclass
class CastCount:
    """The values of one storage (or of many, summed) cast from ``src`` to ``dst`` dtype, counted element by element.

    ``elements``: values cast. ``overflow``: finite values that became ``+inf`` or ``-inf``. ``underflow``: finite
    non-zero values that became zero (of either sign). ``nan_in`` / ``nan_out``: NaNs before and after the cast;
    ``nan_made``: finite values that became NaN (a plain IEEE cast makes none; counted so that a refusal can say so).
    ``max_abs_error`` / ``max_rel_error``: the largest ``|out - in|`` (exact) and ``|out - in| / |in|`` (``in``
    non-zero; the quotient rounded once, in float32 or the input's wider dtype) over the values finite on both sides
    (0.0 when there are none). Counts are exact: every element is counted, none sampled.
    """

    src: str
    dst: str
    elements: int = 0
    overflow: int = 0
    underflow: int = 0
    nan_in: int = 0
    nan_out: int = 0
    nan_made: int = 0
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0

    @property
    def made_nonfinite(self) -> int:
        """Finite values that the cast turned into ``inf`` or NaN (what :func:`refuse_overflow` refuses)."""
        return self.overflow + self.nan_made

    def add(self, other: CastCount) -> None:
        """Add the counts of ``other`` to these (errors: the larger of the two); ``src`` / ``dst`` become ``"*"``
        where they differ."""
        if other.src != self.src:
            self.src = "*"
        if other.dst != self.dst:
            self.dst = "*"
        self.elements += other.elements
        self.overflow += other.overflow
        self.underflow += other.underflow
        self.nan_in += other.nan_in
        self.nan_out += other.nan_out
        self.nan_made += other.nan_made
        self.max_abs_error = max(self.max_abs_error, other.max_abs_error)
        self.max_rel_error = max(self.max_rel_error, other.max_rel_error)


def total_count(counts: dict[str, CastCount]) -> CastCount | None:
    """The sum of ``counts`` (:meth:`CastCount.add`), or None for no counts."""
    total: CastCount | None = None
    for c in counts.values():
        if total is None:
            total = CastCount(c.src, c.dst)
        total.add(c)
    return total


#: tensors named in a refusal before "and N more"
_NAMED = 10


def refuse_overflow(counts: dict[str, CastCount], where: str) -> None:
    """Raise when a cast of ``counts`` (tensor name -> count) made ``inf`` or NaN from finite values.

    Raises:
        UnsupportedError: with every such tensor's name (the first ten, then how many more) and its counts, and the
            flag that accepts them (``--allow-overflow``, ``allow_overflow=True``).
    """
    bad = [(name, c) for name, c in counts.items() if c.made_nonfinite]
    if not bad:
        return
    parts = []
    for name, c in bad[:_NAMED]:
        made = f"{c.overflow} to +-inf" + (f", {c.nan_made} to NaN" if c.nan_made else "")
        parts.append(f"{name} ({c.src}->{c.dst}: {made} of {c.elements})")
    more = f" and {len(bad) - _NAMED} more" if len(bad) > _NAMED else ""
    raise UnsupportedError(f"{where}: the cast turns finite values into inf/NaN in {len(bad)} tensor(s): "
                           f"{', '.join(parts)}{more}; nothing was written. Cast to a dtype with a wider range "
                           "(float32, bfloat16), or pass --allow-overflow (allow_overflow=True) to write them anyway")
