"""The planning shared by ``rename`` and ``filter`` (:mod:`ckptool.ops.surgery.edit`) on files and on sharded sets and
DCP folders (:mod:`ckptool.ops.surgery.sets`): the results, the selection of state_dicts in a node graph, the rules'
and globs' checks, done on the keys before a byte is written.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptool.errors import PrefixNotFoundError, UnsupportedError, UsageError
from ckptool.formats.tensors import Source
from ckptool.model.graph import StateDictRef, find_state_dicts, mapping_items
from ckptool.model.keys import check_key_lengths
from ckptool.model.rename_plan import RenamePlan, RenameSummary, label, plan_keys
from ckptool.ops.convert import ConvertResult
from ckptool.ops.convert.outputs import write_outputs
from ckptool.ops.rewrite.prefixes import RenameResult
from ckptool.ops.rewrite.sets import SetFilesResult
from ckptool.ops.rewrite.stream import ProgressFn, WriteResult
from ckptool.ops.surgery.rules import RuleStep
from ckptool.readers import FORMATS
from ckptool.readers.read_safetensors import restore_library_aliases, safetensors_source
from ckptool.readers.read_torch import select_state_dict


# ------------------------------------------------------------------------------------------------ results
@dataclass
class RuleUse:
    """One rule (``REGEX=REPLACEMENT``) and the number of keys it ``matched``, over every selected state_dict."""

    rule: str
    matched: int


@dataclass(kw_only=True)
class RuleResult(RenameResult):
    """What :func:`rename` did to a file: the :class:`~ckptool.ops.rewrite.prefixes.RenameResult` fields (``dst`` is
    ``""``
    after a dry run; ``removed`` / ``added`` stay empty: rules are reported in ``rules``), ``rules``
    (:class:`RuleUse`, in order), ``renames`` (``(state_dict path, old key, new key)`` of every renamed key) and
    ``dry_run``."""

    rules: list[RuleUse] = field(default_factory=list)
    renames: list[tuple[str, str, str]] = field(default_factory=list)
    dry_run: bool = False

    def unit(self) -> str:
        """What :attr:`storages` counts: a DCP folder's records, else as :meth:`WriteResult.unit`."""
        return _surgery_unit(self)


@dataclass
class FilterChange:
    """One filtered state_dict: its dotted ``path``, its number of ``keys``, the keys ``kept`` and ``dropped``."""

    path: str
    keys: int
    kept: int
    dropped: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return label(self.path)


@dataclass(kw_only=True)
class FilterResult(WriteResult):
    """What :func:`filter_keys` did to a file: the :class:`~ckptool.ops.rewrite.stream.WriteResult` fields (``dst`` is
    ``""`` after a dry run), ``changes`` (:class:`FilterChange` per state_dict), ``globs`` (``(kind, glob,
    keys matched)`` with kind ``keep`` / ``drop``), ``extracted`` (the output is the state_dict at ``key`` alone)
    and ``dry_run``."""

    key: str | None = None
    changes: list[FilterChange] = field(default_factory=list)
    globs: list[tuple[str, str, int]] = field(default_factory=list)
    extracted: bool = False
    dry_run: bool = False

    @property
    def dropped(self) -> int:
        return sum(len(c.dropped) for c in self.changes)

    def unit(self) -> str:
        """What :attr:`storages` counts: a DCP folder's records, else as :meth:`WriteResult.unit`."""
        return _surgery_unit(self)


def _surgery_unit(res: WriteResult) -> str:
    spec = FORMATS.get(res.format_in)
    return "record" if spec is not None and spec.kind == "folder" else WriteResult.unit(res)




@dataclass(kw_only=True)
class SetRuleResult(RuleResult, SetFilesResult):
    """What :func:`~ckptool.ops.surgery.edit.rename` did to a sharded set or a DCP folder: :class:`RuleResult` plus
    :class:`~ckptool.ops.rewrite.sets.SetFilesResult` (``dst`` the output index or folder)."""


@dataclass(kw_only=True)
class SetFilterResult(FilterResult, SetFilesResult):
    """What :func:`~ckptool.ops.surgery.edit.filter_keys` did to a sharded set or a DCP folder: :class:`FilterResult`
    plus :class:`~ckptool.ops.rewrite.sets.SetFilesResult` (``dst`` the output index or folder)."""


# ------------------------------------------------------------------------------------------------ selection
def graph_targets(root: Any, key: str | None, where: str, action: str) -> list[StateDictRef]:
    """The state_dict at ``key`` (:func:`ckptool.readers.read_torch.select_state_dict`), or every state_dict
    found (pickled modules included: :func:`refuse_module` once it is known that one would change).

    Raises:
        UsageError: ``key`` names nothing or no mapping.
        UnsupportedError: no state_dict.
    """
    if key is not None:
        targets = [select_state_dict(root, key, where)]
    else:
        targets = find_state_dicts(root)
        if not targets:
            raise UnsupportedError(
                f"{where}: no state_dict found (a mapping of parameter names to tensors); pass --key PATH (key=...) "
                f"to select the mapping to {action}")
    return targets


def refuse_module(where: str, t: StateDictRef, action: str) -> None:
    """Raise the :class:`UnsupportedError` for a pickled ``nn.Module`` whose keys ``action`` would change."""
    raise UnsupportedError(
        f"{where}: {label(t.path)} is a pickled nn.Module (torch.save(model)), not a state_dict: its keys come from "
        f"its module tree, which {action} does not rebuild. Run `ckptool extract-state-dict {where}` first and "
        f"{action} that file")


def ref_keys(t: StateDictRef) -> list[str]:
    """The keys of a state_dict found in the graph: a module's ``state_dict()`` keys, a mapping's string keys."""
    return t.keys() if t.is_module else [k for k, _v in mapping_items(t.obj) or [] if isinstance(k, str)]



