"""``ckptool.sanitize``: turn a checkpoint that ``torch.load(weights_only=True)`` refuses into one it accepts,
without running the file.

The file is read with the restricted unpickler (:func:`ckptool.formats.torchfile.read_checkpoint`: a node graph,
nothing imported or called), every object outside torch's weights_only allowlist is replaced by a rule, and
the graph is written as a torch zip file (:func:`ckptool.ops.rewrite.stream.rewrite_file`: the existing storages copied
byte for byte, the new ones added as records). The rules, in the order they are tried, are those of the pass
:class:`ckptool.model.sanitizing.Sanitizer`: a pickled ``nn.Module`` becomes its state_dict, numpy arrays, scalars
and dtypes become tensors and torch dtypes, plain records dicts, ``pathlib`` paths strings. Anything else outside the
allowlist (any other class or function, a dangerous global such as ``os.system``) is reported with its key path, and
nothing is written, unless ``drop_unknown`` leaves it out (a dict entry removed, a list or tuple item replaced by
None; each one listed in the result).

:func:`sanitize_dry_run` (``ckptool sanitize --dry-run``) makes the same pass and writes nothing: it says what the
file is (format, kind, tensor count, the verdict ``ckptool scan`` gives it), what a run would convert and drop, or
the error with which a run would refuse it.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ckptool._gc import gc_paused
from ckptool.errors import CkptError, UnsafeCheckpointError, UnsupportedError
from ckptool.formats.nodes import CLASS_BUILD, qualified_name, split_use
from ckptool.model.allowlist import classify_global, is_allowed, level_of, level_word
from ckptool.model.devices import LocationFn
from ckptool.model.graph import find_state_dicts, iter_tensors, too_deep
from ckptool.model.sanitizing import DROP, Conversion, Sanitizer, left_over
from ckptool.model.units import plural, retagged_words, wrote_line
from ckptool.ops.inspect.pickles import kind_of
from ckptool.ops.rewrite.stream import (
    ProgressFn,
    output_path,
    refuse_unwritable,
    retag_counts,
    retag_function,
    rewrite_file,
)
from ckptool.readers import Checkpoint, Opened, open_checkpoint
from ckptool.scanning.entry import scan
from ckptool.scanning.results import worst_verdict

__all__ = ["Conversion", "SanitizeDryRun", "SanitizeResult", "sanitize", "sanitize_dry_run"]

#: the globals a refusal names, at most
_LISTED = 5

@dataclass
class SanitizeResult:
    """What :func:`sanitize` wrote: ``dst``, the input format, every object ``converted`` and ``dropped``
    (:class:`Conversion`, in graph order), the ``storages`` written (of which ``new_storages`` hold converted
    numpy data), ``bytes_written``, the output's storage tags ``devices`` (``{tag: storage count}``) and the
    storages re-tagged by ``to`` / ``mapping`` (``{(old, new): count}``)."""

    src: str
    dst: str
    format_in: str
    converted: list[Conversion] = field(default_factory=list)
    dropped: list[Conversion] = field(default_factory=list)
    storages: int = 0
    new_storages: int = 0
    bytes_written: int = 0
    devices: dict[str, int] = field(default_factory=dict)
    retagged: dict[tuple[str, str], int] = field(default_factory=dict)

    def __str__(self) -> str:
        """What ``ckptool sanitize`` prints (before its load hint): each object converted and dropped, then the
        ``Wrote DST (SIZE, N storages, M new; re-tagged ...)`` line."""
        lines = [f"Converted {plural(len(self.converted), 'object')}; nothing from the file was imported or run"
                 + (":" if self.converted else "")]
        lines += [f"  {c.label}: {c.source} -> {c.detail}" for c in self.converted]
        if self.dropped:
            lines.append(f"Dropped {plural(len(self.dropped), 'object')} no rule converts (--drop-unknown):")
            lines += [f"  {c.label}: {c.source} ({c.why})" for c in self.dropped]
        retagged = retagged_words(self.retagged)
        lines.append(wrote_line(self.dst, self.bytes_written, f"{plural(self.storages, 'storage')}, "
                                f"{self.new_storages} new" + (f"; {retagged}" if retagged else "")))
        return "\n".join(lines)


def _refuse_unwritable(opened: Opened, src: str) -> None:
    """The format's refusal to rewrite (a plain pickle, safetensors, ...), naming each global outside the
    weights_only allowlist with the level ``ckptool scan`` gives it: a plain pickle calling ``os.system`` is no
    mere "nothing to sanitize"."""
    try:
        refuse_unwritable(opened.spec, src, "sanitize")
    except UnsupportedError as e:
        try:
            names = [qualified_name(m, n) for m, n in opened.graph().globals]
        except CkptError:  # no pickle to read (safetensors): the refusal as it is
            raise e from None
        named = [(n, classify_global(n)) for n in dict.fromkeys(names) if not is_allowed(n)]
        if not named:
            raise
        words = ", ".join(f"{n} ({level_word(level_of(status))})" for n, (status, _why) in named[:_LISTED])
        more = f" and {len(named) - _LISTED} more" if len(named) > _LISTED else ""
        raise UnsupportedError(f"{e}; it names {words}{more}: see `ckptool scan {shlex.quote(src)}`") from None


def _refusal(src: str, left: list[Conversion]) -> UnsafeCheckpointError:
    shown = "; ".join(f"{c.label}: {c.source} ({c.why})" for c in left[:8])
    more = f" and {len(left) - 8} more" if len(left) > 8 else ""
    return UnsafeCheckpointError(
        f"{src}: {len(left)} object(s) have no weights_only equivalent: {shown}{more}; nothing was written. "
        "Remove them from the checkpoint, or pass --drop-unknown (drop_unknown=True) to leave them out",
        sorted({c.source for c in left}))


@gc_paused
def sanitize(src: str | os.PathLike[str], dst: str | os.PathLike[str] | None = None, *, to: str | None = None,
             mapping: Mapping[str, str] | None = None, allow_missing: bool = False, drop_unknown: bool = False,
             in_place: bool = False, progress: ProgressFn | None = None) -> SanitizeResult:
    """Write ``src`` as a torch zip file that ``torch.load(path, weights_only=True)`` accepts, without importing
    or running anything from ``src`` (the rules: see the module docstring).

    Args:
        src: a torch zip or legacy checkpoint (``torch.save``), e.g. one holding numpy arrays, an
            ``argparse.Namespace`` or a pickled ``nn.Module``.
        dst: the output file; default ``<stem>.sanitized<ext>`` beside ``src``.
        to: re-tag every storage for this device (``"cpu"``) in the same pass; converted arrays are tagged
            ``cpu`` before it.
        mapping: re-tag only the storages whose tag matches (``{"cuda:1": "cpu"}``).
        allow_missing: write the file even when a ``mapping`` source matches no storage.
        drop_unknown: leave out what no rule converts (listed in ``dropped``) instead of refusing.
        in_place: replace ``src`` itself (atomically).
        progress: ``progress(nbytes)`` is called as the existing storage records are copied (bytes since the last
            call).

    Returns:
        A :class:`SanitizeResult`: every converted object with its key path.

    Raises:
        UnsafeCheckpointError: something no rule converts (each one named with its key path and global), without
            ``drop_unknown``; or the top-level object itself. Nothing is written.
        UnsupportedError: safetensors, TorchScript or plain-pickle input; a module whose state_dict needs its own
            code (quantized, lazy, state_dict hooks).
        UsageError: ``dst`` is ``src`` without ``in_place``, a bad device, both ``to`` and ``mapping``.
        DeviceNotFoundError: a ``mapping`` source matches no storage, without ``allow_missing``.
        CorruptCheckpointError / NotACheckpointError: a damaged or foreign file; a numpy array whose data does not
            match its shape; a graph nested too deep to walk.
        OutputError: writing failed (nothing is left behind).
    """
    src = os.fspath(src)
    out = sanitize_output(src, dst, in_place)
    opened = open_checkpoint(src).require_file()
    _refuse_unwritable(opened, src)
    p = _pass(opened.graph(), src, to, mapping, allow_missing, drop_unknown)
    written = rewrite_file(p.kept, out, p.root, p.location_fn, p.new_records, progress)
    return SanitizeResult(src, out, opened.format, p.converted, p.dropped, storages=p.storages,
                          new_storages=len(p.new_records), bytes_written=written.bytes_written,
                          devices=p.devices(), retagged=written.retagged)


@dataclass
class _Pass:
    """One sanitizing pass over a checkpoint's graph, nothing written yet: the new ``root``, the checkpoint
    ``kept`` (the storages still used, protocol 2, no class BUILD), the ``new_records`` of converted arrays, the
    ``location_fn`` of ``to`` / ``mapping``, what was ``converted`` and ``dropped`` (or no rule converts)."""

    root: Any
    kept: Checkpoint
    new_records: list[tuple[str, bytes]]
    location_fn: LocationFn | None
    converted: list[Conversion]
    dropped: list[Conversion]
    #: the refusal of what no rule converts (``dropped`` lists them), when the pass was asked not to raise it
    refusal: UnsafeCheckpointError | None = None

    @property
    def storages(self) -> int:
        """The storages the output holds: the input's still used, and one per converted array."""
        return len(self.kept.storages) + len(self.new_records)

    def devices(self) -> dict[str, int]:
        """The output's storage tags, ``{tag: storage count}`` (converted arrays tagged ``cpu`` before re-tagging)."""
        fn = self.location_fn
        out: dict[str, int] = {}
        for ref in self.kept.storages.values():
            tag = fn(ref.location) if fn else ref.location
            out[tag] = out.get(tag, 0) + 1
        if self.new_records:
            tag = fn("cpu") if fn else "cpu"
            out[tag] = out.get(tag, 0) + len(self.new_records)
        return out


