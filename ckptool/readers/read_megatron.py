"""Reading Megatron-LM / Megatron-Core / NeMo checkpoints without Megatron and without torch: the consolidated
state_dict as a :class:`~ckptool.formats.tensors.Source` (Megatron's own parameter names).

* A **legacy tree** (:func:`read_legacy`): every ``model_optim_rng.pt`` is read as a node graph with the
  restricted unpickler (:func:`ckptool.formats.torchfile.read_checkpoint`: ``argparse.Namespace``, numpy and rng
  states are named, nothing is imported or run), its ``model`` (or ``model0``, ``model1``... with a virtual
  pipeline) tensors located in the file (:func:`ckptool.readers.read_torch.graph_source`), ``args`` read as plain
  values; the ranks are then consolidated by :func:`ckptool.model.megatron.consolidate` (tensor-parallel shards
  joined by layer type, pipeline stages renumbered). Optimizer, scheduler and rng state are named in
  ``left_out``; ``distrib_optim.pt`` is not read for tensors.
* A **torch_dist folder** (:func:`dist_source`): its tensors are the DCP folder's
  (:func:`ckptool.readers.read_dcp.dcp_source`: every chunk gathered, as ``dcp_to_torch_save`` gives them), and
  ``common.pt``'s plain entries (iteration, checkpoint version, scheduler state...) go to ``metadata`` as JSON
  strings, which a safetensors output keeps in its ``__metadata__`` (and to ``entries``, which a torch output holds
  beside the tensors, as ``dcp_to_torch_save`` plus ``common.pt`` give them); entries that are not plain (``args``, an
  ``argparse.Namespace``) are named in ``left_out``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats.dcp import DcpMetadata, read_dcp_metadata
from ckptool.formats.megatron import COMMON_FILE, MCORE_METADATA_GLOBALS, MegatronFolder, find_megatron
from ckptool.formats.nodes import GlobalMeta, PickledObject
from ckptool.formats.tensors import Source, Tensor
from ckptool.formats.torchfile import Checkpoint, read_checkpoint
from ckptool.model.graph import ATOMS
from ckptool.model.megatron import ModelPart, consolidate
from ckptool.readers.read_dcp import dcp_source
from ckptool.readers.read_torch import describe, graph_source
from ckptool.readers.reader import Reader

if TYPE_CHECKING:
    from ckptool.readers import Opened

__all__ = ["DistFolder", "LegacyTree", "RankState", "dist_source", "legacy_source", "plain", "read_common",
           "read_dist", "read_legacy"]

#: the note saying where the plain entries go
_KEPT = ("{what}: kept as JSON in a safetensors output's __metadata__, and as entries of the dict a torch output "
         "holds (beside the tensors, as the source keeps them)")
#: the entries of a ``model_optim_rng.pt`` that are not the model (``generate_state_dict``)
_TRAINING = ("optimizer", "opt_param_scheduler", "rng_state")


@dataclass
class RankState:
    """One ``model_optim_rng.pt`` read: its ``(tp, pp, ep)`` ranks, its model tensors per virtual chunk
    (``{v: tensors}``, local names), its other top-level entries' names and what they are."""

    path: str
    tp: int
    pp: int
    ep: int
    chunks: dict[int, list[Tensor]]
    entries: dict[str, str]
    globals: list[str]


@dataclass
class LegacyTree:
    """A legacy tree read: the folder, ``args`` (plain values of the first rank's ``argparse.Namespace``),
    ``iteration`` and ``checkpoint_version`` as saved, the parallel sizes, every rank's :class:`RankState`."""

    mf: MegatronFolder
    args: dict[str, object]
    iteration: object
    checkpoint_version: object
    tp_size: int
    pp_size: int
    ep_size: int
    vp_size: int
    ranks: list[RankState] = field(default_factory=list)


