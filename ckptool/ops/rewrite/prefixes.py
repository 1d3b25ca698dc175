"""``ckptool.ops.rewrite.prefixes``: remove or add wrapper prefixes in state_dict keys, in files and in memory.

Wrappers put components in front of every fully qualified name (FQN) of the model they hold:
``nn.DataParallel`` and ``DistributedDataParallel`` add ``module.``, ``torch.compile``'s ``OptimizedModule``
``_orig_mod.``, FSDP1 ``_fsdp_wrapped_module.``, activation checkpointing ``_checkpoint_wrapped_module.``, a
LightningModule the name of its attribute (``model.``). ``load_state_dict(strict=True)`` into the bare model then
fails with "Missing key(s) ... Unexpected key(s): module.conv1.weight". The functions here rename whole dotted
components only (:mod:`ckptool.model.keys`, the rule of torch's ``consume_prefix_in_state_dict_if_present``), so
``mlp_module.fc.weight`` never loses ``module``.

On a file (a ``str`` or ``os.PathLike``) each function opens it once (:func:`ckptool.readers.open_checkpoint`),
takes the pickle as a node graph (:meth:`ckptool.readers.Opened.graph`, nothing imported or run), renames the keys
of the selected state_dict(s) in the graph, and streams a new file with
:func:`ckptool.ops.rewrite.stream.rewrite_file`: tensor records are copied byte for byte, never decoded, so the
cost is the cost of copying the file and torch is not imported. safetensors files get a new JSON header and their
data block copied unchanged. The output is written atomically (temporary file, fsync, rename); nothing is written
when an error is raised.

On an in-memory mapping (a state_dict, possibly an ``OrderedDict`` with ``_metadata``, or a training checkpoint
dict holding one) each function returns a NEW mapping of the same type; the input is not mutated and the values
are the same tensor objects.

Only the selected state_dicts change: optimizer state (keyed by parameter index), hyper-parameters and every other
entry stay as they are. The state_dict's ``_metadata`` (per-module versions that ``load_state_dict`` passes to
``_load_from_state_dict``) is renamed consistently with the keys.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

from ckptool.errors import UnsupportedError, UsageError
from ckptool.model.graph import (
    StateDictRef,
    class_name,
    compiled_inner,
    find_state_dicts,
    is_module,
    iter_state_dict_of_module,
    mapping_items,
    module_entries,
    module_state,
    set_mapping_items,
)
from ckptool.model.keys import WRAPPER_COMPONENTS, WRAPPER_ONLY_COMPONENTS
from ckptool.model.paths import get_path, replace_child, resolve_path
from ckptool.model.rename_memory import rename_mapping, rename_state_dict
from ckptool.model.rename_plan import (
    RenamePlan,
    RenameSummary,
    StateDictChange,
    Step,
    build_plan,
    label,
    plan_keys,
)
from ckptool.ops.rewrite.dcp import rewrite_dcp
from ckptool.ops.rewrite.folders import write_output
from ckptool.ops.rewrite.sets import dcp_folder, opened_input, rewrite_output, rewrite_set, set_index, set_output
from ckptool.ops.rewrite.stream import (
    ProgressFn,
    RenameResult,
    rename_mapping_node,
    retag_function,
    rewrite_file,
    safetensors_keys,
    write_renamed_safetensors,
)
from ckptool.readers import Opened, open_checkpoint

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
    "rewrite_safetensors",
    "strip_dataparallel",
    "strip_prefix",
    "unwrap",
]


#: an in-memory state_dict (or checkpoint mapping) given to a renaming function: the result has its type
MappingT = TypeVar("MappingT", bound=Mapping[Any, Any])
#: a checkpoint file given to a renaming function: the result is a :class:`RenameResult`
PathArg = str | os.PathLike[str]


# ------------------------------------------------------------------------------------------------ node graph
def _target_at(root: Any, key: str, where: str) -> StateDictRef:
    """The state_dict (mapping or module) at dotted ``key`` (:func:`ckptool.model.paths.resolve_path`).

    Raises:
        UsageError: nothing there, or something that is neither a mapping nor a module.
    """
    try:
        trail = resolve_path(root, key)
    except KeyError:
        found = ", ".join(label(t.path) for t in find_state_dicts(root)) or "none"
        raise UsageError(f"{where}: no entry {key!r} (--key); state_dicts found: {found}") from None
    obj = trail[-1].child if trail else root
    if not is_module(obj) and mapping_items(obj) is None:
        found = ", ".join(label(t.path) for t in find_state_dicts(root)) or "none"
        raise UsageError(f"{where}: --key {key!r} selects a {class_name(obj)}, not a state_dict; "
                         f"state_dicts found: {found}")
    return StateDictRef(key, obj, is_module(obj), tuple(trail))


def _module_keys(node: Any, prefix: str = "") -> Iterator[str]:
    """State_dict keys of a pickled module in ``module.state_dict()`` order (compiled submodules seen through)."""
    return (key for key, _t, _is_param in iter_state_dict_of_module(node, prefix))


def _target_keys(t: StateDictRef) -> list[str]:
    if t.is_module:
        return list(_module_keys(t.obj))
    return [k for k, _v in mapping_items(t.obj) or [] if isinstance(k, str)]


def _wrapped_inner(node: Any, names: Sequence[str]) -> Any:
    """The inner module when ``node`` is a wrapper: exactly one submodule, named in ``names``, and no parameters
    or buffers of its own. Else None."""
    if compiled_inner(node) is not None:
        return node.args[0] if "_orig_mod" in names and is_module(node.args[0]) else None
    st = module_state(node)
    if st is None:
        return None
    entries = list(module_entries(st))
    if len(entries) != 1 or entries[0][2] != "module" or entries[0][0] not in names:
        return None
    inner = entries[0][1]
    return inner if is_module(inner) else None


def _unwrap_children(root: Any, wrappers: list[str]) -> None:
    """Replace, in every module below ``root``, each submodule that is a wrapper-only module (a
    :data:`WRAPPER_ONLY_COMPONENTS` name holding just the inner module) by the module it holds; the classes removed
    are added to ``wrappers`` in depth-first order. Iterative, each module visited once."""
    seen: set[int] = set()

    def open_module(node: Any) -> tuple[Any, Iterator[tuple[Any, Any]], list[tuple[Any, Any]]] | None:
        st = module_state(node)
        if st is None or id(node) in seen:
            return None
        seen.add(id(node))
        mods = st.get("_modules")
        items = mapping_items(mods)
        return (mods, iter(list(items)), []) if items else None

    first = open_module(root)
    stack = [first] if first else []
    while stack:
        mods, items, new_items = stack[-1]
        for name, child in items:
            new = child
            while (inner := _wrapped_inner(new, WRAPPER_ONLY_COMPONENTS)) is not None:
                wrappers.append(class_name(new))
                new = inner
            new_items.append((name, new))
            frame = open_module(new)
            if frame:
                stack.append(frame)
                break
        else:
            stack.pop()
            if any(n is not c for (_k, n), (_j, c) in zip(new_items, mapping_items(mods) or [])):
                set_mapping_items(mods, new_items)


def _rename_module(t: StateDictRef, plan: RenamePlan, mapping: dict[str, str], where: str) -> tuple[Any, list[str]]:
    """Apply ``plan`` to a pickled module by replacing wrapper objects with the module they hold.

    Returns ``(new module node, classes of the wrappers removed)``.

    Raises:
        UnsupportedError: the plan adds a prefix, or the structure cannot give the renamed keys (a strip that would
            drop tensors, a ``module`` attribute that is not a wrapper).
    """
    node = t.obj
    old_keys = list(mapping)
    wrappers: list[str] = []
    where_sd = label(t.path)
    for step in plan.steps:
        if step.kind == "add":
            raise UnsupportedError(
                f"{where}: {where_sd} is a pickled nn.Module ({class_name(node)}), not a state_dict: a wrapper "
                "cannot be added to it without importing the wrapper's class. Wrap the model in Python "
                "(nn.DataParallel(model)) or add the prefix to a state_dict"
            )
        if step.kind == "strip":
            for p in step.prefixes:
                node = _enter_prefix(node, p, wrappers, where, where_sd)
        else:
            while (inner := _wrapped_inner(node, WRAPPER_COMPONENTS)) is not None:
                wrappers.append(class_name(node))
                node = inner
            if step.prefixes:  # the attribute prefix every key shares (Lightning's model.)
                node = _enter_prefix(node, step.prefixes[0], wrappers, where, where_sd)
                while (inner := _wrapped_inner(node, WRAPPER_COMPONENTS)) is not None:
                    wrappers.append(class_name(node))
                    node = inner
            _unwrap_children(node, wrappers)
    new_keys = list(_module_keys(node))
    if new_keys != [mapping[k] for k in old_keys]:
        raise UnsupportedError(
            f"{where}: {where_sd} is a pickled nn.Module whose keys cannot be renamed by removing wrapper objects "
            "(a submodule named like a wrapper holds other modules beside it); load it (trusted) and rename its "
            "state_dict() with ckptool's in-memory API"
        )
    return node, wrappers


def _enter_prefix(node: Any, p: str, wrappers: list[str], where: str, where_sd: str) -> Any:
    """The submodule of pickled module ``node`` at prefix ``p`` when every key goes through it (the modules on the
    way are added to ``wrappers``); ``node`` itself when no key carries ``p``.

    Raises:
        UnsupportedError: some keys do not carry ``p`` (keeping the submodule would drop them).
    """
    keys = list(_module_keys(node))
    carried = [k.startswith(p) and len(k) > len(p) for k in keys]
    if not any(carried):
        return node
    if not all(carried):
        lost = [k for k, c in zip(keys, carried) if not c]
        raise UnsupportedError(
            f"{where}: {where_sd} is a pickled nn.Module; removing {p!r} means keeping only its submodule "
            f"{p[:-1]!r}, which would drop {len(lost)} tensor(s) such as {lost[0]!r}. Load it (trusted) "
            f"and save the submodule's state_dict instead"
        )
    for comp in p[:-1].split("."):
        wrappers.append(class_name(node))
        node = get_path(node, comp)  # the submodule: every key goes through it
    return node


def rename_graph(
    root: Any, plan: RenamePlan, *, key: str | None = None, allow_missing: bool = False, where: str = "checkpoint",
) -> tuple[Any, RenameSummary]:
    """Apply ``plan`` to the state_dict(s) of a checkpoint's node graph (:mod:`ckptool.formats.unpickler`), in place.

    ``key`` (a dotted path, :func:`ckptool.model.paths.get_path`) selects one state_dict; without it every state_dict
    that :func:`ckptool.model.graph.find_state_dicts` finds (compiled-model pickles included, optimizer state never) is
    renamed where its keys carry the prefix. Dict and OrderedDict nodes get their keys (and ``_metadata``) renamed;
    pickled modules (full-model pickles) get their wrapper objects
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
        targets = find_state_dicts(root)
        if not targets:
            raise UnsupportedError(
                f"{where}: no state_dict found (a mapping of parameter names to tensors, or a pickled nn.Module); "
                "pass --key PATH (key=...) to select the mapping to rename"
            )
    keyed = [(t.path, _target_keys(t), t.is_module) for t in targets]
    mappings, summary = plan_keys(keyed, plan, allow_missing=allow_missing, where=where)
    for t, mapping, change in zip(targets, mappings, summary.changes):
        if not change.renamed:
            continue
        bound = plan.bind(mapping)
        if not t.is_module:
            rename_mapping_node(t.obj, mapping, bound)
            continue
        new, wrappers = _rename_module(t, bound, mapping, where)
        change.wrappers_removed = wrappers
        summary.wrappers_removed += wrappers
        if new is not t.obj:
            if not t.trail:
                root = new
            elif not replace_child(t.trail[-1], new):
                raise UnsupportedError(f"{where}: the module at {label(t.path)} sits in a tuple and cannot be "
                                       "replaced; select it with --key from a mapping or list")
    return root, summary


