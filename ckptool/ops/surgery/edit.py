"""``ckptool.rename`` (keys renamed by regex rules) and ``ckptool.filter_keys`` (keys kept or dropped by globs).

Both work on the state_dict(s) of a checkpoint, in a file or in memory, with the machinery of the prefix commands
(:mod:`ckptool.ops.rewrite.prefixes`): a file is opened once and read as a node graph
(:meth:`ckptool.readers.Opened.graph`, nothing imported or run), the selected state_dicts are changed in the graph
and the file is streamed anew (:func:`ckptool.ops.rewrite.stream.rewrite_file`: tensor records copied byte for
byte, torch never imported); a safetensors file gets a new header. Outputs are atomic; nothing is written when an
error is raised.

Selection, as for the prefix commands: ``key`` (a dotted path) selects one state_dict; without it every state_dict
:func:`ckptool.model.graph.find_state_dicts` finds is changed (never optimizer state).

**Rules.** A rule ``(REGEX, REPLACEMENT)`` is ``re.sub(REGEX, REPLACEMENT, key)`` on the whole fully qualified name
(Python ``re`` syntax, ``\\1`` / ``\\g<name>`` groups), the rules applied in order, each to what the previous one
made: mmengine's ``load_checkpoint(revise_keys=[(r'^module\\.', '')])``. The prefix commands are special cases:
``^module\\.`` -> ``""`` is ``strip-dataparallel``, ``^`` -> ``module.`` is ``add-prefix module.``. A rule is a
step of a :class:`~ckptool.model.rename_plan.RenamePlan` (:class:`RuleStep`), so the plan's checks apply: two keys
that would get one name are refused (:class:`~ckptool.errors.KeyCollisionError`), FSDP flat parameters are refused,
and ``_metadata`` follows the keys (:func:`ckptool.model.keys.rename_metadata_items`). A rule that matches no key
of any selected state_dict is refused unless ``allow_unused``.

**Globs.** ``keep`` / ``drop`` are :func:`fnmatch.fnmatchcase` patterns on the whole key (``*`` also matches dots):
a key stays when it matches a ``keep`` glob (or none is given) and no ``drop`` glob. ``_metadata`` is kept as it
is (its entries name modules, which may hold no tensor). The storages no kept tensor uses are not written, so the
dropped tensors' bytes leave the file. With ``key``, the output is that state_dict alone (extracted from a training
checkpoint); without it, the rest of the checkpoint stays.

Pickled ``nn.Module`` objects (``torch.save(model)``) are refused: run ``ckptool extract-state-dict`` first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

from ckptool.errors import UnsupportedError, UsageError
from ckptool.model.graph import mapping_items, set_mapping_items
from ckptool.model.objects import find_object_state_dicts
from ckptool.model.paths import resolve_path
from ckptool.model.rename_memory import copy_meta, new_like, rename_mapping, replace_at
from ckptool.model.rename_plan import RenamePlan, RenameSummary
from ckptool.ops.rewrite.folders import model_folder, write_output
from ckptool.ops.rewrite.prefixes import MappingT, PathArg, rename_graph, rewrite_safetensors
from ckptool.ops.rewrite.sets import (
    dcp_folder,
    dcp_output,
    prune_storages,
    refuse_existing_set,
    rewrite_output,
    set_output,
)
from ckptool.ops.rewrite.stream import ProgressFn, WriteResult, output_path, retag_function, rewrite_file
from ckptool.ops.surgery.plan import (
    FilterChange,
    FilterResult,
    Globs,
    RuleResult,
    RuleUse,
    SetFilterResult,
    SetRuleResult,
    graph_targets,
    plan_filter,
    plan_rules,
    ref_keys,
    refuse_module,
    renames_of,
    safetensors_without,
    write_safetensors_source,
)
from ckptool.ops.surgery.rules import RuleLike, RuleStep, load_rules, rules_plan
from ckptool.ops.surgery.sets import filter_dcp, filter_set, rename_dcp, rename_set
from ckptool.readers import Checkpoint, Opened, open_checkpoint
from ckptool.readers.read_safetensors import restore_library_aliases
from ckptool.readers.structures import SHARED_KEY

__all__ = ["FilterChange", "FilterResult", "RuleResult", "RuleStep", "RuleUse", "SetFilterResult", "SetRuleResult",
           "filter_keys", "load_rules", "rename", "rules_plan", "surgery_output"]


#: what :func:`_many` binds returns (a :class:`SetRuleResult` or a :class:`SetFilterResult`)
_R = TypeVar("_R")


def _is_tensor_value(v: object) -> bool:
    torch = sys.modules.get("torch")  # a mapping can hold torch tensors only once its caller imported torch
    return torch is not None and isinstance(v, torch.Tensor)


def _memory_targets(obj: Mapping[Any, Any], key: str | None) -> list[tuple[list[Any], Mapping[Any, Any], str]]:
    """``(keys from obj, state_dict, dotted path)`` of the selected state_dicts of a loaded mapping.

    Raises:
        UsageError: ``key`` names nothing, or no mapping.
        UnsupportedError: no state_dict found.
    """
    if key is not None:
        try:
            trail = resolve_path(obj, key)
        except KeyError:
            raise UsageError(f"no entry {key!r} (key=) in the given mapping") from None
        sd = trail[-1].child if trail else obj
        if not isinstance(sd, Mapping) or any(not isinstance(link.parent, (Mapping, list, tuple)) for link in trail):
            raise UsageError(f"key={key!r} selects a {type(sd).__name__}, not a state_dict mapping")
        return [([link.key for link in trail], sd, key)]
    found = find_object_state_dicts(obj, _is_tensor_value)
    if not found:
        raise UnsupportedError("no state_dict found in the given mapping (string keys mapped to tensors); pass "
                               "key=... to select one")
    return [([link.key for link in ref.trail], ref.obj, ref.path) for ref in found]


# ------------------------------------------------------------------------------------------------ rename
@overload
def rename(src: MappingT, dst: None = None, *, rules: Iterable[RuleLike], key: str | None = None,
           in_place: Literal[False] = False, allow_unused: bool = False, dry_run: bool = False) -> MappingT: ...
@overload
def rename(src: PathArg, dst: PathArg | None = None, *, rules: Iterable[RuleLike], key: str | None = None,
           in_place: bool = False, allow_unused: bool = False, dry_run: bool = False, to: str | None = None,
           mapping: Mapping[str, str] | None = None, progress: ProgressFn | None = None) -> RuleResult: ...
def rename(src: MappingT | PathArg, dst: PathArg | None = None, *, rules: Iterable[RuleLike],
           key: str | None = None, in_place: bool = False, allow_unused: bool = False, dry_run: bool = False,
           to: str | None = None, mapping: Mapping[str, str] | None = None,
           progress: ProgressFn | None = None) -> MappingT | RuleResult:
    """Rename the keys of the state_dict(s) of ``src`` by regex ``rules`` (see the module docstring).

    ``rules`` are ``"REGEX=REPLACEMENT"`` strings (split at the last ``=``) or ``(REGEX, REPLACEMENT)`` pairs
    (:func:`load_rules` reads them from a file). ``src`` is a checkpoint path (torch zip, legacy or safetensors) or an
    in-memory mapping. For a path the output goes to ``dst`` (default ``<stem>.renamed<ext>`` beside ``src``;
    ``in_place`` replaces ``src`` atomically), a torch zip file (safetensors for a safetensors input) that loads with
    ``torch.load(dst, weights_only=True)`` when the input did; returns a :class:`RuleResult` (``dry_run``: nothing
    written, the result says what would be renamed). A model folder holding one weights file, given as the folder,
    is written as a folder (by default ``<folder>.renamed``) with its other files copied, listed in the result's
    ``kept`` (:mod:`ckptool.ops.rewrite.folders`). ``to`` / ``mapping`` re-tag the storages of a torch output in
    the same pass, as :func:`ckptool.ops.rewrite.remap.remap` does (``allow_unused`` also lets a ``mapping`` source that
    matches no storage pass). For a mapping, returns a new mapping of the same type (values
    are the same objects, ``_metadata`` renamed); nothing is mutated.

    Raises:
        UsageError: bad rule, ``key`` naming no mapping, ``dst`` equal to ``src`` without ``in_place``, ``dst`` /
            ``in_place`` / ``to`` / ``mapping`` with a mapping, ``key`` / ``to`` / ``mapping`` with a safetensors
            file, a bad device string.
        PrefixNotFoundError: a rule matches no key (unless ``allow_unused``); nothing written.
        DeviceNotFoundError: a ``mapping`` source matches no storage (unless ``allow_unused``).
        KeyCollisionError: two keys would get one name (listed); nothing written.
        UnsupportedError: no state_dict, a pickled ``nn.Module``, FSDP flat parameters, TorchScript / plain pickle.
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    plan = rules_plan(rules)
    if isinstance(src, Mapping):
        _refuse_file_options(dst, in_place, to, mapping)
        found = _memory_targets(src, key)
        plan_rules([(p, [k for k in sd if isinstance(k, str)]) for _t, sd, p in found], plan, allow_unused,
                    "state_dict")
        renamed: MappingT = src if dry_run else rename_mapping(src, plan, key=key, allow_missing=True)
        return renamed
    path = _file_path(src, "rename")
    opened = open_checkpoint(path)
    many = _many(opened, dst, in_place, dry_run, "renamed", (rename_dcp, rename_set))
    if many is not None:
        return many(plan, key=key, allow_unused=allow_unused, dry_run=dry_run, to=to, mapping=mapping,
                    progress=progress)
    opened = _rewritable(opened, "renamed")
    header = opened.tensor_header()  # a safetensors file: its tensors renamed in its header
    if header is not None:
        _refuse_safetensors_options(path, key, to, mapping)

    def one(out: str) -> tuple[_Planned, WriteResult]:
        if header is not None:
            return _rename_safetensors(opened, out, plan, allow_unused, dry_run, progress)
        return _rename_torch(opened.graph(), out, plan, key, allow_unused, dry_run, (to, mapping), progress)

    planned, write = one("") if dry_run else write_output(
        opened, rewrite_output(opened, dst, "renamed", in_place), one, lambda r: r[1])
    targets, mappings, summary, uses = planned
    fields = {k: v for k, v in vars(write).items() if k in WriteResult.__dataclass_fields__}
    return RuleResult(**fields, **vars(summary), operation="rename", rules=uses,
                      renames=renames_of(targets, mappings), dry_run=dry_run)