def plain(node: Any, depth: int = 0) -> tuple[bool, object]:
    """``(True, value)`` when the node graph ``node`` is plain JSON-able data (None, bool, int, float, str, and
    lists / tuples / str-keyed dicts of them, 32 levels at most), else ``(False, None)``."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return True, node
    if depth > 32:
        return False, None
    if isinstance(node, (list, tuple)):
        items = [plain(x, depth + 1) for x in node]
        return (True, [v for _, v in items]) if all(ok for ok, _ in items) else (False, None)
    if isinstance(node, dict) and all(isinstance(k, str) for k in node):
        vals = {k: plain(v, depth + 1) for k, v in node.items()}
        return (True, {k: v for k, (_, v) in vals.items()}) if all(ok for ok, _ in vals.values()) else (False, None)
    return False, None


def _what(node: Any) -> str:
    return describe(node)


def _namespace(node: Any) -> dict[str, object]:
    """The plain attributes of a pickled ``argparse.Namespace`` node (its BUILD state), by name."""
    st = node.state if isinstance(node, PickledObject) else None
    if not isinstance(st, dict):
        return {}
    out: dict[str, object] = {}
    for k, v in st.items():
        if isinstance(k, str):
            if isinstance(v, ATOMS) and not isinstance(v, bytes):
                out[k] = v
            elif isinstance(v, GlobalMeta):
                out[k] = v.qualified_name
    return out


_graphs: dict[tuple[object, ...], tuple[Checkpoint, Source, dict[str, str]]] = {}


def _read_rank(path: str) -> tuple[Checkpoint, Source, dict[str, str]]:
    """A rank file's node graph and every tensor of it (read once per file version)."""
    def read() -> tuple[Checkpoint, Source, dict[str, str]]:
        ck = read_checkpoint(path)
        src, unread = graph_source(ck)
        return ck, src, unread
    return source.per_version(_graphs, path, read, keep=64)


def _rank_state(path: str, ranks: tuple[int, int, int]) -> tuple[RankState, Checkpoint]:
    ck, src, unread = _read_rank(path)
    root = ck.root
    if not isinstance(root, dict):
        raise CorruptCheckpointError(f"{path} holds a {type(root).__name__}, not the dict Megatron saves")
    chunks: dict[int, list[Tensor]] = {}
    for t in src.tensors:
        head, _, rest = t.name.partition(".")
        if head == "model" or (head.startswith("model") and (head[5:].isascii() and head[5:].isdigit())):
            v = int(head[5:] or 0)
            if t.name in unread:
                raise UnsupportedError(f"{path}: the bytes of {t.name!r} are not readable ({unread[t.name]})")
            chunks.setdefault(v, []).append(Tensor(rest, t.name, t.dtype, t.shape, t.stride, t.offset, t.storage,
                                                   t.requires_grad))
    entries = {str(k): _what(v) for k, v in root.items()}
    globs = sorted({f"{m}.{n}" for m, n in ck.globals})
    return RankState(path, *ranks, chunks, entries, globs), ck


def _size(args: dict[str, object], name: str, found: int) -> int:
    v = args.get(name)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else found


