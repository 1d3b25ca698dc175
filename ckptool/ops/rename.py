"""``ckptool.prefixes``: remove or add wrapper prefixes in state_dict keys, in files and in memory.

Wrappers put components in front of every fully qualified name (FQN) of the model they hold:
``nn.DataParallel`` and ``DistributedDataParallel`` add ``module.``, ``torch.compile``'s ``OptimizedModule``
``_orig_mod.``, FSDP1 ``_fsdp_wrapped_module.``, activation checkpointing ``_checkpoint_wrapped_module.``, a
LightningModule the name of its attribute (``model.``). ``load_state_dict(strict=True)`` into the bare model then
fails with "Missing key(s) ... Unexpected key(s): module.conv1.weight". The functions here rename whole dotted
components only (:mod:`ckptool.keys`, the rule of torch's ``consume_prefix_in_state_dict_if_present``), so
``mlp_module.fc.weight`` never loses ``module``.

On a file (a ``str`` or ``os.PathLike``) each function reads the pickle as a node graph
(:func:`ckptool.checkpoint.read_checkpoint`, nothing imported or run), renames the keys of the selected
state_dict(s) in the graph, and streams a new file with :func:`ckptool.rewrite.rewrite_file`: tensor records are
copied byte for byte, never decoded, so the cost is the cost of copying the file and torch is not imported.
safetensors files get a new JSON header and their data block copied unchanged. The output is written
atomically (temporary file, fsync, rename); nothing is written when an error is raised.

On an in-memory mapping (a state_dict, possibly an ``OrderedDict`` with ``_metadata``, or a training checkpoint
dict holding one) each function returns a NEW mapping of the same type; the input is not mutated and the values
are the same tensor objects.

Only the selected state_dicts change: optimizer state (keyed by parameter index), hyper-parameters and every other
entry stay as they are. The state_dict's ``_metadata`` (per-module versions that ``load_state_dict`` passes to
``_load_from_state_dict``) is renamed consistently with the keys.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptool.formats import detect as formats
from ckptool.formats.torchfile import read_checkpoint
from ckptool.errors import PrefixNotFoundError, UnsupportedError, UsageError
from ckptool.model.graph import (
    compiled_inner,
    iter_state_dict_of_module,
    get_path,
    is_module,
    is_optimizer_state,
    is_state_dict,
    join,
    looks_like_state_dict,
    mapping_items,
    module_entries,
    module_state,
    set_mapping_items,
)
from ckptool.model.keys import (
    WRAPPER_COMPONENTS,
    WRAPPER_ONLY_COMPONENTS,
    is_flat_param_key,
    metadata_key_mapping,
    normalize_prefix,
    raise_on_collisions,
    unwrap_key,
)
from ckptool.ops.rewrite import WriteResult, output_path, rewrite_file
from ckptool.formats.unpickler import ObjectNode, PickledObject, ReduceNode

__all__ = [
    "RenamePlan",
    "RenameResult",
    "RenameSummary",
    "StateDictChange",
    "Step",
    "add_prefix",
    "build_plan",
    "rename_graph",
    "rename_state_dict",
    "strip_dataparallel",
    "strip_prefix",
    "unwrap",
]



# ------------------------------------------------------------------------------------------------ the renaming
@dataclass(frozen=True)
class Step:
    """One renaming step on a key.

    ``kind`` is ``"strip"`` (remove each of ``prefixes`` from the front, in order, at most once each, only while
    a component stays after it), ``"add"`` (put ``prefixes[0]`` in front) or ``"unwrap"``
    (:func:`ckptool.keys.unwrap_key`). Prefixes are normalised whole components ending in ``.``.
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
        new, comps = unwrap_key(key)
        return new, [c + "." for c in comps], []

    def apply_path(self, path: str) -> str:
        """The new name of a module path of ``_metadata`` (``""`` is the root module).

        A path is renamed as a key directly inside that module would be; in addition, a wrapper level that a
        multi-component prefix passes through (``"_orig_mod"`` under ``"_orig_mod.module."``) becomes the root,
        as the wrapper it names is gone (the inner module's entry, later in ``_metadata``, then wins).
        """
        if self.kind == "strip":
            for p in self.prefixes:
                if (path + ".").startswith(p):
                    path = path[len(p):]
                elif path and p.startswith(path + "."):
                    path = ""
            return path
        if self.kind == "add":
            return self.prefixes[0] + path if path else self.prefixes[0][:-1]
        return metadata_key_mapping([path], lambda k: unwrap_key(k)[0])[path]


