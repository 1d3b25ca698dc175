"""The walks of :mod:`ckptool.model.graph` over loaded Python objects (what ``torch.load`` returns).

A loaded checkpoint is made of ``dict`` / ``OrderedDict``, ``list``, ``tuple`` and leaves; which leaves are tensors
(or modules) the caller says with a predicate (``lambda v: isinstance(v, torch.Tensor)``), so this module never
imports torch. The traversal engines are the node graph's (:func:`~ckptool.model.graph.depth_first`,
:func:`~ckptool.model.graph.breadth_first`): iterative, linear in the number of nodes, the same naming and the
same state_dict rule (:func:`~ckptool.model.graph.looks_like_state_dict`). Dotted paths into loaded objects are
followed by :func:`ckptool.model.paths.resolve_path`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ckptool.model.graph import StateDictRef, breadth_first, depth_first, join, looks_like_state_dict

__all__ = ["find_object_state_dicts", "is_object_state_dict", "iter_object_tensors"]


def is_object_state_dict(obj: object, is_tensor: Callable[[Any], bool]) -> bool:
    """A mapping with string keys, at least one tensor value (``is_tensor``), and only tensors or
    ``*_extra_state`` entries."""
    return isinstance(obj, Mapping) and looks_like_state_dict(obj.items(), is_tensor)


def iter_object_tensors(root: object, is_tensor: Callable[[Any], bool], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(dotted key, tensor)`` for every tensor reachable from a loaded object, depth-first in insertion
    order, through mappings, lists and tuples (other objects are not entered).

    ``is_tensor`` tells tensors apart. A tensor reached under several keys (tied weights) is listed under each; a
    container reached twice is entered once. Time is linear in the number of nodes.

    Raises:
        CorruptCheckpointError: containers nested deeper than :data:`ckptool.model.graph.MAX_DEPTH`.
    """
    def leaf(obj: object) -> tuple[Any] | None:
        return (obj,) if is_tensor(obj) else None

    for path, (t,) in depth_first(root, prefix, _children, leaf):
        yield path, t


def _children(path: str, obj: object) -> list[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        return [(f"{path}.{k}" if path else str(k), v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(join(path, i), v) for i, v in enumerate(obj)]
    return []


def _items(obj: object) -> list[tuple[Any, Any]] | None:
    return list(obj.items()) if isinstance(obj, Mapping) else None


def find_object_state_dicts(root: object, is_tensor: Callable[[Any], bool], *,
                            is_module: Callable[[Any], bool] | None = None,
                            max_depth: int | None = None) -> list[StateDictRef]:
    """Every state_dict in a loaded object, outermost first (breadth-first), like
    :func:`ckptool.model.graph.find_state_dicts` for the node graph: mappings that pass
    :func:`is_object_state_dict`, and objects for which ``is_module`` holds (``isinstance(v, nn.Module)``; their
    ``StateDictRef.is_module`` is True and ``obj`` is the module itself). Each result carries its ``trail`` from
    ``root`` (the real keys and indices). A found state_dict and optimizer state_dicts (``state`` +
    ``param_groups``) are not entered; mappings (by string and int keys), lists and tuples are, no deeper than
    ``max_depth`` levels below ``root`` (None: no limit). Time is linear in the number of nodes.
    """
    return breadth_first(root, items=_items, tensor_test=is_tensor, is_module=is_module or (lambda _o: False),
                         max_depth=max_depth)