# ------------------------------------------------------------------------------------------------ safetensors
def rewrite_safetensors(opened: Opened, out: str, plan: RenamePlan, *, key: str | None, allow_missing: bool,
                        operation: str, progress: ProgressFn | None) -> RenameResult:
    """Write the safetensors file ``opened`` to ``out`` with its tensor names renamed by ``plan`` (a new header, the
    data block copied: :func:`ckptool.ops.rewrite.stream.write_renamed_safetensors`); ``operation`` names the
    command in the result, ``progress(nbytes)`` gets the data bytes copied.

    Raises:
        UsageError: ``key`` (one flat mapping of tensors).
        PrefixNotFoundError / KeyCollisionError / NestedPrefixError: from the plan; nothing written.
        CorruptCheckpointError: an unreadable header or shared-tensor record.
    """
    src = opened.target
    if key:
        raise UsageError(f"{src} is safetensors: it holds one flat mapping of tensors, so --key does not apply")
    header = opened.safetensors_header()
    mappings, summary = plan_keys([("", safetensors_keys(src, header), False)], plan, allow_missing=allow_missing,
                                  where=src)
    res = write_renamed_safetensors(src, out, header, mappings[0], progress)
    return RenameResult.combine(res, summary, operation)


# ------------------------------------------------------------------------------------------------ public API
#: the default output of each renaming command is ``<stem>.<tag><ext>`` beside its input (:func:`rename_output`)
OUTPUT_TAGS = {"strip-prefix": "stripped", "strip-dataparallel": "stripped", "add-prefix": "prefixed",
               "unwrap": "unwrapped"}