@dataclass(frozen=True)
class RenamePlan:
    """The steps applied to every key of a selected state_dict, in order (see :func:`build_plan`)."""

    steps: tuple[Step, ...]

    def rename(self, key: str) -> str:
        """The new name of ``key``."""
        for s in self.steps:
            key = s.apply(key)[0]
        return key

    def rename_path(self, path: str) -> str:
        """The new name of a ``_metadata`` module path (see :meth:`Step.apply_path`)."""
        for s in self.steps:
            path = s.apply_path(path)
        return path

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
) -> RenamePlan:
    """Combine renaming operations into one :class:`RenamePlan`, applied in this order: ``strip_prefixes`` (each
    at most once, in the order given), the ``module.`` of ``strip_dataparallel``, ``unwrap``, then ``add_prefix``.

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
    return RenamePlan(tuple(steps))


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
        return repr(self.path) if self.path else "(top level)"


@dataclass
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


@dataclass
class RenameResult(WriteResult):
    """What a prefix command wrote: the :class:`~ckptool.rewrite.WriteResult` fields (``src``, ``dst``,
    ``format_in``, ``storages``, ``bytes_written`` in bytes, ``retagged``) plus ``operation`` and the
    :class:`RenameSummary` fields (``state_dicts`` changed, ``unchanged``, ``renamed`` key count, ``removed`` /
    ``added`` ``{prefix: keys}``, ``wrappers_removed``, per-state_dict ``changes``)."""

    operation: str = ""
    changes: list[StateDictChange] = field(default_factory=list)
    state_dicts: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    renamed: int = 0
    removed: dict[str, int] = field(default_factory=dict)
    added: dict[str, int] = field(default_factory=dict)
    wrappers_removed: list[str] = field(default_factory=list)

    @classmethod
    def combine(cls, write: WriteResult, summary: RenameSummary, operation: str) -> RenameResult:
        return cls(**vars(write), operation=operation, **vars(summary))


# ------------------------------------------------------------------------------------------------ shared checks
def _label(path: str) -> str:
    return repr(path) if path else "(top level)"


def _plan_keys(
    targets: list[tuple[str, list[str], bool]], plan: RenamePlan, *, allow_missing: bool, where: str,
) -> tuple[list[dict[str, str]], RenameSummary]:
    """Check and plan the renaming of every target ``(path, str keys, is_module)``.

    Returns ``({old: new} per target, summary)``. Nothing is changed.

    Raises:
        UnsupportedError: a target holds FSDP flat parameters.
        KeyCollisionError: two keys of one target would get one name.
        PrefixNotFoundError: a prefix to strip (or, for unwrap, every wrapper component) is carried by no key of
            any target, unless ``allow_missing``.
    """
    summary = RenameSummary()
    mappings: list[dict[str, str]] = []
    step_hits: list[dict[str, int]] = [{} for _ in plan.steps]
    for path, keys, is_mod in targets:
        flat = [k for k in keys if is_flat_param_key(k)]
        if flat:
            raise UnsupportedError(
                f"{where}: state_dict {_label(path)} holds FSDP flat parameters ({flat[0]!r}): each packs many "
                "parameters into one tensor, so no renaming can make it load into the model. Consolidate it first: "
                "save a full state_dict from the FSDP model (StateDictType.FULL_STATE_DICT, or "
                "torch.distributed.checkpoint.state_dict.get_model_state_dict), convert a DCP folder with "
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save, or run Lightning's "
                "`python -m lightning.pytorch.utilities.consolidate_checkpoint`"
            )
        mapping: dict[str, str] = {}
        change = StateDictChange(path, len(keys), is_module=is_mod)
        for k in keys:
            new, removed, added = plan.trace(k)
            mapping[k] = new
            if new != k:
                change.renamed += 1
            for i, comps in enumerate(removed):
                for c in dict.fromkeys(comps):
                    change.removed[c] = change.removed.get(c, 0) + 1
                    step_hits[i][c] = step_hits[i].get(c, 0) + 1
            for c in added:
                change.added[c] = change.added.get(c, 0) + 1
        raise_on_collisions(mapping, where=f"{where}, state_dict {_label(path)}")
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


def _check_found(targets: list[tuple[str, list[str], bool]], plan: RenamePlan, step_hits: list[dict[str, int]],
                 where: str) -> None:
    examples = [k for _p, keys, _m in targets for k in keys[:3]][:3]
    seen = ", ".join(repr(k) for k in examples) or "no keys"
    if len(targets) == 1:
        path = targets[0][0]
        paths = f"the state_dict {path!r}" if path else "the top-level state_dict"
    else:
        paths = "the state_dicts " + ", ".join(_label(p) for p, _k, _m in targets)
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


# ------------------------------------------------------------------------------------------------ node graph
@dataclass
class _Target:
    path: str
    obj: Any
    is_module: bool
    setter: Callable[[Any], None] | None  # replaces obj in its parent (None: obj is the root)


def _is_optimized_module(obj: Any) -> bool:
    """A compiled model pickled by ``OptimizedModule.__reduce__``: ``OptimizedModule(orig_mod, dynamo_ctx)``."""
    return compiled_inner(obj) is not None


def _is_module_node(obj: Any) -> bool:
    return is_module(obj) or _is_optimized_module(obj)


def _class_name(obj: Any) -> str:
    if isinstance(obj, ObjectNode):
        return obj.global_name
    if isinstance(obj, ReduceNode) and obj.global_name:
        return obj.global_name
    return type(obj).__name__


def _mapping_setter(obj: Any, index: int) -> Callable[[Any], None]:
    def set_value(new: Any) -> None:
        items = list(mapping_items(obj) or [])  # a copy: mapping_items may return the node's own list
        k, _old = items[index]
        items[index] = (k, new)
        set_mapping_items(obj, items)
    return set_value


def _list_setter(obj: Any, index: int) -> Callable[[Any], None] | None:
    if not isinstance(obj, list):
        return None

    def set_value(new: Any) -> None:
        obj[index] = new
    return set_value


def _find_targets(root: Any) -> list[_Target]:
    """The state_dicts to rename when no key path is given, outermost first: what
    :func:`ckptool.graph.find_state_dicts` finds (the compiled-model pickle of ``torch.compile`` included), less
    anything inside an optimizer state_dict."""
    out: list[_Target] = []
    seen: set[int] = set()
    queue: list[tuple[str, Any, Callable[[Any], None] | None]] = [("", root, None)]
    while queue:
        path, obj, setter = queue.pop(0)
        if obj is None or isinstance(obj, (str, int, float, bytes, bool)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if is_state_dict(obj):
            out.append(_Target(path, obj, False, setter))
            continue
        if _is_module_node(obj):
            out.append(_Target(path, obj, True, setter))
            continue
        items = mapping_items(obj)
        if items is not None:
            if is_optimizer_state(items):
                continue
            queue.extend((join(path, k), v, _mapping_setter(obj, i))
                         for i, (k, v) in enumerate(items) if isinstance(k, (str, int)))
        elif isinstance(obj, (list, tuple)):
            queue.extend((join(path, i), v, _list_setter(obj, i)) for i, v in enumerate(obj))
    return out


def _target_at(root: Any, key: str, where: str) -> _Target:
    try:
        obj = get_path(root, key)
    except KeyError:
        found = ", ".join(_label(t.path) for t in _find_targets(root)) or "none"
        raise UsageError(f"{where}: no entry {key!r} (--key); state_dicts found: {found}") from None
    setter = None
    if key:
        parent_path, _dot, last = key.rpartition(".")
        parent = get_path(root, parent_path)
        items = mapping_items(parent)
        if items is not None:
            for i, (k, _v) in enumerate(items):
                if str(k) == last:
                    setter = _mapping_setter(parent, i)
                    break
        elif isinstance(parent, list) and last.isdigit():
            setter = _list_setter(parent, int(last))
    if _is_module_node(obj):
        return _Target(key, obj, True, setter)
    if mapping_items(obj) is None:
        found = ", ".join(_label(t.path) for t in _find_targets(root)) or "none"
        raise UsageError(f"{where}: --key {key!r} selects a {_class_name(obj)}, not a state_dict; "
                         f"state_dicts found: {found}")
    return _Target(key, obj, False, setter)


def _module_keys(node: Any, prefix: str = "") -> Iterator[str]:
    """State_dict keys of a pickled module in ``module.state_dict()`` order (compiled submodules seen through)."""
    return (key for key, _t, _is_param in iter_state_dict_of_module(node, prefix))


def _target_keys(t: _Target) -> list[str]:
    if t.is_module:
        return list(_module_keys(t.obj))
    return [k for k, _v in mapping_items(t.obj) or [] if isinstance(k, str)]


def _child(node: Any, name: str) -> Any:
    """The submodule ``name`` of a module node (``_orig_mod`` of a compiled model), else None."""
    if _is_optimized_module(node):
        return node.args[0] if name == "_orig_mod" else None
    st = module_state(node)
    if st is None:
        return None
    for n, v in mapping_items(st.get("_modules")) or []:
        if n == name:
            return v
    return None


def _wrapped_inner(node: Any, names: Sequence[str]) -> Any:
    """The inner module when ``node`` is a wrapper: exactly one submodule, named in ``names``, and no parameters
    or buffers of its own. Else None."""
    if _is_optimized_module(node):
        return node.args[0] if "_orig_mod" in names and _is_module_node(node.args[0]) else None
    st = module_state(node)
    if st is None:
        return None
    entries = list(module_entries(st))
    if len(entries) != 1 or entries[0][2] != "module" or entries[0][0] not in names:
        return None
    inner = entries[0][1]
    return inner if _is_module_node(inner) else None


def _unwrap_children(node: Any, wrappers: list[str], seen: set[int]) -> None:
    st = module_state(node)
    if st is None or id(node) in seen:
        return
    seen.add(id(node))
    mods = st.get("_modules")
    items = mapping_items(mods)
    if not items:
        return
    new_items = []
    changed = False
    for name, child in items:
        new = child
        while (inner := _wrapped_inner(new, WRAPPER_ONLY_COMPONENTS)) is not None:
            wrappers.append(_class_name(new))
            new = inner
        changed |= new is not child
        new_items.append((name, new))
        _unwrap_children(new, wrappers, seen)
    if changed:
        set_mapping_items(mods, new_items)


def _rename_module(t: _Target, plan: RenamePlan, mapping: dict[str, str], where: str) -> tuple[Any, list[str]]:
    """Apply ``plan`` to a pickled module by replacing wrapper objects with the module they hold.

    Returns ``(new module node, classes of the wrappers removed)``.

    Raises:
        UnsupportedError: the plan adds a prefix, or the structure cannot give the renamed keys (a strip that would
            drop tensors, a ``module`` attribute that is not a wrapper).
    """
    node = t.obj
    old_keys = list(mapping)
    wrappers: list[str] = []
    label = _label(t.path)
    for step in plan.steps:
        if step.kind == "add":
            raise UnsupportedError(
                f"{where}: {label} is a pickled nn.Module ({_class_name(node)}), not a state_dict: a wrapper "
                "cannot be added to it without importing the wrapper's class. Wrap the model in Python "
                "(nn.DataParallel(model)) or add the prefix to a state_dict"
            )
        if step.kind == "strip":
            for p in step.prefixes:
                keys = list(_module_keys(node))
                carried = [k.startswith(p) and len(k) > len(p) for k in keys]
                if not any(carried):
                    continue
                if not all(carried):
                    lost = [k for k, c in zip(keys, carried) if not c]
                    raise UnsupportedError(
                        f"{where}: {label} is a pickled nn.Module; removing {p!r} means keeping only its submodule "
                        f"{p[:-1]!r}, which would drop {len(lost)} tensor(s) such as {lost[0]!r}. Load it (trusted) "
                        f"and save the submodule's state_dict instead"
                    )
                for comp in p[:-1].split("."):
                    wrappers.append(_class_name(node))
                    node = _child(node, comp)
        else:
            while (inner := _wrapped_inner(node, WRAPPER_COMPONENTS)) is not None:
                wrappers.append(_class_name(node))
                node = inner
            _unwrap_children(node, wrappers, set())
    new_keys = list(_module_keys(node))
    if new_keys != [mapping[k] for k in old_keys]:
        raise UnsupportedError(
            f"{where}: {label} is a pickled nn.Module whose keys cannot be renamed by removing wrapper objects "
            "(a submodule named like a wrapper holds other modules beside it); load it (trusted) and rename its "
            "state_dict() with ckptool's in-memory API"
        )
    return node, wrappers


def _renamed_metadata(items: Iterable[tuple[Any, Any]], path_fn: Callable[[str], str]) -> list[tuple[Any, Any]]:
    """``_metadata`` pairs with each module path renamed by ``path_fn``; when two paths end on one name the later
    entry (the inner module's, after its wrapper's) wins, in the place of the first."""
    renamed: dict[Any, Any] = {}
    for m, v in items:
        renamed[path_fn(m) if isinstance(m, str) else m] = v
    return list(renamed.items())


def _rename_mapping_node(obj: Any, mapping: dict[str, str], path_fn: Callable[[str], str]) -> None:
    """Rename the keys of a dict / OrderedDict node in place, and the module paths of its ``_metadata``."""
    items = mapping_items(obj) or []
    set_mapping_items(obj, [(mapping.get(k, k) if isinstance(k, str) else k, v) for k, v in items])
    state = obj.state if isinstance(obj, PickledObject) else None
    if type(state) is dict and "_metadata" in state:
        meta = state["_metadata"]
        meta_items = mapping_items(meta)
        if meta_items:
            set_mapping_items(meta, _renamed_metadata(meta_items, path_fn))


def rename_graph(
    root: Any, plan: RenamePlan, *, key: str | None = None, allow_missing: bool = False, where: str = "checkpoint",
) -> tuple[Any, RenameSummary]:
    """Apply ``plan`` to the state_dict(s) of a checkpoint's node graph (:mod:`ckptool.unpickler`), in place.

    ``key`` (a dotted path, :func:`ckptool.graph.get_path`) selects one state_dict; without it every state_dict
    that :func:`ckptool.graph.find_state_dicts` finds (compiled-model pickles included, optimizer state never) is
    renamed where its keys carry the prefix. Dict and OrderedDict nodes get their keys (and ``_metadata``) renamed; pickled modules (full-model pickles) get their wrapper objects
    (``DataParallel``, ``OptimizedModule``, ...) replaced by the module they hold, no class imported. ``where``
    names the checkpoint in messages.

    Returns ``(new root, summary)``; the root changes only when the root itself was a wrapper module.

    Raises:
        UsageError: ``key`` names no entry, or an entry that is not a mapping or module.
        UnsupportedError: no state_dict found, FSDP flat parameters, a full model that cannot be renamed.
        KeyCollisionError: two keys would get one name (the graph is left unchanged).
        PrefixNotFoundError: nothing to strip, unless ``allow_missing``.
    """
    if key is not None:
        targets = [_target_at(root, key, where)]
    else:
        targets = _find_targets(root)
        if not targets:
            raise UnsupportedError(
                f"{where}: no state_dict found (a mapping of parameter names to tensors, or a pickled nn.Module); "
                "pass --key PATH (key=...) to select the mapping to rename"
            )
    keyed = [(t.path, _target_keys(t), t.is_module) for t in targets]
    mappings, summary = _plan_keys(keyed, plan, allow_missing=allow_missing, where=where)
    for t, mapping, change in zip(targets, mappings, summary.changes):
        if not change.renamed:
            continue
        if not t.is_module:
            _rename_mapping_node(t.obj, mapping, plan.rename_path)
            continue
        new, wrappers = _rename_module(t, plan, mapping, where)
        change.wrappers_removed = wrappers
        summary.wrappers_removed += wrappers
        if new is not t.obj:
            if t.setter is None and t.path == "":
                root = new
            elif t.setter is None:
                raise UnsupportedError(f"{where}: the module at {_label(t.path)} sits in a tuple and cannot be "
                                       "replaced; select it with --key from a mapping or list")
            else:
                t.setter(new)
    return root, summary


# ------------------------------------------------------------------------------------------------ safetensors
def _copy_range(fsrc: Any, fdst: Any, offset: int, size: int) -> None:
    """Copy ``size`` bytes at ``offset`` of ``fsrc`` to the current end of ``fdst`` (kernel copy when offered)."""
    done = 0
    cfr = getattr(os, "copy_file_range", None)
    fdst.flush()
    if cfr is not None:
        out_pos = fdst.tell()
        try:
            while done < size:
                n = cfr(fsrc.fileno(), fdst.fileno(), min(size - done, 1 << 30), offset + done, out_pos + done)
                if n == 0:
                    break
                done += n
        except OSError:
            pass
        fdst.seek(out_pos + done)
    fsrc.seek(offset + done)
    left = size - done
    while left:
        chunk = fsrc.read(min(left, 8 << 20))
        if not chunk:
            raise UnsupportedError("the safetensors data block ended early: the file is truncated; re-download it")
        fdst.write(chunk)
        left -= len(chunk)


def _rewrite_safetensors(src: str, out: str, plan: RenamePlan, *, key: str | None, allow_missing: bool,
                         operation: str) -> RenameResult:
    from ckptool.ops.inspect import read_safetensors_header
    from ckptool._fileio import atomic_output, file_mode

    if key:
        raise UsageError(f"{src} is safetensors: it holds one flat mapping of tensors, so --key does not apply")
    header = read_safetensors_header(src)
    meta = header.pop("__metadata__", None)
    keys = list(header)
    mappings, summary = _plan_keys([("", keys, False)], plan, allow_missing=allow_missing, where=src)
    new_header: dict[str, Any] = {}
    if meta is not None:
        new_header["__metadata__"] = meta
    for k in keys:
        new_header[mappings[0][k]] = header[k]
    raw = json.dumps(new_header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the safetensors writer pads the header to 8 bytes with spaces
    size = os.path.getsize(src)
    with open(src, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        data_start = 8 + n
        mode = file_mode(src) if os.path.abspath(out) == os.path.abspath(src) else None
        with atomic_output(out, mode=mode) as o:
            o.write(struct.pack("<Q", len(raw)))
            o.write(raw)
            _copy_range(f, o, data_start, size - data_start)
            written = o.tell()
    res = WriteResult(src, out, formats.SAFETENSORS, storages=len(keys), bytes_written=written)
    return RenameResult.combine(res, summary, operation)


# ------------------------------------------------------------------------------------------------ in memory
def _is_tensor_value(v: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.Tensor)


def _looks_like_state_dict(m: Any) -> bool:
    return isinstance(m, Mapping) and looks_like_state_dict(m.items(), _is_tensor_value)


def _new_like(m: Mapping[Any, Any], items: Iterable[tuple[Any, Any]]) -> Any:
    """A new mapping of ``type(m)`` holding ``items`` (a plain dict when that type cannot be built empty)."""
    items = list(items)
    try:
        out = type(m)()
    except TypeError:
        out = {}
    try:
        for k, v in items:
            out[k] = v
    except TypeError:  # read-only mapping types
        out = dict(items)
    return out


def _mem_targets(obj: Any) -> list[tuple[list[Any], str, Mapping[str, Any]]]:
    """``(path components, dotted path, state_dict)`` of every in-memory state_dict, outermost first."""
    out = []
    seen: set[int] = set()
    queue: list[tuple[list[Any], Any]] = [([], obj)]
    while queue:
        comps, o = queue.pop(0)
        if id(o) in seen:
            continue
        seen.add(id(o))
        if _looks_like_state_dict(o):
            out.append((comps, ".".join(map(str, comps)), o))
        elif isinstance(o, Mapping):
            if {"state", "param_groups"} <= {k for k in o if isinstance(k, str)}:
                continue
            queue.extend((comps + [k], v) for k, v in o.items() if isinstance(k, (str, int)))
        elif isinstance(o, (list, tuple)):
            queue.extend((comps + [i], v) for i, v in enumerate(o))
    return out


def _mem_get(obj: Any, key: str) -> tuple[list[Any], Any]:
    if key == "":
        return [], obj
    comps: list[Any] = []
    for c in key.split("."):
        if isinstance(obj, Mapping):
            for k in obj:
                if str(k) == c:
                    comps.append(k)
                    obj = obj[k]
                    break
            else:
                raise UsageError(f"no entry {key!r} (key=) in the given mapping")
        elif isinstance(obj, (list, tuple)) and c.isdigit() and int(c) < len(obj):
            comps.append(int(c))
            obj = obj[int(c)]
        else:
            raise UsageError(f"no entry {key!r} (key=) in the given mapping")
    if not isinstance(obj, Mapping):
        raise UsageError(f"key={key!r} selects a {type(obj).__name__}, not a state_dict")
    return comps, obj


def _copy_meta(src: Any, dst: Any) -> Any:
    meta = getattr(src, "_metadata", None)
    if meta is not None:
        try:
            dst._metadata = meta
        except AttributeError:
            pass
    return dst


def _mem_replace(obj: Any, comps: list[Any], new: Any) -> Any:
    """``obj`` with the value at ``comps`` replaced by ``new``; containers along the path are shallow copies."""
    if not comps:
        return new
    head, rest = comps[0], comps[1:]
    if isinstance(obj, Mapping):
        child = _mem_replace(obj[head], rest, new)
        return _copy_meta(obj, _new_like(obj, [(k, child if k == head else v) for k, v in obj.items()]))
    items = list(obj)
    items[head] = _mem_replace(items[head], rest, new)
    return items if isinstance(obj, list) else tuple(items)


def _renamed_mapping(sd: Mapping[Any, Any], mapping: Mapping[str, str], path_fn: Callable[[str], str]) -> Any:
    out = _new_like(sd, [(mapping.get(k, k) if isinstance(k, str) else k, v) for k, v in sd.items()])
    meta = getattr(sd, "_metadata", None)
    if isinstance(meta, Mapping):
        new_meta = OrderedDict(_renamed_metadata(
            ((m, dict(v) if isinstance(v, dict) else v) for m, v in meta.items()), path_fn))
        try:
            out._metadata = new_meta
        except AttributeError:  # a plain dict cannot carry _metadata
            pass
    return out


def _rename_in_memory(obj: Mapping[Any, Any], plan: RenamePlan, *, key: str | None, allow_missing: bool) -> Any:
    if key is not None:
        comps, sd = _mem_get(obj, key)
        targets = [(comps, key, sd)]
    else:
        targets = _mem_targets(obj)
        if not targets:
            raise UnsupportedError(
                "no state_dict found in the given mapping (string keys mapped to tensors); pass key=... to "
                "select the mapping to rename"
            )
    keyed = [(path, [k for k in sd if isinstance(k, str)], False) for _c, path, sd in targets]
    mappings, _summary = _plan_keys(keyed, plan, allow_missing=allow_missing, where="state_dict")
    result = obj
    for (comps, _path, sd), mapping in zip(targets, mappings):
        new = _renamed_mapping(sd, mapping, plan.rename_path)
        result = _mem_replace(result, comps, new)
    if result is obj:  # nothing selected: still return a new mapping, as promised
        result = _copy_meta(obj, _new_like(obj, obj.items()))
    return result


def rename_state_dict(state_dict: Mapping[str, Any], key_fn: Callable[[str], str]) -> Any:
    """Return a new state_dict whose keys are ``key_fn(key)``; ``state_dict`` is not mutated.

    ``state_dict`` is any mapping (usually the ``OrderedDict`` from ``model.state_dict()``); the result has the
    same type, the same values (the same tensor objects, in the same order) and, when the input carries
    ``_metadata`` (the per-module versions ``load_state_dict`` passes on), a renamed copy of it: each module path
    ``p`` becomes what ``key_fn`` makes of a key directly inside ``p`` (:func:`ckptool.keys.metadata_key_mapping`),
    so stripping ``module.`` turns ``"module.fc"`` into ``"fc"`` as torch's
    ``consume_prefix_in_state_dict_if_present`` does. Keys that are not strings are kept.

    Raises:
        KeyCollisionError: two keys would get one name (``.collisions`` maps each new key to the old ones).
    """
    mapping = {k: key_fn(k) for k in state_dict if isinstance(k, str)}
    raise_on_collisions(mapping)
    return _renamed_mapping(state_dict, mapping, lambda m: metadata_key_mapping([m], key_fn)[m])


# ------------------------------------------------------------------------------------------------ public API
def apply_plan(
    src: Any, dst: str | os.PathLike[str] | None, plan: RenamePlan, *, operation: str, tag: str,
    key: str | None = None, in_place: bool = False, allow_missing: bool = False,
) -> Any:
    """Run ``plan`` on a file (returns :class:`RenameResult`) or an in-memory mapping (returns a new mapping).

    ``tag`` names the default output (``<stem>.<tag><ext>`` beside ``src``). See :func:`strip_prefix` for the
    errors raised.
    """
    if isinstance(src, Mapping):
        if dst is not None or in_place:
            raise UsageError("dst and in_place apply to files; for an in-memory state_dict the new mapping is "
                             "returned")
        return _rename_in_memory(src, plan, key=key, allow_missing=allow_missing)
    if not isinstance(src, (str, os.PathLike)):
        hint = " (pass model.state_dict(), or the path of a saved file)" if hasattr(src, "state_dict") else ""
        raise UsageError(f"expected a checkpoint path or a state_dict mapping, got {type(src).__name__}{hint}")
    src = os.fspath(src)
    fmt = formats.detect_format(src)
    if fmt == formats.TORCHSCRIPT:
        raise UnsupportedError(
            f"{src} is a TorchScript archive: its parameter names are fixed by its compiled code and cannot be "
            f"renamed. Load it with torch.jit.load(path, map_location='cpu') and rename model.state_dict() "
            f"with ckptool.{operation.replace('-', '_')}(state_dict)"
        )
    if fmt == formats.PICKLE:
        raise UnsupportedError(f"{src} is a plain pickle without torch storages, not a torch.save checkpoint; "
                               "load it and rename the state_dict in memory")
    out = output_path(src, os.fspath(dst) if dst is not None else None, in_place, tag)
    if fmt == formats.SAFETENSORS:
        return _rewrite_safetensors(src, out, plan, key=key, allow_missing=allow_missing, operation=operation)
    ck = read_checkpoint(src, fmt)
    root, summary = rename_graph(ck.root, plan, key=key, allow_missing=allow_missing, where=src)
    res = rewrite_file(ck, out, root)
    return RenameResult.combine(res, summary, operation)

def strip_prefix(
    src: Any, prefixes: str | Sequence[str], dst: str | os.PathLike[str] | None = None, *,
    key: str | None = None, in_place: bool = False, allow_missing: bool = False,
) -> Any:
    """Remove ``prefixes`` (whole dotted components: ``"model."`` or ``"model"``) from the front of state_dict keys.

    Several prefixes are removed in the order given, each at most once per key (``["model.", "module."]`` turns
    ``model.module.fc.weight`` into ``fc.weight`` and ``module.fc.weight`` into ``fc.weight``). Keys that do not
    carry a prefix are kept, and ``mlp_module.fc.weight`` never matches ``module.``. A key is never reduced to
    nothing.

    ``src`` is a checkpoint path (torch zip, legacy or safetensors) or an in-memory mapping. For a path, the
    output goes to ``dst``, by default ``<stem>.stripped<ext>`` beside ``src`` (``in_place=True`` replaces
    ``src``, atomically); it is torch's zip format (or safetensors for a safetensors input) and loads with
    ``torch.load(dst, weights_only=True)``. Returns a :class:`RenameResult` for a path, a new mapping of the same
    type for a mapping.

    ``key`` selects one state_dict by dotted path (``"state_dict"``, ``"model_state_dict"``, ``"ema.model"``);
    without it every state_dict found is renamed where its keys carry the prefix, never an optimizer's state.
    For a full-model pickle the wrapper objects along the prefix are replaced by the submodule they hold.

    Raises:
        UsageError: bad prefix, ``key`` that names no mapping, ``dst`` equal to ``src`` without ``in_place``,
            missing output folder, ``dst`` / ``in_place`` given with an in-memory mapping.
        PrefixNotFoundError: no key carries the prefix (unless ``allow_missing``); nothing written.
        KeyCollisionError: two keys would get one name; the colliding keys are listed, nothing written.
        UnsupportedError: FSDP flat parameters (consolidate first), TorchScript or plain-pickle files, no
            state_dict found, a full-model pickle whose keys cannot be renamed by removing wrapper objects.
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    if isinstance(prefixes, str):
        prefixes = [prefixes]
    plan = build_plan(strip_prefixes=list(prefixes))
    return apply_plan(src, dst, plan, operation="strip-prefix", tag="stripped", key=key, in_place=in_place,
                      allow_missing=allow_missing)