#: what :func:`plan_rules` planned: the ``(path, keys)`` targets, their ``{old: new}`` mappings, the summary, the
#: rules' uses
_Planned = tuple[list[tuple[str, list[str]]], list[dict[str, str]], RenameSummary, list[RuleUse]]


def _rename_safetensors(opened: Opened, out: str, plan: RenamePlan, allow_unused: bool, dry_run: bool,
                        progress: ProgressFn | None) -> tuple[_Planned, WriteResult]:
    """A safetensors file: a new header over the data block copied as it is (:mod:`ckptool.ops.rewrite.prefixes`'s), or,
    when it records tied names, through ``convert``'s reader and writer so that the records name the new keys."""
    path = opened.target
    header = opened.safetensors_header()
    source = None
    if header.metadata and (SHARED_KEY in header.metadata or header.aliases()):
        source = opened.state_dict()
        restore_library_aliases(source)
        targets = [("", [t.name for t in source.tensors])]
    else:
        targets = [("", list(header.entries))]
    mappings, summary, uses = plan_rules(targets, plan, allow_unused, path)
    if dry_run:
        write = WriteResult(path, "", opened.format, storages=len(targets[0][1]))
    elif source is not None:
        for t in source.tensors:
            t.name = mappings[0][t.name]
        write = write_safetensors_source(source, out, progress)
    else:
        write = rewrite_safetensors(opened, out, plan, key=None, allow_missing=True, operation="rename",
                                     progress=progress)
    return (targets, mappings, summary, uses), write