def _pass(ck: Checkpoint, src: str, to: str | None, mapping: Mapping[str, str] | None, allow_missing: bool,
          drop_unknown: bool, *, refuse: bool = True) -> _Pass:
    """Sanitize the graph of ``ck`` (read for this pass alone: its allowed nodes are changed in place). ``refuse``:
    raise the refusal of what no rule converts (else it is the result's ``refusal``, ``dropped`` listing them).

    Raises: what :func:`sanitize` raises once the file is read (a device mapping, something no rule converts).
    """
    location_fn = retag_function(ck, to, mapping, allow_missing=allow_missing)
    s = Sanitizer([r.name for r in ck.records], ck.storages, drop_unknown)
    try:
        root = s.value(ck.root, "")
    except RecursionError as e:
        raise too_deep(e) from None
    for name in dict.fromkeys(qualified_name(m, n) for m, n in ck.globals):  # BUILD on a class: never written
        if split_use(name)[1] == CLASS_BUILD:
            s.left.append(left_over("", name))
    refusal = _refusal(src, s.left) if s.left and (not drop_unknown or root is DROP) else None
    if refusal is not None and refuse:
        raise refusal
    keep = {"data/" + k for k in s.used}
    kept = replace(ck, protocol=2, _records=[r for r in ck.records if not r.name.startswith("data/") or r.name in keep],
                   storages={k: v for k, v in ck.storages.items() if k in s.used},
                   globals=[g for g in ck.globals if split_use(g[1])[1] != CLASS_BUILD])  # dropped: listed in left
    return _Pass(root, kept, s.new_records, location_fn, s.converted, s.left, refusal)