def rename_output(operation: str, src: str | os.PathLike[str] | Opened, dst: str | os.PathLike[str] | None,
                  in_place: bool = False) -> str:
    """The file the renaming ``operation`` (a key of :data:`OUTPUT_TAGS`) writes for ``src``: ``dst``, ``src`` with
    ``in_place``, or ``<stem>.<tag><ext>`` beside ``src``; for a sharded set, the folder ``<folder>.<tag>`` beside
    the set's (:func:`ckptool.ops.rewrite.sets.set_output`).

    Raises:
        UsageError: as :func:`ckptool.ops.rewrite.stream.output_path`; ``in_place`` for a sharded set.
    """
    return rewrite_output(opened_input(src), dst, OUTPUT_TAGS[operation], in_place)


def apply_plan(
    src: Any, dst: str | os.PathLike[str] | None, plan: RenamePlan, *, operation: str,
    key: str | None = None, in_place: bool = False, allow_missing: bool = False, to: str | None = None,
    mapping: Mapping[str, str] | None = None, progress: ProgressFn | None = None,
) -> Any:
    """Run ``plan`` on a file (returns :class:`RenameResult`) or an in-memory mapping (returns a new mapping).

    The default output is :func:`rename_output`'s. ``to`` / ``mapping`` re-tag the storages in the same pass, as
    :func:`ckptool.ops.rewrite.remap.remap` does; ``progress`` as in :func:`strip_prefix`. See :func:`strip_prefix` for
    the errors raised.
    """
    if isinstance(src, Mapping):
        if dst is not None or in_place or to is not None or mapping:
            raise UsageError("dst, in_place, to and mapping apply to files; for an in-memory state_dict the new "
                             "mapping is returned (move its tensors with .to())")
        return rename_mapping(src, plan, key=key, allow_missing=allow_missing)
    if not isinstance(src, (str, os.PathLike)):
        hint = " (pass model.state_dict(), or the path of a saved file)" if hasattr(src, "state_dict") else ""
        raise UsageError(f"expected a checkpoint path or a state_dict mapping, got {type(src).__name__}{hint}")
    opened = open_checkpoint(src)
    folder = dcp_folder(opened)
    if folder is not None:
        return rewrite_dcp(opened, rename_output(operation, opened, dst, in_place), operation=operation,
                           rename=lambda root: rename_graph(root, plan, key=key, allow_missing=allow_missing,
                                                            where=folder),
                           to=to, mapping=mapping, allow_missing=allow_missing, progress=progress)
    index = set_index(opened)
    if index is not None:
        out = set_output(index, dst, OUTPUT_TAGS[operation], in_place)
        return rewrite_set(opened, out, operation=operation, plan=plan, to=to, mapping=mapping, key=key,
                           allow_missing=allow_missing, progress=progress)
    src = opened.target
    refusal = opened.spec.refusal_for("prefix", src, api=operation.replace("-", "_"))
    if refusal is not None:
        raise UnsupportedError(refusal)
    out = rename_output(operation, opened, dst, in_place)
    if opened.tensor_header() is not None:  # a safetensors file: its tensors renamed in its header
        if to is not None or mapping:
            raise UsageError(f"{src} is safetensors: it carries no location tags, so --to / --map do not apply "
                             "(load it on any device with safetensors.torch.load_file(path, device=...))")
        return write_output(opened, out, lambda path: rewrite_safetensors(
            opened, path, plan, key=key, allow_missing=allow_missing, operation=operation, progress=progress))
    ck = opened.graph()
    location_fn = retag_function(ck, to, mapping, allow_missing=allow_missing)
    root, summary = rename_graph(ck.root, plan, key=key, allow_missing=allow_missing, where=src)
    return write_output(opened, out, lambda path: RenameResult.combine(
        rewrite_file(ck, path, root, location_fn, progress=progress), summary, operation))