def _rename_torch(ck: Checkpoint, out: str, plan: RenamePlan, key: str | None, allow_unused: bool, dry_run: bool,
                  retag: tuple[str | None, Mapping[str, str] | None],
                  progress: ProgressFn | None) -> tuple[_Planned, WriteResult]:
    """A torch zip or legacy file: the graph renamed by :func:`ckptool.ops.rewrite.prefixes.rename_graph`, streamed
    anew."""
    location_fn = retag_function(ck, *retag, allow_missing=allow_unused)
    refs = graph_targets(ck.root, key, ck.path, "rename")
    targets = [(t.path, ref_keys(t)) for t in refs]
    mappings, summary, uses = plan_rules(targets, plan, allow_unused, ck.path)
    for ref, m in zip(refs, mappings):
        if ref.is_module and any(old != new for old, new in m.items()):
            refuse_module(ck.path, ref, "rename")
    if dry_run:
        write = WriteResult(ck.path, "", ck.format, storages=len(ck.storages))
    else:
        root, _summary = rename_graph(ck.root, plan, key=key, allow_missing=True, where=ck.path)
        write = rewrite_file(ck, out, root, location_fn, progress=progress)
    return (targets, mappings, summary, uses), write


def _refuse_file_options(dst: object, in_place: bool, to: str | None, mapping: Mapping[str, str] | None) -> None:
    if dst is not None or in_place or to is not None or mapping:
        raise UsageError("dst, in_place, to and mapping apply to files; for an in-memory state_dict the new mapping is "
                         "returned (move its tensors with .to())")


