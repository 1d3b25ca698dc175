"""Where in a pickle's object graph each global is used (:func:`key_paths`), for the findings of ``ckptool scan``.
"""

from __future__ import annotations

from typing import Any

from ckptool.errors import CkptError
from ckptool.formats.nodes import GlobalMeta, ObjectNode, ReduceNode
from ckptool.model.graph import MAX_DEPTH, node_children

__all__ = ["MAX_KEY_PATHS", "key_paths"]

#: the most key paths reported per global and pickle
MAX_KEY_PATHS = 5


def key_paths(root: Any, names: set[str]) -> dict[str, list[str]]:
    """Where in the object ``root`` (a restricted unpickler's graph) each global of ``names`` is used: dotted key
    paths (:func:`ckptool.model.graph.node_children`'s, ``(top level)`` for the root itself), at most
    :data:`MAX_KEY_PATHS` each. The walk goes on inside an object whose own class is one of ``names``, so a global
    held as a value inside it (``typing.Any`` in an OmegaConf config) is located too. A global used only inside
    another call's callable is not located. Never raises."""
    out: dict[str, list[str]] = {}

    def found(name: str | None, path: str) -> None:
        if name in names:
            paths = out.setdefault(name, [])
            if len(paths) < MAX_KEY_PATHS and (path or "(top level)") not in paths:
                paths.append(path or "(top level)")

    stack: list[tuple[str, Any, int]] = [("", root, 0)]
    seen: set[int] = set()
    try:
        while stack:
            path, obj, depth = stack.pop()
            if isinstance(obj, GlobalMeta):
                found(obj.qualified_name, path)
                continue
            if isinstance(obj, _ATOMS) or id(obj) in seen or depth > MAX_DEPTH:
                continue
            seen.add(id(obj))
            if isinstance(obj, (ReduceNode, ObjectNode)):
                found(obj.global_name, path)
            children = list(node_children(path, obj))
            stack.extend((p, v, depth + 1) for p, v in reversed(children))
    except (CkptError, RecursionError):
        pass
    return out


_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None))