@overload
def strip_prefix(src: MappingT, prefixes: str | Sequence[str], dst: None = None, *, key: str | None = None,
                 in_place: Literal[False] = False, allow_missing: bool = False) -> MappingT: ...
@overload
def strip_prefix(
    src: PathArg, prefixes: str | Sequence[str], dst: PathArg | None = None, *, key: str | None = None,
    in_place: bool = False, allow_missing: bool = False, to: str | None = None,
    mapping: Mapping[str, str] | None = None, progress: ProgressFn | None = None,
) -> RenameResult: ...
def strip_prefix(
    src: Any, prefixes: str | Sequence[str], dst: str | os.PathLike[str] | None = None, *,
    key: str | None = None, in_place: bool = False, allow_missing: bool = False, to: str | None = None,
    mapping: Mapping[str, str] | None = None, progress: ProgressFn | None = None,
) -> Any:
    """Remove ``prefixes`` (whole dotted components: ``"model."`` or ``"model"``) from the front of state_dict keys.

    Several prefixes are removed in the order given, each at most once per key (``["model.", "module."]`` turns
    ``model.module.fc.weight`` into ``fc.weight`` and ``module.fc.weight`` into ``fc.weight``). Keys that do not
    carry a prefix are kept, and ``mlp_module.fc.weight`` never matches ``module.``. A key is never reduced to
    nothing.

    ``src`` is a checkpoint path (torch zip, legacy, safetensors, or a sharded set: ``*.index.json`` or its folder,
    rewritten as :func:`ckptool.ops.rewrite.sets.rewrite_set` describes, keys checked over the whole set; or a
    ``torch.distributed.checkpoint`` folder, written as a new DCP folder by
    :func:`ckptool.ops.rewrite.dcp.rewrite_dcp`, ``dst`` a new or empty folder; or a model folder holding one weights
    file, written as a folder with its other files copied, by default ``<folder>.stripped``:
    :mod:`ckptool.ops.rewrite.folders`) or an in-memory mapping. For a path, the
    output goes to ``dst``, by default ``<stem>.stripped<ext>`` beside ``src`` (``in_place=True`` replaces
    ``src``, atomically); it is torch's zip format (or safetensors for a safetensors input) and loads with
    ``torch.load(dst, weights_only=True)``. Returns a :class:`RenameResult` for a path, a new mapping of the same
    type for a mapping.

    ``key`` selects one state_dict by dotted path (``"state_dict"``, ``"model_state_dict"``, ``"ema.model"``);
    without it every state_dict found is renamed where its keys carry the prefix, never an optimizer's state.
    For a full-model pickle the wrapper objects along the prefix are replaced by the submodule they hold.

    ``to`` (every storage) or ``mapping`` (``{"cuda:1": "cpu"}``, matching tags only) re-tag the storages of a
    torch output in the same pass (:func:`ckptool.model.devices.location_function`), so ``to="cpu"`` gives a file
    that a plain ``torch.load`` opens on a machine without a GPU. ``progress(nbytes)`` is called as the input's
    tensor bytes are copied (bytes since the last call).

    Raises:
        UsageError: bad prefix, ``key`` that names no mapping, ``dst`` equal to ``src`` without ``in_place``,
            missing output folder, ``dst`` / ``in_place`` / ``to`` / ``mapping`` given with an in-memory mapping,
            ``to`` / ``mapping`` for a safetensors file, a bad device string.
        PrefixNotFoundError: no key carries the prefix (unless ``allow_missing``); nothing written.
        DeviceNotFoundError: a ``mapping`` source matches no storage (unless ``allow_missing``); nothing written.
        KeyCollisionError: two keys would get one name; the colliding keys are listed, nothing written.
        UnsupportedError: FSDP flat parameters (consolidate first), TorchScript or plain-pickle files, no
            state_dict found, a full-model pickle whose keys cannot be renamed by removing wrapper objects.
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    if isinstance(prefixes, str):
        prefixes = [prefixes]
    plan = build_plan(strip_prefixes=list(prefixes))
    return apply_plan(src, dst, plan, operation="strip-prefix", key=key, in_place=in_place,
                      allow_missing=allow_missing, to=to, mapping=mapping, progress=progress)


@overload
def strip_dataparallel(src: MappingT, dst: None = None, *, key: str | None = None, in_place: Literal[False] = False,
                       allow_missing: bool = False) -> MappingT: ...
@overload
def strip_dataparallel(
    src: PathArg, dst: PathArg | None = None, *, key: str | None = None, in_place: bool = False,
    allow_missing: bool = False, to: str | None = None, mapping: Mapping[str, str] | None = None,
    progress: ProgressFn | None = None,
) -> RenameResult: ...
def strip_dataparallel(
    src: Any, dst: str | os.PathLike[str] | None = None, *, key: str | None = None, in_place: bool = False,
    allow_missing: bool = False, to: str | None = None, mapping: Mapping[str, str] | None = None,
    progress: ProgressFn | None = None,
) -> Any:
    """Remove the leading ``module.`` that ``nn.DataParallel`` and ``DistributedDataParallel`` add to every key.

    The same as ``strip_prefix(src, "module.", ...)`` (default output ``<stem>.stripped<ext>``), and on a
    full-model pickle (``torch.save(nn.DataParallel(model))``) the file then holds the inner module object,
    written without importing its class. ``to`` / ``mapping`` re-tag the storages as in :func:`strip_prefix`.
    Returns a :class:`RenameResult` for a path, a new mapping for a mapping.

    Raises:
        UsageError: ``key`` that names no mapping, ``dst`` equal to ``src`` without ``in_place``,
            missing output folder, ``dst`` / ``in_place`` given with an in-memory mapping.
        PrefixNotFoundError: no key starts with ``module.`` (unless ``allow_missing``); nothing written.
        DeviceNotFoundError: a ``mapping`` source matches no storage (unless ``allow_missing``); nothing written.
        KeyCollisionError: two keys would get one name; the colliding keys are listed, nothing written.
        UnsupportedError: FSDP flat parameters (consolidate first), TorchScript or plain-pickle files, no
            state_dict found, a full-model pickle whose keys cannot be renamed by removing wrapper objects.
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    plan = build_plan(strip_dataparallel=True)
    return apply_plan(src, dst, plan, operation="strip-dataparallel", key=key, in_place=in_place,
                      allow_missing=allow_missing, to=to, mapping=mapping, progress=progress)