def _refuse_safetensors_options(path: str, key: str | None, to: str | None,
                                mapping: Mapping[str, str] | None) -> None:
    if key is not None:
        raise UsageError(f"{path} is safetensors: it holds one flat mapping of tensors, so --key does not apply")
    if to is not None or mapping:
        raise UsageError(f"{path} is safetensors: it carries no location tags, so --to / --map do not apply (load it "
                         "on any device with safetensors.torch.load_file(path, device=...))")


def _opt(p: str | os.PathLike[str] | None) -> str | None:
    return os.fspath(p) if p is not None else None


def _file_path(src: Any, fn: str) -> str:
    if not isinstance(src, (str, os.PathLike)):
        hint = " (pass model.state_dict(), or the path of a saved file)" if hasattr(src, "state_dict") else ""
        raise UsageError(f"{fn}: expected a checkpoint path or a state_dict mapping, got {type(src).__name__}{hint}")
    return os.fspath(src)


def _many(opened: Opened, dst: str | os.PathLike[str] | None, in_place: bool, dry_run: bool, tag: str,
          ops: tuple[Callable[..., _R], Callable[..., _R]]) -> Callable[..., _R] | None:
    """For a DCP folder or a sharded set, ``ops`` (its DCP, its set function of :mod:`ckptool.ops.surgery.sets`)
    bound to the input and the output folder (``dst``, or ``<folder>.<tag>`` beside it; ``""`` for a dry run);
    None for one file.

    Raises:
        UsageError: ``in_place`` (a set or folder is written anew elsewhere).
    """
    folder = dcp_folder(opened)
    if folder is not None:
        out = dcp_output(folder, dst, tag, in_place)
        return lambda *a, **k: ops[0](opened, "" if dry_run else out, *a, **k)
    if opened.spec.kind == "set":
        out = set_output(opened.target, dst, tag, in_place)
        return lambda *a, **k: ops[1](opened, "" if dry_run else out, *a, **k)
    return None


def surgery_output(src: str, dst: str | None, in_place: bool, tag: str, *, force: bool) -> str:
    """The output :func:`rename` (``tag="renamed"``) or :func:`filter_keys` (``"filtered"``) writes for ``src``:
    ``dst``, ``src`` with ``in_place``, ``<stem>.<tag><ext>`` beside a file, the folder ``<folder>.<tag>`` beside a
    sharded set's folder, a DCP folder or a model folder holding one weights file
    (:func:`ckptool.ops.rewrite.sets.rewrite_output`).

    Raises:
        UsageError: ``in_place`` for a set or folder; ``dst`` equal to ``src`` without ``in_place``; files of a
            set (or the weights file of a model folder) at the output, unless ``force``
            (:func:`ckptool.ops.rewrite.sets.refuse_existing_set`).
    """
    opened = open_checkpoint(src)
    folder = dcp_folder(opened)
    if folder is not None:
        return dcp_output(folder, dst, tag, in_place)
    if opened.spec.kind == "set" or model_folder(opened) is not None:
        out = rewrite_output(opened, dst, tag, in_place)
        refuse_existing_set(opened, out, force=force)
        return out
    return output_path(src, dst, in_place, tag)


