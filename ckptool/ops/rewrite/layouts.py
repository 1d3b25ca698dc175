"""What a folder format built on ``torch.distributed.checkpoint`` adds to a DCP folder, as a DCP rewrite
(:mod:`ckptool.ops.rewrite.dcp`) carries it over: the files beside ``.metadata`` copied byte for byte, and what
the writing library caches inside ``.metadata`` that names entries by their FQN renamed (or dropped) with them.

**Megatron-Core's torch_dist** (``ckptool.formats.megatron.dist_layout``; megatron-core 0.16,
``megatron/core/dist_checkpointing``). ``dist_checkpointing.load`` reads ``metadata.json`` (``core.py``
``maybe_load_config``: the backend), ``common.pt`` (``strategies/common.py`` ``load_common``: ``torch.load`` of the
entries that are not sharded, keyed by state_dict key, never by FQN) and the DCP folder through
``FileSystemReader`` (``strategies/torch.py`` ``TorchDistLoadShardedStrategy.load``: the FQNs of
``state_dict_metadata`` and ``storage_data`` are the ``ShardedTensor`` keys it asks for). Its save also caches
every rank's save plan in ``.metadata`` (``strategies/state_dict_saver.py``: ``global_metadata.all_local_plans``,
a list of ``SavePlan`` whose ``WriteItem`` s name each chunk by a ``MetadataIndex``); a later save with
``cached_metadata`` compares its own plans with them (``verify_global_md_reuse``) and, when equal, writes the loaded
``.metadata`` again as the new one. So the plans are renamed with the entries (a dropped entry's write items go),
and ``.metadata`` stays one consistent structure: a renamed folder resaved with the renamed keys reuses it, as the
original does with the original keys. ``mcore_data`` (older megatron-core: per-FQN data, read with ``getattr``) has
its keys renamed likewise. Any other attribute of ``Metadata`` that names a renamed or dropped FQN is refused,
nothing written: ckptool does not know what reads it.
"""

from __future__ import annotations

import filecmp
import os
from collections.abc import Iterable
from typing import Any

from ckptool._fileio import copy_range
from ckptool.errors import UnsupportedError, VerificationError
from ckptool.formats.nodes import PickledObject
from ckptool.ops.rewrite.companions import check_link
from ckptool.readers import open_checkpoint
from ckptool.readers.structures import DcpLayout, DcpMetadata

__all__ = ["companions_note", "copy_companions", "follow_names"]

#: the attributes of torch's ``Metadata`` (torch/distributed/checkpoint/metadata.py) the DCP rewrite renames or keeps
_DCP_FIELDS = frozenset(("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"))
#: Megatron-Core's cached save plans and per-FQN data (module docstring)
_PLANS, _MCORE_DATA = "all_local_plans", "mcore_data"
_INDEX = "torch.distributed.checkpoint.metadata.MetadataIndex"


def _state(node: Any) -> Any:
    return node.state if isinstance(node, PickledObject) else None


def _global(node: Any) -> str | None:
    name = getattr(node, "global_name", None)
    return name if isinstance(name, str) else None


def _plan_items(meta: DcpMetadata, plan: Any) -> list[Any]:
    """The ``items`` list of the cached ``SavePlan`` node ``plan``.

    Raises:
        UnsupportedError: not a ``SavePlan`` as megatron-core writes it (a state with an ``items`` list and an
            empty ``planner_data``), which ckptool cannot rename.
    """
    st = _state(plan)
    items = st.get("items") if type(st) is dict else None
    if type(items) is not list or st.get("planner_data"):
        raise UnsupportedError(f"{meta.folder}: .metadata caches save plans ({_PLANS}) that are not the plans "
                               "megatron-core writes (a SavePlan with an items list and no planner_data); ckptool "
                               "cannot rename the entries in them, nothing was written")
    return items


def _item_index(meta: DcpMetadata, item: Any) -> dict[str, Any]:
    """The ``MetadataIndex`` state of the cached ``WriteItem`` node ``item``.

    Raises:
        UnsupportedError: a write item without one naming an FQN.
    """
    st = _state(item)
    idx = st.get("index") if type(st) is dict else None
    ist = _state(idx)
    if _global(idx) != _INDEX or type(ist) is not dict or type(ist.get("fqn")) is not str:
        raise UnsupportedError(f"{meta.folder}: a write item of the save plans .metadata caches ({_PLANS}) names no "
                               "entry by a MetadataIndex; ckptool cannot rename it, nothing was written")
    return ist


