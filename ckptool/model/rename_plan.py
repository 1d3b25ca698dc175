"""Renaming plans for state_dict keys: what to strip, unwrap or add, checked before anything is written.

A :class:`RenamePlan` is a sequence of :class:`Step` applied to every key of a selected state_dict (whole dotted
components only, :mod:`ckptool.model.keys`); :func:`plan_keys` checks a plan against the keys of every selected
state_dict (FSDP flat parameters, collisions, prefixes that no key carries) and returns the mappings and a
:class:`RenameSummary`. Nothing here reads or writes a file or imports torch: :mod:`ckptool.ops.rewrite.prefixes`
applies the
plans to files and node graphs, :mod:`ckptool.model.rename_memory` to loaded mappings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ckptool.errors import NestedPrefixError, PrefixNotFoundError, UnsupportedError, UsageError
from ckptool.model.keys import (
    WRAPPER_COMPONENTS,
    attribute_prefix,
    check_key_lengths,
    is_flat_param_key,
    normalize_prefix,
    raise_on_collisions,
    rename_metadata_items,
    unwrap_key,
)

__all__ = ["RenamePlan", "RenameSummary", "StateDictChange", "Step", "build_plan", "label", "plan_keys"]

_V = TypeVar("_V")
#: a state_dict to plan for: ``(dotted path, its str keys in order, is a pickled module)``
PlanTarget = tuple[str, list[str], bool]


@dataclass(frozen=True)
class Step:
    """One renaming step on a key.

    ``kind`` is ``"strip"`` (remove each of ``prefixes`` from the front, in order, at most once each, only while
    a component stays after it), ``"add"`` (put ``prefixes[0]`` in front) or ``"unwrap"``
    (:func:`ckptool.model.keys.unwrap_key`; ``prefixes`` holds the attribute prefix that every key of the
    state_dict shares, once the plan is bound to its keys by :meth:`RenamePlan.bind`). Prefixes are normalised
    whole components ending in ``.``.
    """

    kind: str
    prefixes: tuple[str, ...] = ()

    def apply(self, key: str) -> tuple[str, list[str], list[str]]:
        """``(new_key, removed, added)``; removed / added are prefixes or components with their trailing dot."""
        if self.kind == "strip":
            removed = []
            for p in self.prefixes:
                if key.startswith(p) and len(key) > len(p):
                    key = key[len(p):]
                    removed.append(p)
            return key, removed, []
        if self.kind == "add":
            return self.prefixes[0] + key, [], [self.prefixes[0]]
        new, comps = unwrap_key(key, self.prefixes[0][:-1] if self.prefixes else None)
        return new, [c + "." for c in comps], []


@dataclass(frozen=True)
class RenamePlan:
    """The steps applied to every key of a selected state_dict, in order (see :func:`build_plan`);
    ``allow_nested`` lets an added prefix go in front of keys that already carry it."""

    steps: tuple[Step, ...]
    allow_nested: bool = False

    def bind(self, keys: Iterable[str]) -> RenamePlan:
        """This plan for one state_dict with these keys: each unwrap step gets the attribute prefix the keys share
        at that point (:func:`ckptool.model.keys.attribute_prefix`, Lightning's ``model.``), so unwrap removes every
        prefix ``inspect`` calls a wrapper. Rename (and rename ``_metadata``) with the bound plan."""
        current = list(keys)
        steps: list[Step] = []
        for step in self.steps:
            attr = attribute_prefix(current) if step.kind == "unwrap" else None
            bound = Step("unwrap", (attr + ".",) if attr else ()) if step.kind == "unwrap" else step
            steps.append(bound)
            current = [bound.apply(k)[0] for k in current]
        return replace(self, steps=tuple(steps))

    def rename(self, key: str) -> str:
        """The new name of ``key``."""
        for s in self.steps:
            key = s.apply(key)[0]
        return key

    def rename_metadata(self, items: Iterable[tuple[Any, _V]]) -> list[tuple[Any, _V]]:
        """The entries of a state_dict's ``_metadata`` with module paths renamed to match :meth:`rename`
        (:func:`ckptool.model.keys.rename_metadata_items`: the later of two entries that end on one path wins)."""
        return rename_metadata_items(items, self.rename)

    def trace(self, key: str) -> tuple[str, list[list[str]], list[str]]:
        """``(new_key, removed per step, added)``."""
        removed: list[list[str]] = []
        added: list[str] = []
        for s in self.steps:
            key, r, a = s.apply(key)
            removed.append(r)
            added += a
        return key, removed, added


def build_plan(
    *,
    strip_prefixes: str | Iterable[str] = (),
    strip_dataparallel: bool = False,
    unwrap: bool = False,
    add_prefix: str | None = None,
    allow_nested: bool = False,
) -> RenamePlan:
    """Combine renaming operations into one :class:`RenamePlan`, applied in this order: ``strip_prefixes`` (each
    at most once, in the order given), the ``module.`` of ``strip_dataparallel``, ``unwrap``, then ``add_prefix``
    (``allow_nested``: even in front of keys that already carry it).

    Raises:
        UsageError: no operation given, or an invalid prefix (empty, ``a..b``, leading dot).
    """
    if isinstance(strip_prefixes, str):
        strip_prefixes = [strip_prefixes]
    steps: list[Step] = []
    plist = tuple(normalize_prefix(p) for p in strip_prefixes)
    if plist:
        steps.append(Step("strip", plist))
    if strip_dataparallel:
        steps.append(Step("strip", ("module.",)))
    if unwrap:
        steps.append(Step("unwrap"))
    if add_prefix is not None:
        steps.append(Step("add", (normalize_prefix(add_prefix),)))
    if not steps:
        raise UsageError("nothing to rename: give a prefix to strip or add, or ask for unwrap")
    return RenamePlan(tuple(steps), allow_nested)


# ------------------------------------------------------------------------------------------------ results
@dataclass
class StateDictChange:
    """What happened to one selected state_dict: dotted ``path`` (``""`` = top level), number of ``keys``,
    ``renamed`` (keys whose name changed), ``removed`` / ``added`` ``{prefix or component: number of keys}``,
    ``is_module`` (a pickled ``nn.Module``) and ``wrappers_removed`` (classes of the wrapper objects dropped from
    a full-model pickle, ``torch.nn.parallel.data_parallel.DataParallel``)."""

    path: str
    keys: int
    renamed: int = 0
    removed: dict[str, int] = field(default_factory=dict)
    added: dict[str, int] = field(default_factory=dict)
    is_module: bool = False
    wrappers_removed: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return label(self.path)


@dataclass(kw_only=True)
class RenameSummary:
    """The renaming of a whole checkpoint: one :class:`StateDictChange` per selected state_dict (in ``changes``)
    and the totals: ``state_dicts`` (paths that changed), ``unchanged`` (selected but no key renamed),
    ``renamed`` (keys), ``removed`` / ``added`` ``{prefix or component: keys}``."""

    changes: list[StateDictChange] = field(default_factory=list)
    state_dicts: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    renamed: int = 0
    removed: dict[str, int] = field(default_factory=dict)
    added: dict[str, int] = field(default_factory=dict)
    wrappers_removed: list[str] = field(default_factory=list)


def label(path: str) -> str:
    """A state_dict path for messages: quoted, or ``(top level)``."""
    return repr(path) if path else "(top level)"


def plan_keys(
    targets: list[PlanTarget], plan: RenamePlan, *, allow_missing: bool, where: str,
) -> tuple[list[dict[str, str]], RenameSummary]:
    """Check and plan the renaming of every target ``(path, str keys, is_module)``.

    Returns ``({old: new} per target, summary)``. Nothing is changed. Each target is renamed by the plan bound to
    its keys (:meth:`RenamePlan.bind`).

    Raises:
        UnsupportedError: a target holds FSDP flat parameters.
        CorruptCheckpointError: a key longer than :data:`~ckptool.model.keys.MAX_KEY_LENGTH`.
        KeyCollisionError: two keys of one target would get one name.
        PrefixNotFoundError: a prefix to strip (or, for unwrap, every wrapper component) is carried by no key of
            any target, unless ``allow_missing``.
        NestedPrefixError: a prefix to add is already carried by keys (``module.module.`` would result), unless
            the plan's ``allow_nested``.
    """
    summary = RenameSummary()
    mappings: list[dict[str, str]] = []
    step_hits: list[dict[str, int]] = [{} for _ in plan.steps]
    for path, keys, is_mod in targets:
        check_key_lengths(keys, where)
        flat = [k for k in keys if is_flat_param_key(k)]
        if flat:
            raise UnsupportedError(
                f"{where}: state_dict {label(path)} holds FSDP flat parameters ({flat[0]!r}): each packs many "
                "parameters into one tensor, so no renaming can make it load into the model. Consolidate it first: "
                "save a full state_dict from the FSDP model (StateDictType.FULL_STATE_DICT, or "
                "torch.distributed.checkpoint.state_dict.get_model_state_dict), convert a DCP folder with "
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save, or run Lightning's "
                "`python -m lightning.pytorch.utilities.consolidate_checkpoint`"
            )
        mapping: dict[str, str] = {}
        change = StateDictChange(path, len(keys), is_module=is_mod)
        bound = plan.bind(keys)
        for k in keys:
            new, removed, added = bound.trace(k)
            mapping[k] = new
            if new != k:
                change.renamed += 1
            for i, comps in enumerate(removed):
                for c in dict.fromkeys(comps):
                    change.removed[c] = change.removed.get(c, 0) + 1
                    step_hits[i][c] = step_hits[i].get(c, 0) + 1
            for c in added:
                change.added[c] = change.added.get(c, 0) + 1
        raise_on_collisions(mapping, where=f"{where}, state_dict {label(path)}")
        if not plan.allow_nested:
            _check_not_nested(path, mapping, plan, where)
        mappings.append(mapping)
        summary.changes.append(change)
    if not allow_missing:
        _check_found(targets, plan, step_hits, where)
    for ch in summary.changes:
        (summary.state_dicts if ch.renamed else summary.unchanged).append(ch.path)
        summary.renamed += ch.renamed
        for c, n in ch.removed.items():
            summary.removed[c] = summary.removed.get(c, 0) + n
        for c, n in ch.added.items():
            summary.added[c] = summary.added.get(c, 0) + n
    return mappings, summary


def _check_not_nested(path: str, mapping: dict[str, str], plan: RenamePlan, where: str) -> None:
    """Raise :class:`NestedPrefixError` when an added prefix lands in front of itself (``module.module.fc.w``)."""
    for step in plan.steps:
        if step.kind != "add":
            continue
        doubled = step.prefixes[0] * 2
        nested = [old for old, new in mapping.items() if new.startswith(doubled)]
        if nested:
            raise NestedPrefixError(
                f"{where}: {len(nested)} of {len(mapping)} keys of state_dict {label(path)} already start with "
                f"{step.prefixes[0]!r} (e.g. {nested[0]!r}), so adding it would give {doubled!r}; nothing was "
                "written. Load it as it is, or pass --allow-nested (allow_nested=True) to add the prefix anyway"
            )


def _check_found(targets: list[PlanTarget], plan: RenamePlan, step_hits: list[dict[str, int]],
                 where: str) -> None:
    examples = [k for _p, keys, _m in targets for k in keys[:3]][:3]
    seen = ", ".join(repr(k) for k in examples) or "no keys"
    if len(targets) == 1:
        path = targets[0][0]
        paths = f"the state_dict {path!r}" if path else "the top-level state_dict"
    else:
        paths = "the state_dicts " + ", ".join(label(p) for p, _k, _m in targets)
    for step, hits in zip(plan.steps, step_hits):
        if step.kind == "strip":
            missing = [p for p in step.prefixes if p not in hits]
            if missing:
                what = " or ".join(repr(p) for p in missing)
                raise PrefixNotFoundError(
                    f"{where}: no key of {paths} starts with {what} (keys look like {seen}); "
                    "nothing was written. Check the prefix with `ckptool inspect`, or pass --allow-missing "
                    "(allow_missing=True) to write the file anyway"
                )
        elif step.kind == "unwrap" and not hits:
            comps = ", ".join(c + "." for c in WRAPPER_COMPONENTS)
            raise PrefixNotFoundError(
                f"{where}: no key of {paths} carries a wrapper component ({comps}; keys look "
                f"like {seen}); nothing was written. For another prefix such as 'model.' use strip-prefix, or pass "
                "--allow-missing (allow_missing=True) to write the file anyway"
            )