@overload
def add_prefix(src: MappingT, prefix: str, dst: None = None, *, key: str | None = None,
               in_place: Literal[False] = False, allow_nested: bool = False, allow_missing: bool = False) -> MappingT:
    ...
@overload
def add_prefix(
    src: PathArg, prefix: str, dst: PathArg | None = None, *, key: str | None = None,
    in_place: bool = False, allow_nested: bool = False, to: str | None = None,
    mapping: Mapping[str, str] | None = None, allow_missing: bool = False, progress: ProgressFn | None = None,
) -> RenameResult: ...
def add_prefix(
    src: Any, prefix: str, dst: str | os.PathLike[str] | None = None, *, key: str | None = None,
    in_place: bool = False, allow_nested: bool = False, to: str | None = None,
    mapping: Mapping[str, str] | None = None, allow_missing: bool = False, progress: ProgressFn | None = None,
) -> Any:
    """Put ``prefix`` (whole components, ``"module."``) in front of every key, e.g. to load a bare state_dict into
    ``nn.DataParallel(model)`` or a compiled model (``"_orig_mod."``) with ``strict=True``.

    ``_metadata`` paths get the prefix too (``"fc"`` -> ``"module.fc"``). Default output
    ``<stem>.prefixed<ext>``. Without ``key``, every state_dict found gets the prefix (optimizer state never).
    Full-model pickles are refused (a wrapper object cannot be made without its class). Keys that already start
    with ``prefix`` are refused (the result would be ``module.module.``) unless ``allow_nested``. ``to`` /
    ``mapping`` re-tag the storages as in :func:`strip_prefix` (``allow_missing`` lets a ``mapping`` source that
    matches no storage pass). Returns a :class:`RenameResult` for a path, a new mapping for a mapping.

    Raises:
        UsageError: bad prefix, ``key`` that names no mapping, ``dst`` equal to ``src`` without ``in_place``,
            missing output folder, ``dst`` / ``in_place`` / ``to`` / ``mapping`` given with an in-memory mapping,
            ``to`` / ``mapping`` for a safetensors file, a bad device string.
        NestedPrefixError: keys already carry ``prefix`` (unless ``allow_nested``); nothing written.
        DeviceNotFoundError: a ``mapping`` source matches no storage (unless ``allow_missing``); nothing written.
        KeyCollisionError: two keys would get one name; the colliding keys are listed, nothing written.
        UnsupportedError: FSDP flat parameters (consolidate first), TorchScript or plain-pickle files, no
            state_dict found, a full-model pickle (a wrapper cannot be added to it).
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    plan = build_plan(add_prefix=prefix, allow_nested=allow_nested)
    return apply_plan(src, dst, plan, operation="add-prefix", key=key, in_place=in_place,
                      allow_missing=allow_missing, to=to, mapping=mapping, progress=progress)


@overload
def unwrap(src: MappingT, dst: None = None, *, key: str | None = None, in_place: Literal[False] = False,
           allow_missing: bool = False) -> MappingT: ...
@overload
def unwrap(
    src: PathArg, dst: PathArg | None = None, *, key: str | None = None, in_place: bool = False,
    allow_missing: bool = False, to: str | None = None, mapping: Mapping[str, str] | None = None,
    progress: ProgressFn | None = None,
) -> RenameResult: ...
def unwrap(
    src: Any, dst: str | os.PathLike[str] | None = None, *, key: str | None = None, in_place: bool = False,
    allow_missing: bool = False, to: str | None = None, mapping: Mapping[str, str] | None = None,
    progress: ProgressFn | None = None,
) -> Any:
    """Remove every wrapper prefix that ``inspect`` reports: ``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``
    and ``_checkpoint_wrapped_module.`` from the front of keys in any stacking order (DDP of a compiled model gives
    ``module._orig_mod.``, a compiled DDP ``_orig_mod.module.``), the wrapper-only names (``_orig_mod``,
    ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``) also in the middle of keys, and an attribute prefix
    that every key of a state_dict shares (Lightning's ``model.``; :func:`ckptool.model.keys.unwrap_keys`, the
    rule :func:`ckptool.model.keys.shared_prefixes` applies for ``inspect``). ``to`` / ``mapping`` re-tag the
    storages as in :func:`strip_prefix`.

    Default output ``<stem>.unwrapped<ext>``. On a full-model pickle (``torch.save(nn.DataParallel(model))``, a
    ``torch.compile`` model) the wrapper objects are replaced by the modules they hold, classes never imported.
    The result's ``removed`` says which components were removed from how many keys. Returns a
    :class:`RenameResult` for a path, a new mapping for a mapping.

    Raises:
        UsageError: ``key`` that names no mapping, ``dst`` equal to ``src`` without ``in_place``,
            missing output folder, ``dst`` / ``in_place`` given with an in-memory mapping.
        PrefixNotFoundError: no key carries a wrapper component (unless ``allow_missing``); nothing written.
        DeviceNotFoundError: a ``mapping`` source matches no storage (unless ``allow_missing``); nothing written.
        KeyCollisionError: two keys would get one name; the colliding keys are listed, nothing written.
        UnsupportedError: FSDP flat parameters (consolidate first), TorchScript or plain-pickle files, no
            state_dict found, a full-model pickle whose keys cannot be renamed by removing wrapper objects.
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    plan = build_plan(unwrap=True)
    return apply_plan(src, dst, plan, operation="unwrap", key=key, in_place=in_place,
                      allow_missing=allow_missing, to=to, mapping=mapping, progress=progress)
