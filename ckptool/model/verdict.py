"""The one answer to "is this file safe to load?": :class:`Verdict` (``safe``, ``incomplete``, ``needs-trust``,
``error``, ``dangerous``), computed by :func:`verdict_of` from what a scan found, and the exit status each verdict
gives (:func:`exit_code`; ``--strict`` is a policy on the verdict, not a second vocabulary).

``ckptool scan`` (:attr:`ckptool.scanning.results.ScanResult.verdict`), ``inspect`` (its ``security.verdict``),
``report`` (the page's safety row and ``--json``'s ``verdict``) and ``sanitize`` all use this enum under the key
``verdict``; a file that could not be read to its end is never ``safe``.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from ckptool.model.allowlist import DANGEROUS, LEVELS, NEEDS_TRUST, SAFE

__all__ = ["EXIT_CODES", "STRICT_EXIT_CODES", "Verdict", "exit_code", "verdict_of"]


class Verdict(str, Enum):
    """A file's safety verdict, a ``str`` serialised as its value (``json.dumps`` writes ``"needs-trust"``).

    From best to worst for a gate (:attr:`rank`): ``safe`` (every global allowed, no code shipped, read to its end),
    ``incomplete`` (nothing unsafe, but the data is cut short), ``needs-trust`` (a class or code outside the
    weights_only allowlist that is no known gadget), ``error`` (a part could not be read: ckptool cannot vouch for
    what follows), ``dangerous`` (a global or shipped code that runs processes, changes files...)."""

    SAFE = "safe"
    INCOMPLETE = "incomplete"
    NEEDS_TRUST = "needs-trust"
    ERROR = "error"
    DANGEROUS = "dangerous"

    def __str__(self) -> str:
        """The value (``needs-trust``), as ``json.dumps`` writes it."""
        return self.value

    def __format__(self, spec: str) -> str:
        """The value, formatted as a ``str`` (f-strings give ``needs-trust``, not ``Verdict.NEEDS_TRUST``)."""
        return format(self.value, spec)

    @property
    def shown(self) -> str:
        """How ``ckptool scan`` writes it on a file's first line: ``safe``, ``INCOMPLETE``, ``NEEDS TRUST``,
        ``ERROR``, ``DANGEROUS``."""
        return "safe" if self is Verdict.SAFE else self.value.replace("-", " ").upper()


#: the ``ckptool scan`` exit status of each verdict (3 is every command's internal-error status)
EXIT_CODES: dict[Verdict, int] = {Verdict.SAFE: 0, Verdict.DANGEROUS: 1, Verdict.ERROR: 2, Verdict.NEEDS_TRUST: 4,
                                  Verdict.INCOMPLETE: 5}
#: the exit status of each verdict under ``--strict`` (a policy: anything outside the allowlist fails as 1)
STRICT_EXIT_CODES: dict[Verdict, int] = {**EXIT_CODES, Verdict.NEEDS_TRUST: 1}


def exit_code(verdict: Verdict | str, *, strict: bool = False) -> int:
    """The exit status of ``verdict`` (:data:`EXIT_CODES`; with ``strict``, :data:`STRICT_EXIT_CODES`: needs-trust
    fails as 1 like dangerous).

    Raises:
        ValueError: ``verdict`` is not one of :class:`Verdict`'s words.
    """
    return (STRICT_EXIT_CODES if strict else EXIT_CODES)[Verdict(verdict)]


_RANK = {level: i for i, level in enumerate(LEVELS)}


def verdict_of(levels: Iterable[str], *, readable: bool = True, cut_short: bool = False) -> Verdict:
    """THE verdict, from the findings: the ``levels`` (:data:`ckptool.model.allowlist.LEVELS` words) of every
    global and every piece of shipped code found, whether every part was ``readable`` to its end, and whether the
    data is ``cut_short`` (ends before its structure says it does).

    ``dangerous`` if any level is; else ``error`` if not ``readable``; else ``needs-trust`` if any level is; else
    ``incomplete`` if ``cut_short``; else ``safe``. Source of the order: a gate must fail on the worst thing it
    knows, and cannot vouch for bytes it could not read.

    Raises:
        ValueError: a level outside :data:`~ckptool.model.allowlist.LEVELS`.
    """
    rank = _RANK[SAFE]  # the index in LEVELS of the worst level so far: a dict lookup a level (4 verdicts a file)
    for level in levels:
        r = _RANK.get(level)
        if r is None:
            raise ValueError(f"unknown level {level!r}")
        if r > rank:
            rank = r
    worst = LEVELS[rank]
    if worst == DANGEROUS:
        return Verdict.DANGEROUS
    if not readable:
        return Verdict.ERROR
    if worst == NEEDS_TRUST:
        return Verdict.NEEDS_TRUST
    return Verdict.INCOMPLETE if cut_short else Verdict.SAFE