def _rewritable(opened: Opened, done: str) -> Opened:
    """``opened`` (:func:`ckptool.readers.open_checkpoint`) when its keys can be ``done`` (renamed / filtered) here:
    one torch.save or safetensors file.

    Raises:
        UsageError / NotACheckpointError: a folder that is not a DCP checkpoint (a DeepSpeed folder)
            (:meth:`ckptool.readers.Opened.require_file`).
        UnsupportedError: TorchScript, plain pickle, ``.pt2``, torch.package.
    """
    path = opened.path
    opened = opened.require_file()
    refusal = opened.spec.refusal_for("edit", path, done=done)
    if refusal is not None:
        raise UnsupportedError(refusal)
    return opened


def _filter_torch(ck: Checkpoint, out: str, globs: Globs, key: str | None, allow_unused: bool, dry_run: bool,
                  retag: tuple[str | None, Mapping[str, str] | None], progress: ProgressFn | None) -> FilterResult:
    location_fn = retag_function(ck, *retag, allow_missing=allow_unused)
    found = graph_targets(ck.root, key, ck.path, "filter")
    targets = [(t.path, ref_keys(t)) for t in found]
    changes = plan_filter(targets, globs, allow_unused, ck.path)
    for t, ch in zip(found, changes):
        if t.is_module and (ch.dropped or key is not None):  # --key would write the module object: not a state_dict
            refuse_module(ck.path, t, "filter")
    res = FilterResult(ck.path, "", ck.format, key=key, changes=changes, globs=globs.uses(),
                       extracted=key is not None, dry_run=dry_run)
    if dry_run:
        return res
    for t, ch in zip(found, changes):
        if ch.dropped:
            gone = set(ch.dropped)
            set_mapping_items(t.obj, [(k, v) for k, v in mapping_items(t.obj) or [] if k not in gone])
    root = found[0].obj if key is not None else ck.root
    ck = prune_storages(ck, root)  # the records of storages nothing refers to any more are not written
    w = rewrite_file(ck, out, root, location_fn, progress=progress)
    res.dst, res.storages, res.bytes_written, res.retagged = out, w.storages, w.bytes_written, w.retagged
    return res


def _filter_safetensors(opened: Opened, out: str, globs: Globs, allow_unused: bool, dry_run: bool,
                        progress: ProgressFn | None) -> FilterResult:
    """A safetensors file through ``convert``'s reader and writer: the kept tensors (tied names restored, the sharing
    records rewritten for what is kept), read back and checked before it is renamed into place."""
    path = opened.target
    source = opened.state_dict()
    restore_library_aliases(source)
    targets = [("", [t.name for t in source.tensors])]
    changes = plan_filter(targets, globs, allow_unused, path)
    res = FilterResult(path, "", opened.format, changes=changes, globs=globs.uses(), dry_run=dry_run)
    if dry_run:
        return res
    w = write_safetensors_source(safetensors_without(path, set(changes[0].dropped)), out, progress)
    res.dst, res.storages, res.bytes_written = out, w.storages, w.bytes_written
    return res


def _filter_memory(obj: Mapping[Any, Any], globs: Globs, key: str | None, allow_unused: bool,
                   dry_run: bool) -> Mapping[Any, Any]:
    """:func:`filter_keys` of a loaded mapping: a new mapping of its type (the state_dict at ``key`` alone, when
    given), ``obj`` itself for a dry run."""
    found = _memory_targets(obj, key)
    targets = [(p, [k for k in sd if isinstance(k, str)]) for _t, sd, p in found]
    changes = plan_filter(targets, globs, allow_unused, "state_dict")
    if dry_run:
        return obj
    result: Any = obj
    for (trail, sd, _p), ch in zip(found, changes):
        gone = set(ch.dropped)
        new: Mapping[Any, Any] = copy_meta(sd, new_like(sd, [(k, v) for k, v in sd.items() if k not in gone]))
        if key is not None:
            return new
        result = replace_at(result, trail, new)
    out: Mapping[Any, Any] = result if result is not obj else copy_meta(obj, new_like(obj, obj.items()))
    return out


