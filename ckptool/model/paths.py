"""Dotted key paths into a checkpoint: the one home of path lookup.

``state_dict``, ``model.ema``, ``optimizer.state.0``: :func:`resolve_path` follows such a path through a node graph
(:mod:`ckptool.model.graph`) or a loaded Python object and returns the trail of :class:`~ckptool.model.graph.Link`
records, so that callers that need to replace what they found (:func:`replace_child`) or to name its siblings do
not look it up twice; :func:`get_path` returns the object itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ckptool.formats.nodes import GlobalMeta, PersistentRef, PickledObject, StorageRef
from ckptool.model.graph import ATOMS, Link, compiled_inner, mapping_items, module_state, set_mapping_items

__all__ = ["get_path", "replace_child", "resolve_path"]

_NODE_TYPES = (PickledObject, GlobalMeta, StorageRef, PersistentRef)
_INT_RE = re.compile(r"-?[0-9]+")


def _keyed(obj: object) -> Mapping[Any, Any] | None:
    """A loaded mapping itself, a mapping node as ``{key: value}`` of its str and int keys (later pairs win)."""
    if isinstance(obj, Mapping):
        return obj
    pairs = mapping_items(obj)
    if pairs is None:
        return None
    return {k: v for k, v in pairs if type(k) is str or type(k) is int}


def _attribute(obj: object, name: str) -> tuple[Any, Any] | None:
    """``(parent, child)`` of attribute ``name``: a compiled model's ``_orig_mod``, a pickled module's attribute
    (its ``__dict__``, then parameters, buffers, submodules, as ``nn.Module.__getattr__`` looks), an attribute of
    a loaded object; None when there is none."""
    inner = compiled_inner(obj)
    if inner is not None:
        return (obj, inner) if name == "_orig_mod" else None
    st = module_state(obj)
    if st is not None:
        if name in st:
            return st, st[name]
        for attr in ("_parameters", "_buffers", "_modules"):
            for k, v in mapping_items(st.get(attr)) or []:
                if k == name:
                    return st[attr], v
        return None
    if isinstance(obj, (*_NODE_TYPES, *ATOMS, list, tuple)):
        return None
    try:
        return obj, getattr(obj, name)
    except AttributeError:
        return None


def resolve_path(root: object, path: str) -> list[Link]:
    """The :class:`Link` trail from ``root`` to the object at dotted ``path`` (``""``: ``root``, an empty trail).

    Each component is matched as a mapping key, longest dotted run first (so a key that itself holds dots, such as
    ``"model.ema"``, is reached whole), string key before int key (negative ones included: ``"-1"``); a single
    component is also a list or tuple index (``"0"``), a compiled model's ``_orig_mod``, a pickled module's
    attribute (its ``__dict__``, then parameters, buffers and submodules, as ``nn.Module.__getattr__`` looks), or,
    for a loaded object that is not a container, an attribute (``getattr``). Works on node graphs and on loaded
    objects; the syntax of :func:`get_path`.

    Raises:
        KeyError: nothing at ``path`` (the message is ``path``).
    """
    trail: list[Link] = []
    if path == "":
        return trail
    parts = path.split(".")
    obj: Any = root
    i = 0
    while i < len(parts):
        keyed = _keyed(obj)
        link: Link | None = None
        if keyed is not None:
            for j in range(len(parts), i, -1):
                comp = ".".join(parts[i:j])
                for key in (comp, int(comp)) if _INT_RE.fullmatch(comp) else (comp,):
                    if key in keyed:
                        link = Link(obj, key, keyed[key])
                        break
                if link is not None:
                    i = j
                    break
        elif isinstance(obj, (list, tuple)):
            comp = parts[i]
            if comp.isascii() and comp.isdigit() and int(comp) < len(obj):
                link = Link(obj, int(comp), obj[int(comp)])
                i += 1
        else:
            found = _attribute(obj, parts[i])
            if found is not None:
                link = Link(found[0], parts[i], found[1])
                i += 1
        if link is None:
            raise KeyError(path)
        trail.append(link)
        obj = link.child
    return trail


def get_path(root: object, path: str) -> Any:
    """The object at dotted ``path`` (``""`` = root); see :func:`resolve_path` for the syntax and the KeyError."""
    return trail[-1].child if (trail := resolve_path(root, path)) else root


def replace_child(link: Link, new: object) -> bool:
    """Put ``new`` where ``link.child`` is in ``link.parent``, in place. Returns False when the parent cannot be
    changed (a tuple, an attribute of a loaded object)."""
    parent, key, old = link
    if isinstance(parent, (dict, list)):
        parent[key] = new
        return True
    if compiled_inner(parent) is not None and key == "_orig_mod":
        parent.args = (new, *parent.args[1:])
        return True
    pairs = mapping_items(parent)
    if pairs is None:
        return False
    pairs = list(pairs)  # a copy: mapping_items may return the node's own list
    at = [i for i, (k, v) in enumerate(pairs) if v is old and type(k) is type(key) and k == key]
    if at:
        pairs[at[-1]] = (key, new)
        set_mapping_items(parent, pairs)
    return bool(at)
