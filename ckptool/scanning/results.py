"""The results of ``ckptool scan`` (:class:`ScanResult`: the pickles found, each global with its status and level,
the verdicts and exit statuses), shared by the container walk (:mod:`ckptool.scanning.pickles`), DCP folders
(:mod:`ckptool.scanning.dcp`), the SARIF log (:mod:`ckptool.ops.scan.sarif`) and ``inspect``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from ckptool.model.allowlist import (
    ALLOWED,
    DANGEROUS,
    LEVELS,
    level_of,
    worst_level,
)
from ckptool.model.units import human_bytes, plural, text_table
from ckptool.model.verdict import EXIT_CODES, STRICT_EXIT_CODES, Verdict, exit_code, verdict_of

__all__ = ["EXIT_CODES", "INCOMPLETE", "STRICT_EXIT_CODES", "CodeFinding", "GlobalFinding", "PickleFinding",
           "ScanResult", "Verdict", "exit_status", "verdicts_exit_status", "worst_verdict"]

#: the verdict of a file read to its end whose data is cut short (:attr:`ScanResult.incomplete`): never ``safe``
INCOMPLETE = Verdict.INCOMPLETE

# ------------------------------------------------------------------------------------------------ results
@dataclass
class PickleFinding:
    """One pickle found in a file: ``where`` (``archive/data.pkl``, ``pickle at byte 0``, ``legacy sys_info``,
    ``inner.zip!archive/data.pkl``...), its byte ``offset`` in that container, the ``globals`` it names
    (``module.qualname``, first use first) and ``error`` when it could not be read to its STOP opcode (the globals
    are then those named before the failure)."""

    where: str
    offset: int
    globals: list[str] = field(default_factory=list)
    error: str | None = None
    #: True when ``torch.load`` (or ``torch.jit.load``, torch.distributed.checkpoint's reader) does not read this
    #: pickle today (another zip member, a nested zip, data after the end, a second pickle in a row): another
    #: loader, an extraction tool or a later torch may
    hidden: bool = False
    #: for each global outside the weights_only allowlist, the dotted key paths in the pickle's object where it
    #: is used (``model.evil``, ``(top level)``; at most :data:`MAX_KEY_PATHS`; empty when it could not be located)
    key_paths: dict[str, list[str]] = field(default_factory=dict)
    #: True when ``error`` is that the data ends before the pickle's STOP opcode
    #: (:class:`~ckptool.errors.TruncatedError`): every byte there is was read, and the file is ``incomplete``
    truncated: bool = False


@dataclass
class GlobalFinding:
    """A global named anywhere in the file, its status (``allowed`` / ``needs-trust`` / ``unknown`` /
    ``dangerous``, :func:`ckptool.model.allowlist.classify_global`), why, and the pickles (``where``) that name it."""

    name: str
    status: str
    reason: str
    where: list[str] = field(default_factory=list)

    @property
    def level(self) -> str:
        """``safe``, ``needs-trust`` or ``dangerous`` (:func:`ckptool.model.allowlist.level_of`)."""
        return level_of(self.status)

    def to_dict(self) -> dict[str, Any]:
        """``name``, ``status``, ``level``, ``reason``, ``where``: one entry of ``ckptool scan --json``."""
        return {"name": self.name, "status": self.status, "level": self.level, "reason": self.reason,
                "where": list(self.where)}


@dataclass
class CodeFinding:
    """Code that ships inside the file and that its normal loader runs or may run, outside any pickle
    (:mod:`ckptool.scanning.shipped_code`): ``member`` (``where`` of the zip member, ``archive/code/`` for a TorchScript
    archive's source as a whole), ``kind`` (``native-library``, ``python-module``, ``torchscript``), ``level``
    (``needs-trust`` or ``dangerous``), ``reason`` (what runs it, and when) and ``detail`` (the architecture, the
    module name, the op)."""

    member: str
    kind: str
    level: str
    reason: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """``member``, ``kind``, ``level``, ``reason``, ``detail``: one entry of ``ckptool scan --json``'s
        ``code``."""
        return {"member": self.member, "kind": self.kind, "level": self.level, "reason": self.reason,
                "detail": self.detail}


@dataclass
class ScanResult:
    """What :func:`scan_file` found in one file.

    ``format`` is the container recognised from the bytes (``torch-zip``, ``torchscript``, ``torch-export``, ``zip``,
    ``torch-legacy``, ``legacy-tar``, ``pickle``, ``safetensors``, the wrappers ``tar``, ``gzip``, ``zlib``,
    ``7z``, ``npy``, a ``config`` that makes a loader run code, or ``unknown``); ``notes`` list container
    oddities (data after the last pickle, bad CRC-32, duplicate member names, unreadable extra members...);
    ``error`` says why the file could not be read at all; ``recognised`` names a known library file type
    (:func:`ckptool.model.allowlist.recognise_file`: ``(kind, description)``) when the content matches one;
    ``bytes_read`` the bytes transferred to scan a URL (range requests for zip and safetensors files), None for a
    local path.
    """

    path: str
    format: str = "unknown"
    pickles: list[PickleFinding] = field(default_factory=list)
    globals: list[GlobalFinding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    recognised: tuple[str, str] | None = None
    bytes_read: int | None = None
    #: code that ships inside the file (native libraries, torch.package modules, TorchScript source)
    code: list[CodeFinding] = field(default_factory=list)
    #: what is cut short: the file ends before what its structure declares (a legacy storage block, a zip's end of
    #: central directory, a DCP record past the end of its file); the verdict is then never ``safe``
    incomplete: list[str] = field(default_factory=list)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as tuples of fields (a forked child's results go back to its parent as one pickle,
        :mod:`ckptool.ops.scan.many`): half the time of a dataclass's default state dicts to load."""
        return _rebuilt, (self.path, self.format, [_pickle_fields(p) for p in self.pickles],
                          [_global_fields(g) for g in self.globals], self.notes, self.error, self.recognised,
                          self.bytes_read, self.code, self.incomplete)

    def pickle_level(self, pickle: PickleFinding) -> str:
        """The worst level of the globals ``pickle`` names, as this scan rated them."""
        return worst_level(g.status for g in self.globals if pickle.where in g.where)

    @property
    def hidden(self) -> list[PickleFinding]:
        """The pickles ``torch.load`` does not read today (see :attr:`PickleFinding.hidden`)."""
        return [p for p in self.pickles if p.hidden]

    @property
    def readable(self) -> bool:
        """False when the file, or one of its pickles, could not be read to its end for another reason than the
        data ending (:attr:`cut_short`)."""
        return not (self.error or any(p.error and not p.truncated for p in self.pickles))

    @property
    def cut_short(self) -> list[str]:
        """What ends before its structure says it does: :attr:`incomplete`, then each truncated pickle."""
        return self.incomplete + [f"{p.where}: {p.error}" for p in self.pickles if p.truncated]

    @property
    def level(self) -> str:
        """The worst level of the globals and of the :attr:`code` found (``safe`` when none): ``safe``,
        ``needs-trust`` or ``dangerous``."""
        return max((worst_level(g.status for g in self.globals), *(c.level for c in self.code)), key=LEVELS.index)

    @property
    def verdict(self) -> Verdict:
        """THE verdict (:func:`ckptool.model.verdict.verdict_of` of the levels of the globals and code found,
        :attr:`readable` and :attr:`cut_short`): ``dangerous`` if any global or code is; else ``error`` if a pickle
        (or the file) could not be read to its end; else ``needs-trust``; else ``incomplete`` if the data is cut
        short; else ``safe``. ``--strict`` changes only the exit status (:attr:`strict_exit_code`)."""
        levels = [*(g.level for g in self.globals), *(c.level for c in self.code)]
        if DANGEROUS in levels:  # whatever else was found (verdict_of's first rule: no walk of the pickles)
            return verdict_of(levels)
        return verdict_of(levels, readable=self.readable, cut_short=bool(self.cut_short))

    @property
    def exit_code(self) -> int:
        """The ``ckptool scan`` exit status for this file alone: 0 safe, 1 dangerous, 2 unreadable, 4 needs trust,
        5 incomplete (:data:`EXIT_CODES`)."""
        return exit_code(self.verdict)

    @property
    def strict_exit_code(self) -> int:
        """The ``ckptool scan --strict`` exit status for this file alone (the policy applied to the same
        :attr:`verdict`): 0 safe, 1 dangerous or needs trust, 2 unreadable, 5 incomplete."""
        return exit_code(self.verdict, strict=True)

    @property
    def unsafe(self) -> list[GlobalFinding]:
        """The globals that are not allowed, worst level first (dangerous, then needs-trust; stable otherwise)."""
        bad = [g for g in self.globals if g.status != ALLOWED]
        return sorted(bad, key=lambda g: -LEVELS.index(g.level))

    def to_dict(self, *, strict: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (what ``ckptool scan --json`` prints for each file): ``verdict`` (:class:`Verdict`'s
        word), ``exit_code`` (under ``--strict``'s policy when ``strict``), each global with its ``status`` and
        ``level``, the ``code`` found, and for a URL ``bytes_read``."""
        d: dict[str, Any] = {
            "path": self.path, "verdict": self.verdict.value,
            "exit_code": self.strict_exit_code if strict else self.exit_code,
            "format": self.format, "error": self.error,
            "globals": [g.to_dict() for g in self.globals],
            "pickles": [vars(p).copy() for p in self.pickles],
            "notes": list(self.notes),
            "incomplete": self.cut_short,
            "code": [c.to_dict() for c in self.code],
            "recognised": None if self.recognised is None else {"kind": self.recognised[0],
                                                                "description": self.recognised[1]},
        }
        if self.bytes_read is not None:  # a URL: the bytes transferred
            d["bytes_read"] = self.bytes_read
        return d

    def report(self, *, show_all: bool = False, strict: bool = False) -> str:
        """What ``ckptool scan`` prints for this file: the verdict line (``evil.pth: DANGEROUS (pickle, 1 pickle, 1
        global, 1 not allowed)``), the table of the globals not allowed (every global with ``show_all``), the code
        shipped in it, errors and notes (``strict`` is accepted for the callers of earlier versions: the verdict is
        the same under ``--strict``, only the exit status differs)."""
        bad = self.unsafe
        lines = [f"{self.path}: {self.verdict.shown} ({self.format}, {plural(len(self.pickles), 'pickle')}, "
                 f"{plural(len(self.globals), 'global')}" + (f", {len(bad)} not allowed)" if bad else ")")]
        rows = [(_shown_level(g.level), g.name, g.reason, ", ".join(g.where)) for g in (self.globals if show_all
                                                                                       else bad)]
        if rows:  # a safe file prints no table; text_table loads tabulate only for cells it does not write itself
            lines.append(text_table(rows, ["level", "global", "why", "in"]))
        lines += [f"  code ({_shown_level(c.level)}, {c.kind}): {c.member}: {c.reason}" for c in self.code]
        if self.recognised is not None:
            lines.append(f"  recognised: {self.recognised[1]}")
        if self.error:
            lines.append(f"  error: {self.error}")
        lines += [f"  incomplete: {why}" for why in self.incomplete]
        if self.bytes_read is not None:
            lines.append(f"  read {human_bytes(self.bytes_read)} over the network")
        lines += [f"  {'incomplete' if p.truncated else 'error'} in {p.where}: {p.error}" for p in self.pickles
                  if p.error]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        """:meth:`report`: what ``ckptool scan PATH`` prints."""
        return self.report()


def _shown_level(level: str) -> str:
    return level.upper() if level == "dangerous" else level


def worst_verdict(results: Iterable[ScanResult]) -> Verdict:
    """The verdict of several files together: the worst file's, in the order dangerous, error, needs-trust,
    incomplete, safe (the order of :func:`exit_status`); ``safe`` for none."""
    found = {r.verdict for r in results}
    order = (Verdict.DANGEROUS, Verdict.ERROR, Verdict.NEEDS_TRUST, Verdict.INCOMPLETE)
    return next((v for v in order if v in found), Verdict.SAFE)


_pickle_fields = attrgetter(*(f.name for f in fields(PickleFinding)))
_global_fields = attrgetter(*(f.name for f in fields(GlobalFinding)))


def _rebuilt(path: str, fmt: str, pickles: list[tuple[Any, ...]], globs: list[tuple[Any, ...]],
             *rest: Any) -> ScanResult:
    """The :class:`ScanResult` :meth:`ScanResult.__reduce__` took apart."""
    return ScanResult(path, fmt, [PickleFinding(*p) for p in pickles], [GlobalFinding(*g) for g in globs], *rest)


def exit_status(results: Iterable[ScanResult], *, strict: bool = False) -> int:
    """The ``ckptool scan`` exit status of several files: the worst file decides, in the order dangerous (1),
    unreadable (2), needs trust (4), incomplete (5), safe (0); with ``strict`` (the policy on the same verdicts):
    dangerous or needs trust (1), unreadable (2), incomplete (5), safe (0)."""
    return verdicts_exit_status([r.verdict for r in results], strict=strict)


def verdicts_exit_status(verdicts: Iterable[Verdict], *, strict: bool = False) -> int:
    """:func:`exit_status` of files whose verdicts are ``verdicts``."""
    codes = {exit_code(v, strict=strict) for v in set(verdicts)}
    return next((c for c in (1, 2, 4, 5) if c in codes), 0)