def _rename_plans(meta: DcpMetadata, plans: Any, fqns: dict[str, str], gone: set[str], done: dict[int, str]) -> None:
    """Rename (``fqns``) or drop (``gone``) the entries the cached save plans name, in place; ``done``: the
    ``MetadataIndex`` states already renamed (shared with ``storage_data``), by id, with their FQN before."""
    if not isinstance(plans, list):
        raise UnsupportedError(f"{meta.folder}: .metadata's {_PLANS} is a {type(plans).__name__}, not the list of "
                               "save plans megatron-core caches; nothing was written")
    for plan in plans:
        items = _plan_items(meta, plan)
        indexes = [_item_index(meta, it) for it in items]
        before = [done.get(id(ist), ist["fqn"]) for ist in indexes]
        items[:] = [it for it, fqn in zip(items, before) if fqn not in gone]
        for ist, fqn in zip(indexes, before):
            if fqn not in gone and id(ist) not in done:
                done[id(ist)] = fqn
                ist["fqn"] = fqns.get(fqn, fqn)


def _strings(node: Any) -> Iterable[str]:
    """Every string in the node graph ``node`` (dict keys and values, sequences, objects' states and arguments)."""
    stack, seen = [node], set()
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            yield x
        elif id(x) in seen:
            continue
        elif isinstance(x, dict):
            seen.add(id(x))
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            seen.add(id(x))
            stack.extend(x)
        elif isinstance(x, PickledObject):
            seen.add(id(x))
            stack.extend((x.state, getattr(x, "args", None), x.dictitems, x.listitems))


def follow_names(meta: DcpMetadata, fqns: dict[str, str], gone: set[str], done: dict[int, str]) -> None:
    """Carry a renaming (``fqns``: old FQN -> new, the entries kept) and the dropped entries (``gone``) into what
    ``meta``'s ``Metadata`` caches besides DCP's own fields (module docstring), in place. ``done``: the
    ``MetadataIndex`` states of ``storage_data``, already renamed, by id, with their FQN before.

    Raises:
        UnsupportedError: cached plans ckptool cannot rename, or another attribute naming a renamed or dropped
            FQN; nothing is written.
    """
    st = meta.root.state
    changed = {k for k, v in fqns.items() if k != v} | gone
    if not changed:
        return
    for name, value in list(st.items()):
        if name in _DCP_FIELDS:
            continue
        if name == _PLANS and value is not None:
            _rename_plans(meta, value, fqns, gone, done)
        elif name == _MCORE_DATA and isinstance(value, dict):
            renamed = {fqns.get(k, k): v for k, v in value.items() if k not in gone}
            value.clear()
            value.update(renamed)
        elif any(s in changed for s in _strings(value)):
            raise UnsupportedError(f"{meta.folder}: .metadata's {name!r} (not a field of torch's Metadata) names "
                                   "entries the command renames or drops; ckptool does not know what reads it, so "
                                   "nothing was written")


def _check_plans(stage: str) -> None:
    """Read the written ``.metadata`` back (restricted unpickler) and check that every FQN its cached save plans
    and ``mcore_data`` name is one of its entries.

    Raises:
        VerificationError: one is not (nothing is kept: the caller's stage folder goes).
    """
    back = open_checkpoint(stage).dcp_metadata()
    st = back.root.state
    entries = {e.fqn for e in back.entries}
    named = [_item_index(back, it)["fqn"] for plan in st.get(_PLANS) or [] for it in _plan_items(back, plan)]
    mcore = st.get(_MCORE_DATA)
    named += list(mcore) if isinstance(mcore, dict) else []
    stale = [n for n in named if n not in entries]
    if stale:
        raise VerificationError(f"{stage}: the written .metadata caches entries it does not hold ({stale[0]!r}); "
                                "nothing was kept (a ckptool bug: please report it)")


def copy_companions(folder: str, stage: str, layout: DcpLayout) -> list[str]:
    """Copy the files of ``layout.companions`` that ``folder`` holds into ``stage``, byte for byte (fsynced),
    compare each copy with its source, and check the written ``.metadata``'s caches (every FQN they name is an
    entry of it); the names copied.

    Raises:
        VerificationError: a copy differs from its source, or a cache names a missing entry (nothing is kept: the
            caller's stage folder goes).
        UnsupportedError: a companion is a symbolic link out of ``folder`` (:func:`check_link`).
    """
    copied = []
    for name in layout.companions:
        src = os.path.join(folder, name)
        if os.path.islink(src):
            check_link(folder, src)
        if not os.path.isfile(src):
            continue
        dst = os.path.join(stage, name)
        with open(src, "rb") as f, open(dst, "wb") as o:
            copy_range(f, o, 0, os.fstat(f.fileno()).st_size)
            o.flush()
            os.fsync(o.fileno())
        if not filecmp.cmp(src, dst, shallow=False):
            raise VerificationError(f"{stage}: the copy of {name} differs from {src}; nothing was kept")
        copied.append(name)
    if layout.companions:
        _check_plans(stage)
    return copied


def companions_note(copied: list[str]) -> str:
    """The words a rewrite's note adds for the companion files it copied (``"; metadata.json, common.pt as they
    are"``; empty for none)."""
    return f"; {', '.join(copied)} as they are" if copied else ""
