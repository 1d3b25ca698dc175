"""The module tree of a state_dict, built from its fully qualified names (FQNs), with repeated blocks folded.

``conv1.weight``, ``layers.0.attn.q.weight``, ``layers.1.attn.q.weight``... become a tree whose inner nodes are
modules (``layers``, ``layers.0``, ``layers.0.attn``) and whose leaves are tensors. Each node carries the number of
parameters (elements) and bytes below it, by dtype and by saved device (location tag). Siblings whose names are
consecutive integers (``nn.Sequential`` / ``nn.ModuleList`` children) and whose subtrees hold the same tensor
names, shapes and dtypes are folded into one node, ``layers.0-31 x32``, as model summaries (torchinfo, the model
pages of the largest model hub) show transformer blocks. Used by ``ckptool inspect --tree``, ``ckptool report``
and the notebook views; nothing here reads a file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptool.model.units import human_bytes, human_count


class Leaf(Protocol):
    """What the tree needs of a tensor (``inspect``'s row, :class:`ckptool.ops.inspect.info.TensorInfo`, is one):
    ``key`` its FQN, ``shape`` in elements, ``dtype`` a torch dtype name, ``device`` the saved location tag,
    ``nbytes`` = numel * element size."""

    @property
    def key(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def nbytes(self) -> int: ...


@dataclass(slots=True)
class TreeNode:
    """A module (or a tensor, when ``tensor`` is set) of the tree.

    ``name`` the last FQN component (``"0-31"`` for a folded block), ``path`` the FQN of the node (of the first
    block of a folded run), ``params`` elements and ``nbytes`` bytes below it, ``dtypes`` / ``devices`` bytes per
    dtype and per location tag below it, ``repeat`` the number of blocks a folded node stands for (1 otherwise;
    ``params`` and the byte counts are then the totals over every block, and ``children`` those of the first).
    """

    name: str
    path: str
    params: int = 0
    nbytes: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    devices: dict[str, int] = field(default_factory=dict)
    children: list[TreeNode] = field(default_factory=list)
    tensor: Leaf | None = None
    repeat: int = 1

    @property
    def label(self) -> str:
        """The name as shown: ``layers`` / ``0-31 x32`` / ``weight``."""
        return f"{self.name} x{self.repeat}" if self.repeat > 1 else self.name

    def walk(self, depth: int = 0) -> Iterator[tuple[int, TreeNode]]:
        """(depth, node) for this node and every node below it, depth first, in key order."""
        stack: list[tuple[int, TreeNode]] = [(depth, self)]
        while stack:
            d, node = stack.pop()
            yield d, node
            stack.extend((d + 1, c) for c in reversed(node.children))

    def to_dict(self, max_depth: int | None = None, _depth: int = 0) -> dict[str, Any]:
        """JSON-ready dict (``name``, ``path``, ``params``, ``bytes``, ``dtypes``, ``devices``, ``repeat``,
        ``children``; a tensor adds ``shape`` and ``dtype``); children deeper than ``max_depth`` are left out and
        ``truncated`` says so."""
        out: dict[str, Any] = {"name": self.name, "path": self.path, "params": self.params, "bytes": self.nbytes,
                               "dtypes": self.dtypes, "devices": self.devices, "repeat": self.repeat}
        if self.tensor is not None:
            out["shape"] = list(self.tensor.shape)
            out["dtype"] = self.tensor.dtype
        if self.children:
            if max_depth is not None and _depth >= max_depth:
                out["truncated"] = True
                out["children"] = []
            else:
                out["children"] = [c.to_dict(max_depth, _depth + 1) for c in self.children]
        return out


def _add(node: TreeNode, row: Leaf) -> None:
    node.params += math.prod(row.shape)
    node.nbytes += row.nbytes
    node.dtypes[row.dtype] = node.dtypes.get(row.dtype, 0) + row.nbytes
    node.devices[row.device] = node.devices.get(row.device, 0) + row.nbytes


def build_tree(rows: Iterable[Leaf], *, fold: bool = True) -> TreeNode:
    """The module tree of ``rows`` (one per tensor, FQNs split on ``.``), children in first-seen key order; with
    ``fold`` (the default) runs of identical numbered blocks are folded (see the module docstring).

    The root's ``name`` and ``path`` are ``""``. Linear in the number of key components."""
    root = TreeNode("", "")
    index: dict[str, TreeNode] = {"": root}
    for row in rows:
        parts = row.key.split(".")
        node = root
        _add(node, row)
        for i, part in enumerate(parts):
            path = ".".join(parts[: i + 1])
            child = index.get(path) if i < len(parts) - 1 else None
            if child is None:
                child = TreeNode(part, path)
                if i == len(parts) - 1:
                    child.tensor = row
                else:
                    index[path] = child
                node.children.append(child)
            _add(child, row)
            node = child
    if fold:
        _fold(root)
    return root


def _signature(node: TreeNode) -> tuple[Any, ...]:
    """What must be equal for two blocks to fold: names, shapes and dtypes of the subtree, not the values."""
    if node.tensor is not None:
        return (tuple(node.tensor.shape), node.tensor.dtype, node.tensor.device)
    return tuple((c.name, c.repeat, _signature(c)) for c in node.children)


def _fold(root: TreeNode) -> None:
    for _, node in root.walk():  # top down: a node's children are folded before the walk descends into them
        if len(node.children) > 1:
            node.children = _fold_children(node.children)


def _fold_children(children: list[TreeNode]) -> list[TreeNode]:
    out: list[TreeNode] = []
    run: list[TreeNode] = []
    sig: tuple[Any, ...] | None = None
    for child in [*children, None]:
        numbered = child is not None and child.tensor is None and child.name.isascii() and child.name.isdigit()
        child_sig = _signature(child) if child is not None and numbered else None
        if (child is not None and numbered and run and child_sig == sig
                and int(child.name) == int(run[-1].name) + 1):
            run.append(child)
            continue
        out.extend([_folded(run)] if len(run) > 1 else run)
        run, sig = ([child], child_sig) if child is not None and numbered else ([], None)
        if child is not None and not numbered:
            out.append(child)
    return out


def _folded(run: list[TreeNode]) -> TreeNode:
    first = run[0]
    node = TreeNode(f"{first.name}-{run[-1].name}", first.path, children=first.children, repeat=len(run))
    for block in run:
        node.params += block.params
        node.nbytes += block.nbytes
        for key, value in block.dtypes.items():
            node.dtypes[key] = node.dtypes.get(key, 0) + value
        for key, value in block.devices.items():
            node.devices[key] = node.devices.get(key, 0) + value
    return node


def _mix(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {human_bytes(v)}" if len(counts) > 1 else k for k, v in counts.items())


def tree_lines(tree: TreeNode, depth: int | None = None) -> list[str]:
    """The tree as text, one node a line (``ckptool inspect --tree``): indented name, parameters, bytes, dtypes and
    devices; nodes deeper than ``depth`` (1 = the top-level modules) are left out and their parent says how many
    lines it hides."""
    lines = []
    for d, node in tree.walk():
        if node is tree:
            continue
        if depth is not None and d > depth:
            continue
        name = ("  " * (d - 1)) + node.label + ("" if node.tensor is None else f"  {shape_text(node.tensor.shape)}")
        hidden = "" if depth is None or d < depth or not node.children else f"  (+{_count_below(node)} below)"
        lines.append(f"{name:<48} {human_count(node.params):>8} params {human_bytes(node.nbytes):>10}  "
                     f"{_mix(node.dtypes)}  [{_mix(node.devices)}]{hidden}")
    return lines


def shape_text(shape: Iterable[int]) -> str:
    """A shape as `ckptool inspect` prints it: ``(3, 4)`` -> ``3x4``, ``()`` -> ``scalar``."""
    return "x".join(map(str, shape)) or "scalar"


def _count_below(node: TreeNode) -> int:
    return sum(1 for _ in node.walk()) - 1
