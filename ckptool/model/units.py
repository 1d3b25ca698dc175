"""Words shown to people: sizes in bytes, counts, plurals, the re-tagging of storages."""

from __future__ import annotations

from collections.abc import Sequence


def human_bytes(n: int) -> str:
    """A size in bytes in binary units: ``1536`` -> ``1.5 KiB``, ``100`` -> ``100 B``."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


def human_count(n: int) -> str:
    """A count with a metric suffix: ``1234567`` -> ``1.2M``, ``950`` -> ``950``."""
    for size, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= size:
            return f"{n / size:.1f}{suffix}"
    return str(n)


def plural(n: int, word: str, words: str | None = None) -> str:
    """``n`` and the noun that agrees with it: ``plural(1, "storage")`` -> ``1 storage``, ``plural(2, "entry",
    "entries")`` -> ``2 entries`` (``words`` defaults to ``word + "s"``)."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def retagged_words(retagged: dict[tuple[str, str], int]) -> str:
    """The one spelling of a re-tagging every command prints: ``{("cuda:0", "cpu"): 5}`` ->
    ``re-tagged cuda:0 -> cpu (5)``; several joined with ``, ``; empty when nothing was re-tagged."""
    changes = ", ".join(f"{a} -> {b} ({n})" for (a, b), n in sorted(retagged.items()))
    return f"re-tagged {changes}" if changes else ""


def wrote_line(dst: str, bytes_written: int, detail: str) -> str:
    """``Wrote DST (SIZE, DETAIL)``: the line every rewriting command ends its report with."""
    return f"Wrote {dst} ({human_bytes(bytes_written)}, {detail})"


def _is_plain_cell(cell: object) -> bool:
    """A cell ``tabulate`` shows as the string it is: a non-empty ``str`` of printable ASCII (no ANSI escape, wide
    character or line break) without surrounding spaces (which ``tabulate`` strips)."""
    return (type(cell) is str and cell.isascii() and cell.isprintable() and cell != ""
            and cell[0] != " " and cell[-1] != " ")


def _is_numberish(cell: str) -> bool:
    """Whether ``tabulate`` may read ``cell`` as a number or a bool (then it aligns the column to the right): its
    ``float`` / ``int`` parse, with thousands separators, or ``True`` / ``False``; a superset of ``tabulate``'s own
    tests, so that a column read as text here is text there too."""
    if cell in ("True", "False"):
        return True
    try:
        float(cell.replace(",", ""))
    except ValueError:
        return False
    return True


def text_table(rows: Sequence[Sequence[object]], headers: Sequence[str], *, numparse: bool = True) -> str:
    """``tabulate(rows, headers=headers, disable_numparse=not numparse)`` (its ``simple`` format: the header, a line
    of dashes, a row a line, columns two spaces apart, each as wide as its widest cell, no trailing spaces), written
    here for the common case where every cell is a plain string (:func:`_is_plain_cell`) and, with ``numparse``, each
    column holds a cell that is no number (a column of text, aligned left): ``scan`` of hundreds of files prints a
    table a file, where ``tabulate``'s per-cell type tests and its import (about 15 ms) cost more than the scan of a
    small pickle (issue 52). Any other table is ``tabulate``'s own, so the output is the same byte for byte
    (tests/test_many_small_files.py compares the two)."""
    ncols = len(headers)
    plain = bool(rows) and all(_is_plain_cell(h) for h in headers) and all(
        len(r) == ncols and all(_is_plain_cell(c) for c in r) for r in rows)
    if plain and numparse:
        plain = all(any(not _is_numberish(r[i]) for r in rows) for i in range(ncols))  # type: ignore[arg-type]
    if not plain:
        from tabulate import tabulate  # only for tables with other cells (start-up, issue 52)

        return str(tabulate(rows, headers=headers, disable_numparse=not numparse))
    widths = [max(len(h) + 2, *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]  # type: ignore[arg-type]
    lines = ["  ".join(c.ljust(w) for c, w in zip(headers, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]  # type: ignore[attr-defined]
    return "\n".join(lines)