def strip_dataparallel(
    src: Any, dst: str | os.PathLike[str] | None = None, *, key: str | None = None, in_place: bool = False,
    allow_missing: bool = False,
) -> Any:
    """Remove the leading ``module.`` that ``nn.DataParallel`` and ``DistributedDataParallel`` add to every key.

    The same as ``strip_prefix(src, "module.", ...)`` (default output ``<stem>.stripped<ext>``), and on a
    full-model pickle (``torch.save(nn.DataParallel(model))``) the file then holds the inner module object,
    written without importing its class. Returns a :class:`RenameResult` for a path, a new mapping for a mapping.

    Raises:
        UsageError: ``key`` that names no mapping, ``dst`` equal to ``src`` without ``in_place``,
            missing output folder, ``dst`` / ``in_place`` given with an in-memory mapping.
        PrefixNotFoundError: no key starts with ``module.`` (unless ``allow_missing``); nothing written.
        KeyCollisionError: two keys would get one name; the colliding keys are listed, nothing written.
        UnsupportedError: FSDP flat parameters (consolidate first), TorchScript or plain-pickle files, no
            state_dict found, a full-model pickle whose keys cannot be renamed by removing wrapper objects.
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    plan = build_plan(strip_dataparallel=True)
    return apply_plan(src, dst, plan, operation="strip-dataparallel", tag="stripped", key=key, in_place=in_place,
                      allow_missing=allow_missing)


def add_prefix(
    src: Any, prefix: str, dst: str | os.PathLike[str] | None = None, *, key: str | None = None,
    in_place: bool = False,
) -> Any:
    """Put ``prefix`` (whole components, ``"module."``) in front of every key, e.g. to load a bare state_dict into
    ``nn.DataParallel(model)`` or a compiled model (``"_orig_mod."``) with ``strict=True``.

    ``_metadata`` paths get the prefix too (``"fc"`` -> ``"module.fc"``). Default output
    ``<stem>.prefixed<ext>``. Without ``key``, every state_dict found gets the prefix (optimizer state never).
    Full-model pickles are refused (a wrapper object cannot be made without its class). Returns a
    :class:`RenameResult` for a path, a new mapping for a mapping.

    Raises:
        UsageError: bad prefix, ``key`` that names no mapping, ``dst`` equal to ``src`` without ``in_place``,
            missing output folder, ``dst`` / ``in_place`` given with an in-memory mapping.
        KeyCollisionError: two keys would get one name; the colliding keys are listed, nothing written.
        UnsupportedError: FSDP flat parameters (consolidate first), TorchScript or plain-pickle files, no
            state_dict found, a full-model pickle (a wrapper cannot be added to it).
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    plan = build_plan(add_prefix=prefix)
    return apply_plan(src, dst, plan, operation="add-prefix", tag="prefixed", key=key, in_place=in_place)