def sanitize_output(src: str | os.PathLike[str], dst: str | os.PathLike[str] | None, in_place: bool = False) -> str:
    """The file :func:`sanitize` writes: ``dst``, ``src`` with ``in_place``, or ``<stem>.sanitized<ext>`` beside it.

    Raises:
        UsageError: as :func:`ckptool.ops.rewrite.stream.output_path`.
    """
    return output_path(os.fspath(src), os.fspath(dst) if dst is not None else None, in_place, "sanitized")


@dataclass
class SanitizeDryRun:
    """What :func:`sanitize_dry_run` found: ``src``, the output ``dst`` a run would write, the input ``format``,
    ``kind`` (``state_dict``, ``training_checkpoint``, ``full_model``, ``tensors``: as ``ckptool inspect`` says) and
    ``tensors`` (every tensor reachable from the pickle, tied names each counted, as ``inspect`` lists them) of a
    file sanitize reads (None for a format it refuses before reading: safetensors, TorchScript, a plain pickle...),
    ``verdict`` (what ``ckptool scan SRC`` says, a set's or folder's files too: :func:`ckptool.scanning.entry.scan`),
    every object a run would have ``converted`` and, with ``drop_unknown``, ``dropped``, or, for a run that refuses
    the file for them, the ``unconverted`` objects no rule converts (each with the level scan gives its global);
    the output's ``storages`` (``new_storages`` of them converted arrays), its tags ``devices`` and ``retagged`` (as
    :class:`SanitizeResult`); ``error``: the error a run would raise (nothing written), else None."""

    src: str
    dst: str
    format: str
    verdict: str
    kind: str | None = None
    tensors: int | None = None
    converted: list[Conversion] = field(default_factory=list)
    dropped: list[Conversion] = field(default_factory=list)
    unconverted: list[Conversion] = field(default_factory=list)
    storages: int = 0
    new_storages: int = 0
    devices: dict[str, int] = field(default_factory=dict)
    retagged: dict[tuple[str, str], int] = field(default_factory=dict)
    error: CkptError | None = None

    def __str__(self) -> str:
        """What ``ckptool sanitize --dry-run`` prints: what the file is, each object a run would convert and drop,
        then what it would write (or, when it would refuse, nothing more: the command then prints the error)."""
        what = [self.format] + ([self.kind] if self.kind else []) + (
            [plural(self.tensors, "tensor")] if self.tensors is not None else [])
        lines = [f"{self.src}: {', '.join(what)}; scan's verdict: {self.verdict}"]
        if self.converted or self.error is None:
            lines.append(f"Would convert {plural(len(self.converted), 'object')}" + (":" if self.converted else ""))
            lines += [f"  {c.label}: {c.source} -> {c.detail}" for c in self.converted]
        if self.dropped:
            lines.append(f"Would drop {plural(len(self.dropped), 'object')} no rule converts (--drop-unknown):")
            lines += [f"  {c.label}: {c.source} ({c.why})" for c in self.dropped]
        if self.unconverted:
            lines.append(f"No rule converts {plural(len(self.unconverted), 'object')} (a run refuses the file):")
            lines += [f"  {c.label}: {c.source} ({c.why})" for c in self.unconverted]
        if self.error is None:
            retagged = retagged_words(self.retagged)
            lines.append(f"Would write {self.dst} ({plural(self.storages, 'storage')}, {self.new_storages} new"
                         + (f"; {retagged}" if retagged else "") + "); nothing written (--dry-run)")
        return "\n".join(lines)


