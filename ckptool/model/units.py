"""Words shown to people: sizes in bytes, counts, plurals, the re-tagging of storages."""

from __future__ import annotations


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
