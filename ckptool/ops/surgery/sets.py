"""``rename`` and ``filter`` (:mod:`ckptool.ops.surgery.edit`) on a sharded set (``*.index.json`` or its folder) and on
a ``torch.distributed.checkpoint`` folder, with the machinery of the prefix commands on those formats.

**Sharded sets** (:func:`ckptool.ops.rewrite.sets.rewrite_set`): the set holds one flat state_dict, so the rules
and globs are checked on the keys of every shard at once (a rule or glob that matches nothing in the whole set is
refused, two keys of different shards renamed to one name too), before a byte is written. ``rename`` writes a set
of the same layout: every shard renamed as the single-file command renames a file (a safetensors shard gets a new
header over its data block, a torch shard a new pickle over its records copied byte for byte), the index's
``weight_map`` renamed and its ``metadata`` kept. ``filter`` writes every shard without the dropped tensors (torch
shards without their storages, safetensors shards through ``convert``'s writer as a single file is filtered); a
shard left with no tensor is not written and the shards kept are numbered anew as ``transformers`` names them
(``model-00001-of-00002.safetensors``); the index is written with the kept names and ``total_size`` counted anew.
``--key`` does not apply (the shards are the state_dict).

**DCP folders** (:func:`ckptool.ops.rewrite.dcp.rewrite_dcp`): the rules and globs apply to the state_dicts of the
folder's nesting (``{"model": model.state_dict(), "optim": ...}``) exactly as the file commands apply them to the
file ``dcp_to_torch_save`` writes of the folder: the same state_dicts found, ``--key`` selecting one (``filter
--key model`` writes that state_dict alone: its entries named from it, the others dropped). ``rename`` renames the
FQNs in ``.metadata`` and copies the ``.distcp`` files byte for byte; ``filter`` leaves the dropped entries out of
``.metadata`` and their records' bytes out of the data files (a file holding a dropped record is laid out anew
around the records kept; a file left with none is not written).

Outputs are folders (default ``<folder>.renamed`` / ``<folder>.filtered`` beside the input's), written whole or not
at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptool.model.graph import mapping_items, set_mapping_items
from ckptool.model.rename_plan import RenamePlan
from ckptool.ops.rewrite.dcp import rewrite_dcp
from ckptool.ops.rewrite.prefixes import rename_graph
from ckptool.ops.rewrite.sets import open_set, rewrite_set, set_location_function
from ckptool.ops.rewrite.stream import ProgressFn, WriteResult
from ckptool.ops.surgery.plan import (
    Globs,
    SetFilterResult,
    SetRuleResult,
    graph_targets,
    plan_filter,
    plan_rules,
    ref_keys,
    renames_of,
    safetensors_without,
    write_safetensors_source,
)
from ckptool.readers import Opened

__all__ = ["filter_dcp", "filter_set", "rename_dcp", "rename_set"]

#: the fields a set's or folder's result takes from what was written
_WRITTEN = ("dst", "storages", "bytes_written", "retagged", "files", "notes", "shards", "kept")


def _written(w: object) -> dict[str, Any]:
    return {k: getattr(w, k) for k in _WRITTEN}


def rename_set(index: str | Opened, dst: str, plan: RenamePlan, *, key: str | None, allow_unused: bool, dry_run: bool,
               to: str | None, mapping: Mapping[str, str] | None, progress: ProgressFn | None) -> SetRuleResult:
    """Rename the keys of the sharded set of ``index`` by the rules ``plan`` into ``dst`` (see the module docstring).

    Raises:
        UsageError: ``key``; ``to`` / ``mapping`` with safetensors shards; a bad output name.
        PrefixNotFoundError: a rule matches no key of the set, unless ``allow_unused``.
        KeyCollisionError: two keys of the set would get one name.
        UnsupportedError / CorruptCheckpointError: as :func:`ckptool.ops.rewrite.sets.open_set`.
    """
    s = open_set(index, key=key)
    set_location_function(s, to, mapping, renaming=True, allow_missing=allow_unused)
    targets = [("", s.names)]
    mappings, summary, uses = plan_rules(targets, plan, allow_unused, s.path)
    written: dict[str, Any] = {"dst": "", "storages": len(s.names), "shards": len(s.shards)}
    if not dry_run:
        written = _written(rewrite_set(s, dst, operation="rename", plan=plan, to=to, mapping=mapping,
                                       allow_missing=allow_unused, progress=progress))
    return SetRuleResult(src=s.path, format_in=s.shards[0].fmt, **written, **vars(summary), operation="rename",
                         rules=uses, renames=renames_of(targets, mappings), dry_run=dry_run)


def rename_dcp(src: Opened, dst: str, plan: RenamePlan, *, key: str | None, allow_unused: bool, dry_run: bool,
               to: str | None, mapping: Mapping[str, str] | None, progress: ProgressFn | None) -> SetRuleResult:
    """Rename the FQNs of the DCP folder ``src`` by the rules ``plan`` into the new folder ``dst`` (see the module
    docstring); ``key`` selects one state_dict of its nesting.

    Raises:
        UsageError: ``key`` naming nothing; ``dst`` not a new or empty folder.
        PrefixNotFoundError: a rule matches no key, unless ``allow_unused``.
        KeyCollisionError: two entries would get one name.
        UnsupportedError / UnsafeCheckpointError / CorruptCheckpointError: as
            :func:`ckptool.ops.rewrite.dcp.rewrite_dcp`.
    """
    folder = src.target
    planned: dict[str, Any] = {}

    def renamer(root: Any) -> Any:
        refs = graph_targets(root, key, folder, "rename")
        targets = [(t.path, ref_keys(t)) for t in refs]
        mappings, summary, uses = plan_rules(targets, plan, allow_unused, folder)
        planned.update(rules=uses, renames=renames_of(targets, mappings))
        root, _summary = rename_graph(root, plan, key=key, allow_missing=True, where=folder)
        return root, summary

    w = rewrite_dcp(src, dst, operation="rename", rename=renamer, to=to, mapping=mapping,
                    allow_missing=allow_unused, dry_run=dry_run, progress=progress)
    return SetRuleResult(**vars(w), **planned, dry_run=dry_run)


def _write_subset(path: str, out: str, gone: set[str], progress: ProgressFn | None) -> WriteResult:
    """A safetensors shard without the tensors ``gone``, through ``convert``'s reader and writer (read back and
    checked), as :func:`ckptool.ops.surgery.edit.filter_keys` filters a safetensors file."""
    return write_safetensors_source(safetensors_without(path, gone), out, progress)


def filter_set(index: str | Opened, dst: str, globs: Globs, *, key: str | None, allow_unused: bool, dry_run: bool,
               to: str | None, mapping: Mapping[str, str] | None, progress: ProgressFn | None) -> SetFilterResult:
    """Keep the keys of the sharded set of ``index`` that ``globs`` keep, into ``dst`` (see the module docstring).

    Raises:
        UsageError: ``key``; ``to`` / ``mapping`` with safetensors shards; every key dropped; a bad output name.
        PrefixNotFoundError: a glob matches no key of the set, unless ``allow_unused``.
        UnsupportedError / CorruptCheckpointError: as :func:`ckptool.ops.rewrite.sets.open_set`.
    """
    s = open_set(index, key=key)
    set_location_function(s, to, mapping, renaming=True, allow_missing=allow_unused)
    changes = plan_filter([("", s.names)], globs, allow_unused, s.path)
    res = SetFilterResult(s.path, "", s.shards[0].fmt, changes=changes, globs=globs.uses(), dry_run=dry_run,
                          shards=len(s.shards))
    if dry_run:
        return res
    w = rewrite_set(s, dst, operation="filter", drop=changes[0].dropped, to=to, mapping=mapping,
                    allow_missing=allow_unused, write_subset=_write_subset, progress=progress)
    for k, v in _written(w).items():
        setattr(res, k, v)
    return res


def filter_dcp(src: Opened, dst: str, globs: Globs, *, key: str | None, allow_unused: bool, dry_run: bool,
               to: str | None, mapping: Mapping[str, str] | None, progress: ProgressFn | None) -> SetFilterResult:
    """Keep the entries of the DCP folder ``src`` that ``globs`` keep in the state_dicts of its nesting, into the new
    folder ``dst`` (see the module docstring); with ``key``, that state_dict alone.

    Raises:
        UsageError: ``key`` naming nothing; a state_dict that would lose every key; ``dst`` not a new or empty
            folder.
        PrefixNotFoundError: a glob matches no key, unless ``allow_unused``.
        UnsupportedError / UnsafeCheckpointError / CorruptCheckpointError: as
            :func:`ckptool.ops.rewrite.dcp.rewrite_dcp`.
    """
    folder = src.target
    res = SetFilterResult(folder, "", src.format, key=key, globs=[], extracted=key is not None, dry_run=dry_run)

    def dropper(root: Any) -> Any:
        found = graph_targets(root, key, folder, "filter")
        res.changes = plan_filter([(t.path, ref_keys(t)) for t in found], globs, allow_unused, folder)
        res.globs = globs.uses()
        for t, ch in zip(found, res.changes):
            gone = set(ch.dropped)
            set_mapping_items(t.obj, [(k, v) for k, v in mapping_items(t.obj) or [] if k not in gone])
        return found[0].obj if key is not None else root

    w = rewrite_dcp(src, dst, operation="filter", drop=dropper, to=to, mapping=mapping,
                    allow_missing=allow_unused, dry_run=dry_run, progress=progress)
    for k, v in _written(w).items():
        setattr(res, k, v)
    return res
