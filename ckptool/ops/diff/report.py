"""``ckptool.ops.diff.report``: a checkpoint (or two) as one self-contained HTML page, and its module tree as text.

The page (:func:`report`) holds, with its CSS and JavaScript inline and nothing fetched from a network:

* a summary: format, kind, size, parameters and bytes by dtype and by saved device (location tag), wrapper
  prefixes with the command that removes them, the safety verdict (``ckptool scan``'s analysis, from
  :func:`ckptool.ops.inspect.entry.inspect`), and the non-tensor entries;
* the module tree (:mod:`ckptool.model.tree`: repeated blocks folded, ``layers.0-31 x32``), drawn lazily: a node's
  children enter the page only when it is expanded, so 50,000 tensors stay responsive; a search box lists the
  tensors and modules whose FQN holds the text;
* a treemap of where the bytes are, two module levels deep, sized by bytes and coloured by dtype (the squarified
  layout of Bruls, Huizing and van Wijk, from the ``squarify`` package);
* with a second checkpoint B: every key as equal / value change / shape or dtype change / only in A / only in B
  (:func:`ckptool.ops.diff.compare.diff`), and per module the relative change ``||B - A|| / ||A||`` as bars, computed by
  streaming both files tensor by tensor (numpy decodes the chunks; nothing is loaded whole, torch is not needed).

Inspecting reads only pickles and headers; the comparison reads every tensor of both files once.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import jinja2
import squarify

from ckptool._deprecate import renamed_argument
from ckptool._fileio import atomic_output
from ckptool.model.notebook import script_json
from ckptool.model.tree import TreeNode, shape_text
from ckptool.model.units import human_bytes, human_count
from ckptool.ops.diff.compare import diff
from ckptool.ops.diff.result import CLOSE, DIFFER, DiffResult
from ckptool.ops.inspect.entry import CheckpointInfo, inspect
from ckptool.readers import open_checkpoint

#: the treemap's size in CSS pixels
TREEMAP_W, TREEMAP_H = 960, 420
#: dtype -> fill colour of the treemap and the legend (others get a grey)
DTYPE_COLOURS = {
    "float32": "#4e79a7", "float16": "#f28e2b", "bfloat16": "#e15759", "float64": "#76b7b2", "int64": "#59a14f",
    "int32": "#edc948", "int8": "#b07aa1", "uint8": "#ff9da7", "bool": "#9c755f", "float8_e4m3fn": "#d37295",
    "float8_e5m2": "#a0cbe8", "complex64": "#8cd17d",
}
OTHER_COLOUR = "#bab0ac"
#: rows of the comparison table written into the page (the counts cover every key)
MAX_DIFF_ROWS = 5000
#: search results listed at once
MAX_MATCHES = 500


@dataclass
class ReportResult:
    """What :func:`report` wrote: ``dst`` the page's path, ``bytes_written`` its size in bytes, ``tensors`` the
    tensors of A, ``seconds`` the wall time taken, ``compared`` whether a second checkpoint was compared,
    ``figures`` what the page summarises (:func:`report_figures`: ``a``, ``b``, ``comparison``)."""

    dst: str
    bytes_written: int
    tensors: int
    seconds: float
    compared: bool
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def out(self) -> str:
        """Deprecated name of :attr:`dst` (ckptool 0.1), removed in ckptool 0.3."""
        warnings.warn("ReportResult.out is deprecated, use ReportResult.dst", DeprecationWarning, stacklevel=2)
        return self.dst


# ------------------------------------------------------------------------------------------------ the tree
# ------------------------------------------------------------------------------------------------ page data
def _compact(node: TreeNode) -> list[Any]:
    """A node as ``[label, params, bytes, dtypes, devices, children | shape]`` plus, for a folded block, the name
    its path continues with (its first block's): short JSON for big trees. The page rebuilds each FQN from the
    parents' names; a tensor gives its dtype and device as strings instead of dicts."""
    if node.tensor is not None:
        return [node.label, node.params, node.nbytes, node.tensor.dtype, node.tensor.device,
                shape_text(node.tensor.shape)]
    out = [node.label, node.params, node.nbytes, node.dtypes, node.devices, [_compact(c) for c in node.children]]
    if node.repeat > 1:
        out.append(node.path.rsplit(".", 1)[-1])
    return out


def _main_dtype(node: TreeNode) -> str:
    return max(node.dtypes.items(), key=lambda kv: kv[1])[0] if node.dtypes else ""


def _treemap(tree: TreeNode) -> list[dict[str, Any]]:
    """Rectangles ``{x, y, w, h, label, path, bytes, dtype, colour, depth}`` of the top-level modules and, inside
    each, its children, areas proportional to bytes."""
    rects: list[dict[str, Any]] = []

    def lay(nodes: list[TreeNode], x: float, y: float, w: float, h: float, depth: int) -> None:
        nodes = sorted((n for n in nodes if n.nbytes > 0), key=lambda n: -n.nbytes)
        if not nodes or w < 2 or h < 2:
            return
        sizes = squarify.normalize_sizes([n.nbytes for n in nodes], w, h)
        for n, r in zip(nodes, squarify.squarify(sizes, x, y, w, h)):
            dtype = _main_dtype(n)
            rects.append({"x": round(r["x"], 1), "y": round(r["y"], 1), "w": round(r["dx"], 1),
                          "h": round(r["dy"], 1), "label": n.label, "path": n.path or n.label,
                          "bytes": human_bytes(n.nbytes), "dtype": dtype, "depth": depth,
                          "colour": DTYPE_COLOURS.get(dtype, OTHER_COLOUR)})
            if depth == 0 and n.children and n.tensor is None:
                pad = 3 if r["dx"] > 24 and r["dy"] > 24 else 0
                lay(n.children, r["x"] + pad, r["y"] + pad + (12 if r["dy"] > 40 else 0),
                    r["dx"] - 2 * pad, r["dy"] - 2 * pad - (12 if r["dy"] > 40 else 0), 1)

    lay(tree.children, 0, 0, TREEMAP_W, TREEMAP_H, 0)
    return rects


def side_figures(info: CheckpointInfo) -> dict[str, Any]:
    """The figures of one checkpoint that the page's summary shows, JSON-ready (counts and bytes as integers):
    ``path``, ``format``, ``kind``, ``size`` (the file or folder, bytes), ``tensors``, ``storages``, ``bytes``
    (each storage once), ``params`` (elements), ``by_dtype`` / ``by_device`` (``{name: {"params", "bytes"}}``),
    ``state_dicts`` (``[{"path", "tensors", "prefixes", "fix"}]``), ``verdict`` (scan's verdict, a
    :class:`~ckptool.model.verdict.Verdict` word), ``dangerous`` /
    ``needs_trust`` (the globals of each level) and ``values`` (``[{"path", "type", "shown"}]``, the entries that
    are not tensors)."""
    by: dict[str, dict[str, dict[str, int]]] = {"dtype": {}, "device": {}}

    def add(what: str, key: str, field: str, n: int) -> None:
        row = by[what].setdefault(key, {"params": 0, "bytes": 0})
        row[field] += n

    for t in info.tensors:
        add("dtype", t.dtype, "params", math.prod(t.shape))
        add("device", t.device, "params", math.prod(t.shape))
    for row in info.totals:
        add("dtype", row.dtype, "bytes", row.bytes)
        add("device", row.device, "bytes", row.bytes)
    security = info.security()
    return {
        "path": info.path, "format": info.format, "kind": info.kind, "size": info.size,
        "tensors": len(info.tensors), "storages": info.storages, "bytes": info.total_bytes,
        "params": sum(r["params"] for r in by["dtype"].values()),
        "by_dtype": dict(sorted(by["dtype"].items())), "by_device": dict(sorted(by["device"].items())),
        "state_dicts": [{"path": sd.path, "tensors": sd.tensors, "prefixes": list(sd.prefixes), "fix": sd.fix}
                        for sd in info.state_dicts],
        "verdict": info.verdict.value,
        "dangerous": [d["name"] for d in security.get("dangerous", [])],
        "needs_trust": list(security.get("needs_trust", [])),
        "values": [{"path": v.path, "type": v.type, "shown": v.shown} for v in info.values],
    }


def _summary(fig: dict[str, Any]) -> dict[str, Any]:
    """:func:`side_figures` as the page shows them (sizes and counts in words, rows as tuples)."""
    return {
        **fig, "size": human_bytes(fig["size"]), "bytes": human_bytes(fig["bytes"]),
        "by": [(what, key, human_count(row["params"]), human_bytes(row["bytes"]))
               for what in ("dtype", "device") for key, row in fig[f"by_{what}"].items()],
        "state_dicts": [(sd["path"] or "(top level)", sd["tensors"], " ".join(sd["prefixes"]) or "-", sd["fix"] or "-")
                        for sd in fig["state_dicts"]],
        "values": [(v["path"], v["type"], v["shown"]) for v in fig["values"]],
    }


def _diff_rows(res: DiffResult) -> tuple[dict[str, int], list[tuple[str, str, str]]]:
    """Counts per status and rows ``(key, status, detail)`` of every key that is not equal."""
    rows: list[tuple[str, str, str]] = []
    layout = {t.key for t in res.tensors if any(c.startswith(("shape", "dtype")) for c in t.changes)}
    for t in res.tensors:
        if t.key in layout:
            rows.append((t.key, "shape or dtype change", "; ".join(t.changes)))
        elif t.values in (DIFFER, CLOSE):
            detail = "" if t.max_abs is None else f"max |B - A| {t.max_abs:.3g}"
            rows.append((t.key, "value change", detail))
    rows += [(k, "only in A", "") for k in res.only_a]
    rows += [(k, "only in B", "") for k in res.only_b]
    rows += [(v.key, "value change", f"{v.a!r} -> {v.b!r}"[:200]) for v in res.values]
    counts = {"equal": res.values_equal if res.mode != "keys-only" else 0,
              "value change": sum(1 for r in rows if r[1] == "value change"),
              "shape or dtype change": len(layout), "only in A": len(res.only_a), "only in B": len(res.only_b)}
    return counts, rows


def _module_changes(info: CheckpointInfo, res: DiffResult, depth: int = 3) -> list[dict[str, Any]]:
    """Per module of A, ``depth`` levels deep, blocks not folded, in key order: ``||B - A|| / ||A||`` over the
    tensors below it that were measured (linear in the number of keys)."""
    sums: dict[str, list[float]] = {}
    for key, (na, nd) in res.norms.items():
        parts = key.split(".")[:-1]
        for i in range(1, min(len(parts), depth) + 1):
            total = sums.setdefault(".".join(parts[:i]), [0.0, 0.0, 0.0])
            total[0] += na
            total[1] += nd
            total[2] += 1
    out = []
    for d, node in info.tree(fold=False).walk():
        acc = sums.get(node.path) if node.tensor is None and d else None
        if acc is None:
            continue
        sq_a, sq_d, measured = acc
        rel = math.sqrt(sq_d) / math.sqrt(sq_a) if sq_a > 0 else (0.0 if sq_d == 0 else math.inf)
        out.append({"path": node.path, "depth": d, "rel": rel, "tensors": int(measured)})
    return out


def report_figures(info: CheckpointInfo, other: CheckpointInfo | None = None, res: DiffResult | None = None
                   ) -> dict[str, Any]:
    """Every figure the page summarises, JSON-ready (what ``ckptool report --json`` prints): ``a`` and ``b``
    (:func:`side_figures`; ``b`` None without B) and ``comparison`` (None without B): ``counts`` (keys per
    status: equal, value change, shape or dtype change, only in A, only in B), ``prefix`` (the wrapper prefix keys
    were matched after, or None), ``modules`` (per module of A three levels deep: ``path``, ``depth``,
    ``tensors`` measured, ``rel`` = ``||B - A|| / ||A||``, None where ``||A||`` is 0 and B differs), ``norms``
    (whether the relative changes were measured: False without numpy), ``changed`` (the keys that differ,
    ``[{"key", "status", "detail"}]``, the first :data:`MAX_DIFF_ROWS`) and ``changed_left`` (those not listed)."""
    comparison = None
    if res is not None:
        counts, rows = _diff_rows(res)
        modules = [{**c, "rel": c["rel"] if math.isfinite(c["rel"]) else None} for c in _module_changes(info, res)]
        comparison = {
            "counts": counts, "prefix": res.prefix or None, "modules": modules,
            "norms": bool(res.norms) or res.compared == 0,
            "changed": [{"key": k, "status": st, "detail": d} for k, st, d in rows[:MAX_DIFF_ROWS]],
            "changed_left": max(0, len(rows) - MAX_DIFF_ROWS),
        }
    return {"a": side_figures(info), "b": side_figures(other) if other is not None else None,
            "comparison": comparison}


# ------------------------------------------------------------------------------------------------ the page
def _page(info: CheckpointInfo, figures: dict[str, Any]) -> str:
    """The page of :func:`report_figures` ``figures`` (``info``: side A, for its module tree) as one HTML string."""
    tree = info.tree()
    template = resources.files("ckptool.ops.diff").joinpath("report.html.j2").read_text(encoding="utf-8")
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True)
    data = {"tree": _compact(tree), "maxMatches": MAX_MATCHES}
    comparison = figures["comparison"] or {"counts": {}, "changed": [], "changed_left": 0, "modules": [],
                                           "norms": True}
    changes = [dict(c) for c in comparison["modules"]]
    top = max((c["rel"] for c in changes if c["rel"] is not None), default=0.0)
    for c in changes:
        c["width"] = 100.0 if c["rel"] is None or top == 0 else 100.0 * c["rel"] / top
        c["shown"] = "inf" if c["rel"] is None else f"{c['rel']:.3g}"
    rects = _treemap(tree)
    b = figures["b"]
    return env.from_string(template).render(
        a=_summary(figures["a"]), b=_summary(b) if b is not None else None, res=figures["comparison"],
        treemap=rects, treemap_w=TREEMAP_W, treemap_h=TREEMAP_H,
        legend=sorted({(r["dtype"], r["colour"]) for r in rects if r["depth"] == 0}),
        counts=comparison["counts"], rows=[(r["key"], r["status"], r["detail"]) for r in comparison["changed"]],
        rows_left=comparison["changed_left"], changes=changes, norms_missing=not comparison["norms"],
        data_json=script_json(data),
    )