def read_legacy(path: str | os.PathLike[str]) -> LegacyTree:
    """Read the legacy tree at ``path`` (top folder or iteration folder): every rank file's structure, no tensor
    data, nothing run.

    Raises:
        UsageError / CorruptCheckpointError: see :func:`ckptool.formats.megatron.find_megatron`; a rank file that
            is not a dict; ranks missing from the grid the parallel sizes make.
        UnsupportedError: a torch_dist folder (read by :func:`dist_source`).
    """
    mf = find_megatron(path)
    if not mf.ranks:
        raise UnsupportedError(f"{mf.folder} is a torch_dist folder, not a legacy tree")
    root = _read_rank(mf.ranks[0].path)[0].root
    args = _namespace(root.get("args")) if isinstance(root, dict) else {}
    pipeline = _size(args, "pipeline_model_parallel_size", 2) > 1  # one suffix: the pipeline rank unless PP=1
    states = [_rank_state(r.path, r.ranks(pipeline))[0] for r in mf.ranks]
    tp = _size(args, "tensor_model_parallel_size", max(s.tp for s in states) + 1)
    pp = _size(args, "pipeline_model_parallel_size", max(s.pp for s in states) + 1)
    ep = _size(args, "expert_model_parallel_size", max(s.ep for s in states) + 1)
    vp = max(len(s.chunks) for s in states)
    tree = LegacyTree(mf, args, root.get("iteration"), root.get("checkpoint_version"), tp, pp, ep, vp, states)
    have = {(s.tp, s.pp, s.ep) for s in states}
    # the sizes (from args, or from rank folder names) are checked against the ranks that exist by counting: the
    # grid is never built (TP = PP = 10^6 would be 10^12 entries); the first gap is found within len(have) + 1 steps
    total = tp * pp * ep
    present = sum(1 for a, b, c in have if a < tp and b < pp and c < ep)
    if present < total:
        a, b, c = next((a, b, c) for c in range(ep) for b in range(pp) for a in range(tp) if (a, b, c) not in have)
        raise CorruptCheckpointError(f"{mf.folder}: rank tp={a} pp={b} ep={c} is missing ({total - present} of "
                                     f"{total} ranks; TP={tp}, PP={pp}, EP={ep}); the checkpoint is incomplete")
    return tree


def legacy_source(tree: LegacyTree) -> Source:
    """The consolidated model of ``tree`` as a :class:`Source` (format ``megatron-legacy``).

    Raises:
        UnsupportedError: see :func:`ckptool.model.megatron.consolidate`.
    """
    by = {(s.tp, s.pp, s.ep): s for s in tree.ranks}
    chunks = [ModelPart(pp, v, ep, [by[(tp, pp, ep)].chunks.get(v, []) for tp in range(tree.tp_size)])
              for pp in range(tree.pp_size) for ep in range(tree.ep_size) for v in sorted(by[(0, pp, ep)].chunks)]
    done = consolidate(chunks, tree.mf.folder, swiglu=tree.args.get("swiglu") is True)
    src = Source(tree.mf.folder, "megatron-legacy", done.tensors, notes=done.notes)
    entries = tree.ranks[0].entries
    src.left_out += [f"{k}: {entries[k]} (every rank)" for k in entries if k in _TRAINING]
    src.left_out += [f"{k}: {entries[k]}" for k in entries if k == "args"]
    if any(os.path.isfile(os.path.join(os.path.dirname(s.path), "distrib_optim.pt")) for s in tree.ranks):
        src.left_out.append("distrib_optim.pt: the distributed optimizer's state (not read)")
    src.metadata = {k: json.dumps(v) for k, v in (("iteration", tree.iteration),
                                                 ("checkpoint_version", tree.checkpoint_version))
                    if plain(v)[0] and v is not None}
    if src.metadata:
        src.entries = {k: json.loads(v) for k, v in src.metadata.items()}
        src.notes.append(_KEPT.format(what="iteration and checkpoint_version"))
    return src


def read_common(folder: str) -> tuple[dict[str, str], list[str]]:
    """``(plain entries as JSON strings, other entries described)`` of a torch_dist folder's ``common.pt`` (its
    pickle read with the restricted unpickler: nothing imported or run); both empty without one.

    Raises:
        CorruptCheckpointError: a damaged ``common.pt``, or one that holds no dict.
    """
    path = os.path.join(folder, COMMON_FILE)
    if not os.path.isfile(path):
        return {}, []
    ck = read_checkpoint(path)
    if not isinstance(ck.root, dict):
        raise CorruptCheckpointError(f"{path} holds a {type(ck.root).__name__}, not the dict Megatron saves")
    kept: dict[str, str] = {}
    other: list[str] = []
    for k, v in ck.root.items():
        ok, value = plain(v)
        if ok and isinstance(k, str):
            kept[k] = json.dumps(value)
        else:
            other.append(f"{COMMON_FILE}: {k}: {_what(v)} (not plain data; `ckptool inspect {path}` shows it)")
    return kept, other


