"""HTML for notebooks (Jupyter's ``_repr_html_``): a table of facts and a module tree as nested ``<details>``; and
:func:`script_json`, the one way ckptool puts JSON inside an HTML ``<script>`` element.

Plain HTML with no script, so that it renders in any notebook front end, also one that strips JavaScript (the
page of ``ckptool report`` is the interactive view). Used by :class:`ckptool.ops.inspect.entry.CheckpointInfo` and
:class:`ckptool.ops.diff.result.DiffResult`. Every text from a checkpoint (key names, dict keys, metadata) is
escaped: :func:`html.escape` in markup, :func:`script_json` in a script.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from html import escape
from typing import Any

from ckptool.model.tree import TreeNode, shape_text
from ckptool.model.units import human_bytes, human_count

#: the characters JSON inside ``<script>`` must not hold as themselves, each written as its JSON escape: ``<`` and
#: ``>`` (``</script>`` ends the element; ``<!--<script>`` puts the HTML parser in its escaped-script state, where
#: the element's end tag is not seen), ``&``, and U+2028 / U+2029 (line ends in JavaScript before ES2019)
SCRIPT_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026", 0x2028: "\\u2028",
                  0x2029: "\\u2029"}

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


def script_json(value: Any) -> str:
    """``value`` as compact JSON text that is safe as the content of an HTML ``<script>`` element whatever its
    strings hold: ``<``, ``>``, ``&``, U+2028 and U+2029 are written as ``\\u003c``, ``\\u003e``, ``\\u0026``,
    ``\\u2028``, ``\\u2029`` (:data:`SCRIPT_ESCAPES`; the same JSON to ``JSON.parse``), so no key name can end the
    element or change how the HTML parser reads it (WHATWG HTML, "script data" states). The escapes are those of
    Django's ``json_script`` and Go's ``html/template``.

    Raises:
        TypeError: ``value`` holds something JSON cannot.
    """
    return json.dumps(value, separators=(",", ":")).translate(SCRIPT_ESCAPES)