def render_html(info: CheckpointInfo, other: CheckpointInfo | None = None, res: DiffResult | None = None) -> str:
    """The page for ``info`` (and the comparison with ``other`` when ``res`` is given) as one HTML string."""
    return _page(info, report_figures(info, other, res))


@renamed_argument("out", "dst")
def report(a: str | os.PathLike[str], b: str | os.PathLike[str] | None = None, *,
           dst: str | os.PathLike[str], max_expand: float | None = None) -> ReportResult:
    """Write the HTML page about checkpoint ``a`` (compared with ``b`` when given) to ``dst``, atomically.

    ``dst`` was called ``out`` in ckptool 0.1; ``out=`` still works with a ``DeprecationWarning`` until 0.3.

    ``a`` and ``b`` are anything :func:`ckptool.ops.inspect.entry.inspect` reads (torch zip and legacy files,
    TorchScript, safetensors, sharded sets, DCP and DeepSpeed folders, ``.pt2``; local paths or URLs). Without
    ``b`` only pickles and headers are read; with ``b`` every tensor of both is streamed once
    (:func:`ckptool.ops.diff.compare.diff` with ``norms=True``, which needs numpy; ``max_expand`` as there).

    Returns a :class:`ReportResult`.

    Raises:
        NotACheckpointError / CorruptCheckpointError / UnsupportedError: a side cannot be read, or (with ``b``)
            its tensors are over the ``max_expand`` budget (:mod:`ckptool.readers.budget`).
        ModuleNotFoundError: ``b`` given and numpy is not installed (``pip install numpy``).
        OutputError / UsageError: ``dst`` cannot be written (see :func:`ckptool._fileio.atomic_output`).
    """
    start = time.perf_counter()
    side_a = open_checkpoint(a)  # each side opened once: inspect and diff share its format and its pickle
    info = inspect(side_a)
    other = res = None
    if b is not None:
        side_b = open_checkpoint(b)
        other = inspect(side_b)
        res = diff(side_a, side_b, norms=True, max_expand=max_expand)
    figures = report_figures(info, other, res)
    page = _page(info, figures).encode("utf-8")
    path = os.fspath(dst)
    with atomic_output(path) as f:
        f.write(page)
    return ReportResult(path, len(page), len(info.tensors), time.perf_counter() - start, b is not None, figures)


__all__ = ["ReportResult", "render_html", "report", "report_figures", "side_figures"]
