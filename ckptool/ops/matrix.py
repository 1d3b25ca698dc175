"""The support matrix: for every checkpoint format and every ckptool operation, what happens today.

Generated from the registry, not kept beside it: each format's row is its entry's
:attr:`ckptool.readers.Format.support` (operation -> :class:`Cell`, ``works`` where not named), so that adding a
format is its registry entry. ``MATRIX[(format, operation)]`` is a :class:`Cell`:

- ``works``: the operation succeeds on that format; ``reason`` is a phrase its output contains (scan: the verdict
  of the fixture, e.g. DeepSpeed's optimizer files are ``needs-trust`` because of ``fragment_address``);
- ``refused``: it stops with one ``Error:`` line containing ``reason`` (exit 1 or 2, never 3); ``route`` is the
  nearest route that works;
- ``bug``: what it does today is wrong (a refusal whose message misleads or gives no route, or an output that
  claims more than was checked); ``reason`` is the phrase it prints today, ``route`` the way around it.

``docs/formats.md`` holds a table generated from this one (``python docs/generate.py``), and
``tests/test_matrix.py`` runs every cell through the CLI (``load_into`` through the Python API) on a fixture of
that format and checks it behaves as written here. Change a cell (on its registry entry) together with the
behaviour.
"""

from __future__ import annotations

from collections.abc import Mapping

from ckptool.readers import FORMATS as READERS
from ckptool.readers import Format
from ckptool.readers.support import WORKS, Cell, Status

__all__ = ["FORMATS", "FORMAT_LABELS", "MATRIX", "OPERATIONS", "Cell", "Status", "matrix_of"]

#: the formats, in table order: every format of the readers layer's registry (:data:`ckptool.readers.FORMATS`)
#: that has a row (all but plain pickles, which only ``inspect`` and ``scan`` read)
FORMATS: tuple[str, ...] = tuple(name for name, f in READERS.items() if f.support is not None)

#: what each format is, for the generated table of ``docs/formats.md``: the registry's labels
FORMAT_LABELS: dict[str, str] = {name: READERS[name].label for name in FORMATS}

#: the operations: CLI commands, ``prefix`` for strip-dataparallel / strip-prefix / add-prefix / unwrap (and the
#: same flags of remap), ``load_into`` for :func:`ckptool.load_into`, ``average --method`` for mergekit's methods
#: (ties onto a base), ``merge-lora`` with the format as the base
OPERATIONS: tuple[str, ...] = (
    "inspect", "scan", "diff", "convert", "remap", "prefix", "extract-state-dict", "sanitize", "verify",
    "load_into", "rename", "filter", "average", "average --method", "merge-lora", "report",
)



def matrix_of(registry: Mapping[str, Format]) -> dict[tuple[str, str], Cell]:
    """The support matrix of ``registry``: ``(format, operation) -> Cell`` for every format that has a row
    (:attr:`~ckptool.readers.Format.support` not None), in registry order; ``works`` where the row names nothing.

    Raises:
        ValueError: a row names an operation that is not in :data:`OPERATIONS`.
    """
    out: dict[tuple[str, str], Cell] = {}
    for name, f in registry.items():
        if f.support is None:
            continue
        unknown = set(f.support) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"the registry entry {name!r} names operations that do not exist: {sorted(unknown)}")
        out.update({(name, op): f.support.get(op, WORKS) for op in OPERATIONS})
    return out


MATRIX: dict[tuple[str, str], Cell] = matrix_of(READERS)