@overload
def filter_keys(src: Mapping[Any, Any], dst: None = None, *, keep: str | Sequence[str] = (),
                drop: str | Sequence[str] = (), key: str | None = None, in_place: Literal[False] = False,
                allow_unused: bool = False, dry_run: bool = False) -> Mapping[Any, Any]: ...
@overload
def filter_keys(src: PathArg, dst: PathArg | None = None, *, keep: str | Sequence[str] = (),
                drop: str | Sequence[str] = (), key: str | None = None, in_place: bool = False,
                allow_unused: bool = False, dry_run: bool = False, to: str | None = None,
                mapping: Mapping[str, str] | None = None, progress: ProgressFn | None = None) -> FilterResult: ...
def filter_keys(src: Mapping[Any, Any] | PathArg, dst: PathArg | None = None, *, keep: str | Sequence[str] = (),
                drop: str | Sequence[str] = (), key: str | None = None, in_place: bool = False,
                allow_unused: bool = False, dry_run: bool = False, to: str | None = None,
                mapping: Mapping[str, str] | None = None,
                progress: ProgressFn | None = None) -> Mapping[Any, Any] | FilterResult:
    """Keep the keys of the state_dict(s) of ``src`` that match a ``keep`` glob (all, when none is given) and no
    ``drop`` glob (:func:`fnmatch.fnmatchcase` on the whole key; see the module docstring).

    With ``key`` the result is that state_dict alone (extracted, e.g. ``key="state_dict_ema"`` from a timm training
    checkpoint); without it every state_dict found is filtered and the rest of the checkpoint kept. For a path the
    output goes to ``dst`` (default ``<stem>.filtered<ext>``; ``in_place`` replaces ``src``), without the bytes of
    the dropped tensors; returns a :class:`FilterResult` listing what was dropped (``dry_run``: nothing written).
    A model folder holding one weights file is written as a folder, as :func:`rename` writes it.
    ``to`` / ``mapping`` re-tag the storages of a torch output as in :func:`rename`.
    For a mapping, returns a new mapping of the same type (``_metadata`` kept); nothing is mutated.

    Raises:
        UsageError: no glob, ``key`` naming no mapping, a state_dict that would lose every key, ``dst`` equal to
            ``src`` without ``in_place``, ``key`` / ``to`` / ``mapping`` with a safetensors file, file options with
            a mapping.
        PrefixNotFoundError: a glob matches no key (unless ``allow_unused``); nothing written.
        DeviceNotFoundError: a ``mapping`` source matches no storage (unless ``allow_unused``).
        UnsupportedError: no state_dict, a pickled ``nn.Module``, TorchScript / plain pickle / ``.pt2``.
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    globs = Globs([keep] if isinstance(keep, str) else list(keep), [drop] if isinstance(drop, str) else list(drop))
    if isinstance(src, Mapping):
        _refuse_file_options(dst, in_place, to, mapping)
        return _filter_memory(src, globs, key, allow_unused, dry_run)
    path = _file_path(src, "filter_keys")
    opened = open_checkpoint(path)
    many = _many(opened, dst, in_place, dry_run, "filtered", (filter_dcp, filter_set))
    if many is not None:
        return many(globs, key=key, allow_unused=allow_unused, dry_run=dry_run, to=to, mapping=mapping,
                    progress=progress)
    opened = _rewritable(opened, "filtered")
    header = opened.tensor_header()  # a safetensors file: its tensors renamed in its header
    if header is not None:
        _refuse_safetensors_options(path, key, to, mapping)

    def one(out: str) -> FilterResult:
        if header is not None:
            return _filter_safetensors(opened, out, globs, allow_unused, dry_run, progress)
        return _filter_torch(opened.graph(), out, globs, key, allow_unused, dry_run, (to, mapping), progress)

    return one("") if dry_run else write_output(opened, rewrite_output(opened, dst, "filtered", in_place), one)
