"""Units shown to people: sizes in bytes."""

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