def plan_rules(targets: list[tuple[str, list[str]]], plan: RenamePlan, allow_unused: bool,
                where: str) -> tuple[list[dict[str, str]], RenameSummary, list[RuleUse]]:
    """Check ``plan`` on ``(path, keys)`` targets (:func:`ckptool.model.rename_plan.plan_keys`: collisions, FSDP
    flat parameters) and count the keys each rule matched.

    Raises:
        PrefixNotFoundError: a rule matches no key, unless ``allow_unused``.
        KeyCollisionError / UnsupportedError: from :func:`~ckptool.model.rename_plan.plan_keys`.
    """
    mappings, summary = plan_keys([(p, k, False) for p, k in targets], plan, allow_missing=True, where=where)
    uses = [RuleUse(s.text, summary.removed.get(s.prefixes[0], 0)) for s in plan.steps if isinstance(s, RuleStep)]
    summary.removed = {}
    for ch in summary.changes:
        ch.removed = {}
    unused = [(i, u) for i, u in enumerate(uses, 1) if not u.matched]
    if unused and not allow_unused:
        i, u = unused[0]
        sample = sample_keys(targets)
        raise PrefixNotFoundError(
            f"{where}: rule {i} ({u.rule}) matches no key (keys look like {sample}); nothing was written. Check it "
            "with --dry-run and `ckptool inspect`, or pass --allow-unused (allow_unused=True) to accept it")
    return mappings, summary, uses


def sample_keys(targets: list[tuple[str, list[str]]]) -> str:
    """The first three keys, for messages."""
    return ", ".join(repr(k) for k in itertools.islice((k for _p, keys in targets for k in keys), 3)) or "no keys"


def renames_of(targets: list[tuple[str, list[str]]], mappings: list[dict[str, str]]) -> list[tuple[str, str, str]]:
    return [(p, old, new) for (p, _k), m in zip(targets, mappings) for old, new in m.items() if old != new]



# ------------------------------------------------------------------------------------------------ filter
class Globs:
    """``keep`` / ``drop`` globs and how many keys each matched."""

    def __init__(self, keep: Sequence[str], drop: Sequence[str]) -> None:
        if not keep and not drop:
            raise UsageError("nothing to filter: give --keep GLOB and/or --drop GLOB (keep=[...], drop=[...])")
        self.keep, self.drop = list(keep), list(drop)
        self.hits = {("keep", g): 0 for g in self.keep} | {("drop", g): 0 for g in self.drop}

    def kept(self, k: str) -> bool:
        hit_keep = [g for g in self.keep if fnmatch.fnmatchcase(k, g)]
        hit_drop = [g for g in self.drop if fnmatch.fnmatchcase(k, g)]
        for g in hit_keep:
            self.hits[("keep", g)] += 1
        for g in hit_drop:
            self.hits[("drop", g)] += 1
        return (not self.keep or bool(hit_keep)) and not hit_drop

    def uses(self) -> list[tuple[str, str, int]]:
        return [(kind, g, n) for (kind, g), n in self.hits.items()]


def plan_filter(targets: list[tuple[str, list[str]]], globs: Globs, allow_unused: bool,
                 where: str) -> list[FilterChange]:
    """The :class:`FilterChange` of every ``(path, keys)`` target.

    Raises:
        PrefixNotFoundError: a glob matches no key (unless ``allow_unused``).
        UsageError: a state_dict would lose every key.
        CorruptCheckpointError: a key longer than :data:`~ckptool.model.keys.MAX_KEY_LENGTH`.
    """
    changes = []
    for path, keys in targets:
        check_key_lengths(keys, where)
        ch = FilterChange(path, len(keys), 0)
        for k in keys:
            if globs.kept(k):
                ch.kept += 1
            else:
                ch.dropped.append(k)
        changes.append(ch)
    unused = [(kind, g) for kind, g, n in globs.uses() if not n]
    if unused and not allow_unused:
        sample = sample_keys(targets)
        kind, g = unused[0]
        raise PrefixNotFoundError(
            f"{where}: --{kind} {g!r} matches no key (keys look like {sample}; a glob matches the whole key, e.g. "
            "'head.*'); nothing was written. Check it with --dry-run and `ckptool inspect`, or pass --allow-unused "
            "(allow_unused=True) to accept it")
    for ch in changes:
        if ch.keys and not ch.kept:
            raise UsageError(f"{where}: the globs drop every key of state_dict {ch.label} ({ch.keys} keys); nothing "
                             "was written. Keep at least one key")
    return changes



def safetensors_without(path: str, gone: set[str]) -> Source:
    """The safetensors file ``path`` read by ``convert``'s reader (tied names restored) without the tensors
    ``gone``; the records of dropped names (``save_model``'s ``alias -> kept``) go with them."""
    source = safetensors_source(path)
    restore_library_aliases(source)
    source.tensors = [t for t in source.tensors if t.name not in gone]
    for i, t in enumerate(source.tensors):
        t.index = i
    if source.metadata:
        source.metadata = {k: v for k, v in source.metadata.items() if k not in gone and v not in gone}
    return source


def write_safetensors_source(source: Source, out: str, progress: ProgressFn | None) -> WriteResult:
    """Write ``source`` (a safetensors file read by ``convert``'s reader, changed) to ``out`` with ``convert``'s
    writer: storage sharing recorded anew for the names written, read back and checked before it is renamed into
    place (:func:`ckptool.ops.convert.outputs.write_outputs`)."""
    cres = ConvertResult(source.path, out, source.format, "safetensors")
    write_outputs(source, out, "safetensors", None, None, lambda s: s, None, True, progress, cres)
    return WriteResult(source.path, out, source.format, storages=cres.stored, bytes_written=cres.bytes_written)