def unwrap(
    src: Any, dst: str | os.PathLike[str] | None = None, *, key: str | None = None, in_place: bool = False,
    allow_missing: bool = False,
) -> Any:
    """Remove every wrapper component: ``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.`` and
    ``_checkpoint_wrapped_module.`` from the front of keys in any stacking order (DDP of a compiled model gives
    ``module._orig_mod.``, a compiled DDP ``_orig_mod.module.``), and the wrapper-only names (``_orig_mod``,
    ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``) also in the middle of keys
    (:func:`ckptool.keys.unwrap_key`).

    Default output ``<stem>.unwrapped<ext>``. On a full-model pickle (``torch.save(nn.DataParallel(model))``, a
    ``torch.compile`` model) the wrapper objects are replaced by the modules they hold, classes never imported.
    The result's ``removed`` says which components were removed from how many keys. Returns a
    :class:`RenameResult` for a path, a new mapping for a mapping.

    Raises:
        UsageError: ``key`` that names no mapping, ``dst`` equal to ``src`` without ``in_place``,
            missing output folder, ``dst`` / ``in_place`` given with an in-memory mapping.
        PrefixNotFoundError: no key carries a wrapper component (unless ``allow_missing``); nothing written.
        KeyCollisionError: two keys would get one name; the colliding keys are listed, nothing written.
        UnsupportedError: FSDP flat parameters (consolidate first), TorchScript or plain-pickle files, no
            state_dict found, a full-model pickle whose keys cannot be renamed by removing wrapper objects.
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    plan = build_plan(unwrap=True)
    return apply_plan(src, dst, plan, operation="unwrap", tag="unwrapped", key=key, in_place=in_place,
                      allow_missing=allow_missing)
