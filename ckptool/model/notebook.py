"""HTML for notebooks (Jupyter's ``_repr_html_``): a table of facts and a module tree as nested ``<details>``.

Plain HTML with no script, so that it renders in any notebook front end, also one that strips JavaScript (the
page of ``ckptool report`` is the interactive view). Used by :class:`ckptool.ops.inspect.entry.CheckpointInfo` and
:class:`ckptool.ops.diff.result.DiffResult`.
"""

from __future__ import annotations

from collections.abc import Iterable
from html import escape

from ckptool.model.tree import TreeNode, shape_text
from ckptool.model.units import human_bytes, human_count

#: tree nodes written at most (the rest are summarised): a notebook cell stays light for 50,000 tensors
MAX_NODES = 400


def facts_table(title: str, rows: Iterable[tuple[str, object]]) -> str:
    """``<table>`` of (label, value) rows under a bold ``title``; values are escaped."""
    body = "".join(f"<tr><th style='text-align:left'>{escape(k)}</th><td style='text-align:left'>{escape(str(v))}"
                   "</td></tr>" for k, v in rows)
    return f"<div><b>{escape(title)}</b><table>{body}</table></div>"


def tree_html(tree: TreeNode, *, open_depth: int = 1, max_nodes: int = MAX_NODES) -> str:
    """The module tree as nested ``<details>`` (the first ``open_depth`` levels open), each node with its
    parameters, bytes, dtypes and devices; at most ``max_nodes`` nodes, then a line saying how many were left."""
    parts: list[str] = []
    written = 0
    total = sum(1 for _ in tree.walk()) - 1

    def node_html(node: TreeNode, depth: int) -> None:
        nonlocal written
        if written >= max_nodes:
            return
        written += 1
        shape = "" if node.tensor is None else " " + shape_text(node.tensor.shape)
        line = (f"<code>{escape(node.label)}</code>{escape(shape)} &mdash; {human_count(node.params)} params, "
                f"{human_bytes(node.nbytes)}, {escape(', '.join(node.dtypes))} "
                f"<span style='color:#a05a00'>[{escape(', '.join(node.devices))}]</span>")
        if not node.children:
            parts.append(f"<div style='margin-left:1.2em'>{line}</div>")
            return
        parts.append(f"<details{' open' if depth < open_depth else ''} style='margin-left:1.2em'>"
                     f"<summary>{line}</summary>")
        for child in node.children:
            node_html(child, depth + 1)
        parts.append("</details>")

    for child in tree.children:
        node_html(child, 0)
    more = total - written
    if more > 0:
        parts.append(f"<div><i>... {more} more nodes (ckptool report draws them all)</i></div>")
    return "<div>" + "".join(parts) + "</div>"
