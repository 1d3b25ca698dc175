"""The entries of a ``torch.distributed.checkpoint`` folder nested as ``dcp_to_torch_save`` nests them, renamed
(:func:`rename_entries`) or filtered (:func:`drop_entries`) as the file commands rename and filter the file it
writes: the renaming and dropping of :func:`ckptool.ops.rewrite.dcp.rewrite_dcp` (its module docstring says how the
nesting, the FQNs and ``planner_data`` paths correspond).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats.nodes import PickledObject, TensorNode
from ckptool.model.graph import mapping_items
from ckptool.model.keys import raise_on_collisions
from ckptool.model.rename_plan import RenameSummary
from ckptool.model.tensor_nodes import tensor_node
from ckptool.readers.structures import DcpMetadata

__all__ = ["Dropper", "Renamer", "drop_entries", "rename_entries"]

#: ``rename(root) -> (new root, summary)``: the renaming of a node graph
#: (:func:`ckptool.ops.rewrite.prefixes.rename_graph`
#: with the plan, ``--key`` and ``--allow-missing`` bound), applied to the nesting of a DCP folder's entries
Renamer = Callable[[Any], tuple[Any, RenameSummary]]
#: ``drop(root) -> new root``: the nesting of a DCP folder's entries without the entries to drop (changed in place,
#: or a part of it: see the module docstring of :mod:`ckptool.ops.rewrite.dcp`)
Dropper = Callable[[Any], Any]


class _Entry:
    """A non-tensor entry's place in the renaming graph (never a state_dict value; a ``*_extra_state`` key may
    hold one, as in a state_dict)."""

    __slots__ = ()


def _nesting(meta: DcpMetadata) -> tuple[dict[Any, Any], dict[int, str]]:
    """The entries of ``meta`` nested as ``dcp_to_torch_save`` nests them (``planner_data`` paths; an FQN itself
    without one): a graph of dicts whose leaves are tensor nodes and :class:`_Entry` placeholders; and each
    leaf's FQN by ``id``.

    Raises:
        CorruptCheckpointError: a path that is not a tuple of names and indices, or that runs through an entry.
    """
    planner = meta.planner_data if meta.planner_data is not None else {}
    root: dict[Any, Any] = {}
    leaves: dict[int, str] = {}
    for e in meta.entries:
        path = planner.get(e.fqn, (e.fqn,))
        leaf: Any = tensor_node("0", "float32", (), ()) if e.dtype is not None else _Entry()
        if not isinstance(path, (tuple, list)) or not path or not all(type(p) in (str, int) for p in path):
            raise CorruptCheckpointError(f"{meta.folder}: planner_data gives {e.fqn!r} the path {path!r}, not a "
                                         "tuple of names; the .metadata is damaged")
        where = root
        for p in path[:-1]:
            where = where.setdefault(p, {})
            if type(where) is not dict:
                raise CorruptCheckpointError(f"{meta.folder}: the planner_data path of {e.fqn!r} runs through "
                                             "another entry; the .metadata is damaged")
        if path[-1] in where:
            raise CorruptCheckpointError(f"{meta.folder}: two entries have the planner_data path {path!r}")
        where[path[-1]] = leaf
        leaves[id(leaf)] = e.fqn
    return root, leaves


def _paths(root: Any, leaves: dict[int, str]) -> dict[str, tuple[Any, ...]]:
    """Each leaf's FQN (as :func:`_nesting` gave it) -> its path in the (renamed) graph ``root``."""
    out: dict[str, tuple[Any, ...]] = {}
    stack: list[tuple[Any, tuple[Any, ...]]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        for k, v in mapping_items(node) or []:
            if type(v) is TensorNode or isinstance(v, _Entry):
                out[leaves[id(v)]] = (*path, k)
            elif mapping_items(v) is not None:
                stack.append((v, (*path, k)))
    return out


def rename_entries(meta: DcpMetadata, rename: Renamer
                   ) -> tuple[dict[str, str], dict[str, tuple[Any, ...]], RenameSummary]:
    """``({old FQN: new FQN}, {old FQN: new planner path}, summary)`` of ``rename`` applied to the nesting of the
    folder's entries (see the module docstring of :mod:`ckptool.ops.rewrite.dcp`).

    Raises:
        KeyCollisionError: two entries would get one FQN; what ``rename`` raises.
    """
    root, leaves = _nesting(meta)
    root, summary = rename(root)
    paths = _paths(root, leaves)
    if len(paths) != len(leaves):
        raise UnsupportedError(f"{meta.folder}: the renaming lost entries of the folder; nothing was written")
    fqns = {old: ".".join(map(str, p)) for old, p in paths.items()}
    raise_on_collisions(fqns, where=meta.folder)
    return fqns, paths, summary


def drop_entries(meta: DcpMetadata, drop: Dropper) -> tuple[dict[str, str], dict[str, tuple[Any, ...]], set[str]]:
    """Apply ``drop`` to the nesting of the folder's entries: the entries it no longer reaches leave ``meta``'s
    graph (``state_dict_metadata``, ``storage_data``, ``planner_data``, ``meta.entries``). Returns
    ``({old FQN: new FQN}, {old FQN: new path})`` of the entries kept, and the FQNs of those dropped (whose
    records the caller marks dropped).

    Raises:
        UsageError: every entry would go.
        KeyCollisionError: two kept entries would get one FQN.
    """
    root, leaves = _nesting(meta)
    paths = _paths(drop(root), leaves)
    if not paths:
        raise UsageError(f"{meta.folder}: the filter matched every entry of the folder; nothing was written")
    gone = set(leaves.values()) - set(paths)
    fqns = {old: ".".join(map(str, p)) for old, p in paths.items()}
    raise_on_collisions(fqns, where=meta.folder)
    st = meta.root.state
    for table in (st["state_dict_metadata"], st.get("planner_data"), st["storage_data"]):  # the last by its fqn
        if isinstance(table, dict):
            for k in [k for k in table if (k.state["fqn"] if isinstance(k, PickledObject) else k) in gone]:
                del table[k]
    meta.entries = [e for e in meta.entries if e.fqn not in gone]
    return fqns, paths, gone