@gc_paused
def sanitize_dry_run(src: str | os.PathLike[str], dst: str | os.PathLike[str] | None = None, *,
                     to: str | None = None, mapping: Mapping[str, str] | None = None, allow_missing: bool = False,
                     drop_unknown: bool = False, in_place: bool = False) -> SanitizeDryRun:
    """What :func:`sanitize` would do with these arguments, writing nothing: the same reading and the same pass
    (arguments as there), and the verdict ``ckptool scan`` gives the file.

    Returns:
        A :class:`SanitizeDryRun`. A refusal that comes once the file is open (its format, a device mapping,
        something no rule converts, a module whose state_dict needs its code) is its ``error``, not raised, so that
        the caller can say what the file is before it.

    Raises:
        UsageError: ``dst`` is ``src`` without ``in_place`` (as :func:`sanitize`).
        NotACheckpointError / CorruptCheckpointError / InputNotFoundError: the file cannot be opened as a checkpoint
            (as :func:`sanitize`, before anything about it is known).
    """
    src = os.fspath(src)
    out = sanitize_output(src, dst, in_place)
    opened = open_checkpoint(src)
    # the verdict ``ckptool scan SRC`` gives: a set's shards, a model folder's files beside its weights included
    res = SanitizeDryRun(src, out, opened.format, str(worst_verdict(scan([src]))))
    try:
        opened.require_file()  # a folder or a set is refused as a run refuses it, once it is known what it is
        _refuse_unwritable(opened, src)
        ck = opened.graph()
        res.kind = kind_of(ck.root, find_state_dicts(ck.root))
        res.tensors = sum(1 for _t in iter_tensors(ck.root))
        p = _pass(ck, src, to, mapping, allow_missing, drop_unknown, refuse=False)
    except CkptError as e:
        res.error = e
        return res
    res.converted, res.error = p.converted, p.refusal
    if p.refusal is not None:
        res.unconverted = p.dropped
        return res
    res.dropped = p.dropped
    res.storages, res.new_storages = p.storages, len(p.new_records)
    res.devices, res.retagged = p.devices(), retag_counts(p.kept.storages, p.location_fn)
    return res