@dataclass
class DistFolder:
    """A torch_dist folder read for ``inspect``: the folder, its ``.metadata``, ``common.pt``'s plain entries (JSON
    strings) and other entries (described), the globals ``common.pt`` names."""

    mf: MegatronFolder
    meta: DcpMetadata
    common: dict[str, str]
    other: list[str]
    common_globals: list[str]


def read_dist(path: str | os.PathLike[str]) -> DistFolder:
    """Read the torch_dist folder at ``path`` (its ``.metadata`` and ``common.pt`` pickles, restricted unpickler;
    no tensor data).

    Raises: what :func:`ckptool.formats.megatron.find_megatron`, :func:`ckptool.formats.dcp.read_dcp_metadata` and
        :func:`read_common` raise.
    """
    mf = find_megatron(path)
    kept, other = read_common(mf.folder)
    common = os.path.join(mf.folder, COMMON_FILE)
    globs = [f"{m}.{n}" for m, n in read_checkpoint(common).globals] if os.path.isfile(common) else []
    return DistFolder(mf, read_dcp_metadata(mf.folder), kept, other, globs)


def dist_source(path: str | os.PathLike[str], key: str | None = None) -> Source:
    """The tensors of the torch_dist folder at ``path`` (or the top folder naming it) as a :class:`Source`
    (format ``megatron-dist``): :func:`ckptool.readers.read_dcp.dcp_source` plus ``common.pt``'s plain entries in
    ``metadata`` (module docstring).

    Raises:
        UnsupportedError: a ``sharded_backend`` other than ``torch_dist`` (zarr); what ``dcp_source`` raises.
        UsageError / CorruptCheckpointError: see :func:`ckptool.formats.megatron.find_megatron`, ``dcp_source``.
    """
    mf = find_megatron(path)
    backend = mf.backend.get("sharded_backend")
    if backend != "torch_dist":
        raise UnsupportedError(f"{mf.folder} is a Megatron dist_checkpointing folder of backend {backend!r}; "
                               "ckptool reads the torch_dist backend (Megatron-Core's default): convert it with "
                               "Megatron's own tools (dist_checkpointing.load, then save with torch_dist)")
    src = dcp_source(mf.folder, key, read_dcp_metadata(mf.folder), MCORE_METADATA_GLOBALS)
    src.format = "megatron-dist"
    kept, other = read_common(mf.folder)
    src.metadata = kept or None
    src.entries = {k: json.loads(v) for k, v in kept.items()} or None
    src.left_out += other
    if kept:
        src.notes.append(_KEPT.format(what=f"{COMMON_FILE}'s plain entries ({', '.join(kept)})"))
    return src


class LegacyReader(Reader):
    """A Megatron-LM legacy tree (the registry's ``reader``): one flat mapping, consolidated by layer type."""

    def tensors(self, key: str | None, tag: str | None, exclude_frozen: bool) -> Source:
        """:func:`legacy_source` of the tree (:func:`read_legacy`)."""
        return legacy_source(read_legacy(self.opened.target))


class DistReader(Reader):
    """A Megatron-Core torch_dist folder (the registry's ``reader``): a DCP folder plus ``common.pt``."""

    def __init__(self, opened: Opened) -> None:
        super().__init__(opened)
        self._meta: DcpMetadata | None = None

    def tensors(self, key: str | None, tag: str | None, exclude_frozen: bool) -> Source:
        """:func:`dist_source` of the folder."""
        return dist_source(self.opened.target, key)

    def dcp_metadata(self) -> DcpMetadata:
        """The DCP ``.metadata`` the folder is built on (:func:`ckptool.formats.dcp.read_dcp_metadata`), read once."""
        if self._meta is None:
            self._meta = read_dcp_metadata(self.opened.target)
        return self._meta
