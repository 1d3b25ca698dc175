"""Reading each side of ``ckptool diff``, and which part of it is compared: the whole file, or the state_dict
``convert`` picks.

Each side is opened once through the readers layer (:func:`ckptool.readers.open_checkpoint`: the format detected
once) and its tensors are the readers' own :class:`~ckptool.formats.tensors.Tensor` objects, over the
:class:`~ckptool.formats.tensors.Storage` that says where their bytes are (a byte range, byte-swapped or gathered
``segments``, a safetensors sharing group's ``pieces``). A torch zip, legacy or TorchScript file compared whole is
read through :meth:`~ckptool.readers.Opened.all_tensors` (every tensor of the pickle; a pickled ``nn.Module`` as
its state_dict: parameters and buffers, not its attributes) and :meth:`~ckptool.readers.Opened.values` (its plain
values); every other side through :meth:`~ckptool.readers.Opened.state_dict`, the same
:class:`~ckptool.formats.tensors.Source` ``convert`` reads: a safetensors file or a sharded set (the tied names
``safetensors.torch.save_model`` dropped given back), a ``.pt2`` archive, a DeepSpeed ZeRO folder (its
consolidated fp32 state_dict), a DCP folder (every tensor's bytes in its ``.distcp`` records,
:mod:`ckptool.readers.read_dcp`; its non-tensor entries, never read, are compared by name), a torch.package
archive (its state_dict chosen as ``convert`` chooses it, nothing of the package run:
:mod:`ckptool.readers.read_package`), and a selected state_dict of a torch file.

A training checkpoint (``{"epoch": 1, "model_state_dict": ..., "optimizer_state_dict": ...}``, or a DCP folder
saved from ``{"model": ..., "optim": ...}``) compared with a bare state_dict (safetensors, a sharded set, a ``.pt2``
archive, a DeepSpeed folder, a torch file or DCP folder whose state_dict is the top level) is compared through the
state_dict that ``convert`` would convert from it (:func:`ckptool.readers.read_torch.select_state_dict`, the same
choice, in :meth:`~ckptool.readers.Opened.tree`); two checkpoints whose state_dicts sit at the same place are
compared whole, as they are. ``key`` (``--key``) selects that state_dict on every side where it resolves: in the
tree of a torch file or DCP folder (:func:`ckptool.model.paths.resolve_path`), or among the mappings of another
format that holds several (:attr:`ckptool.readers.Format.keyed`: a torch.package archive's ``<member>:<path>``).

What a side's format records of each tensor (:attr:`~ckptool.readers.Format.location_tags`,
:attr:`~ckptool.readers.Format.strides`) decides which properties are compared (:meth:`Side.device`,
:meth:`Side.stride`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats.dtypes import contiguous_stride, element_size, numel
from ckptool.formats.tensors import Source, Storage, Tensor, is_contiguous
from ckptool.model.graph import find_state_dicts, is_module, mapping_items, too_deep
from ckptool.model.paths import resolve_path
from ckptool.readers import Format, Opened, open_checkpoint
from ckptool.readers.read_dcp import NON_TENSOR
from ckptool.readers.read_safetensors import restore_library_aliases
from ckptool.readers.read_torch import select_state_dict

__all__ = ["UNREAD", "Probe", "Side", "choose_keys", "probe", "read_pair", "readable", "restored"]


@dataclass
class Probe:
    """One side of a diff: the checkpoint as opened (:class:`~ckptool.readers.Opened`, its format detected once)
    and the ``root`` in which a state_dict is chosen (:meth:`~ckptool.readers.Opened.tree`: a torch file's pickle
    as a node graph, a DCP folder's ``planner_data`` nesting; None for the other formats)."""

    opened: Opened
    root: Any = None

    @property
    def path(self) -> str:
        """The path read: a set's ``*.index.json``, a model folder's single weights file, else the path given."""
        return self.opened.target

    @property
    def selectable(self) -> bool:
        """A torch.save file (zip or legacy) or a DCP folder: a state_dict can be chosen in it, as ``convert``
        does (a TorchScript archive has a tree too, but ``convert`` reads no state_dict from it)."""
        return self.root is not None and self.opened.spec.tensors


def probe(path: str | Opened) -> Probe:
    """``path`` opened (:func:`ckptool.readers.open_checkpoint`) and, for a torch file, its pickle read as a node
    graph; for a DCP folder its ``.metadata``'s nesting.

    Raises:
        UsageError / NotACheckpointError / CorruptCheckpointError: as :func:`ckptool.readers.open_checkpoint`,
            :meth:`ckptool.readers.Opened.graph` and :meth:`~ckptool.readers.Opened.dcp_metadata` raise.
    """
    o = path if isinstance(path, Opened) else open_checkpoint(path)
    return Probe(o, o.tree())


def _auto(p: Probe) -> str | None:
    """The dotted path of the state_dict ``convert`` picks in ``p`` (``""``: the top level), None when ``p`` is no
    torch.save file or DCP folder, or holds no single likely state_dict."""
    if not p.selectable:
        return None
    try:
        return select_state_dict(p.root, None, p.path).path
    except (UsageError, UnsupportedError):
        return None


def _resolves(p: Probe, key: str) -> bool:
    """True when ``key`` names a mapping or a pickled module in the torch file or DCP folder ``p``, or one of the
    mappings of another format that holds several (a torch.package archive's ``<member>:<path>``:
    :mod:`ckptool.readers.read_package`)."""
    if p.selectable:
        try:
            trail = resolve_path(p.root, key)
        except KeyError:
            return False
        obj = trail[-1].child if trail else p.root
        return is_module(obj) or mapping_items(obj) is not None
    if p.root is not None or not p.opened.spec.keyed:
        return False
    try:
        p.opened.state_dict(key)
    except UsageError:
        return False
    return True


def _listing(p: Probe) -> str:
    if p.selectable:
        found = ", ".join(sd.path or "(top level)" for sd in find_state_dicts(p.root)) or "none"
        return f"state_dicts in {p.path}: {found}"
    if p.root is None and p.opened.spec.keyed:
        return f"state_dicts in {p.path}: {', '.join(e.path for e in p.opened.state_dicts()) or 'none'}"
    return f"{p.path} is {p.opened.format}: --key does not apply to it"


def choose_keys(a: Probe, b: Probe, key: str | None) -> tuple[str | None, str | None]:
    """``(key in A, key in B)``: the dotted path of the state_dict to compare on each side, None to compare the
    side whole (any side that is not a torch.save file or a DCP folder, and one whose state_dict is the top
    level).

    With ``key``: that path on each side where it resolves; a side where it does not is then compared through
    its automatically chosen state_dict. Without: a side's automatically chosen state_dict (``convert``'s choice)
    when the other side is a bare state_dict, or when both sides are training checkpoints whose state_dicts sit at
    different paths; otherwise both sides whole.

    Raises:
        UsageError: ``key`` resolves on neither side (the message lists the state_dicts of each).
    """
    auto_a, auto_b = _auto(a), _auto(b)
    if key is not None:
        ka = key if _resolves(a, key) else None
        kb = key if _resolves(b, key) else None
        if ka is None and kb is None:
            raise UsageError(f"--key {key!r} names no state_dict in A nor in B ({_listing(a)}; {_listing(b)}); "
                             "pass a dotted path that one of them holds")
        return ka if ka is not None else (auto_a or None), kb if kb is not None else (auto_b or None)
    bare_a = a.root is None or auto_a == ""
    bare_b = b.root is None or auto_b == ""
    ka = auto_a if auto_a and (bare_b or (auto_b and auto_b != auto_a)) else None
    kb = auto_b if auto_b and (bare_a or (auto_a and auto_a != auto_b)) else None
    return ka, kb


# ------------------------------------------------------------------------------------------------ reading a side
@dataclass
class Side:
    """One side of a diff as read: its ``path``, its registry entry ``spec``, its tensors by key (the readers'
    :class:`~ckptool.formats.tensors.Tensor`, storage identity as read: tensors sharing a storage share one
    :class:`~ckptool.formats.tensors.Storage`), its plain values by key, ``unread`` (key -> why the values of that
    tensor are not read) and ``notes``."""

    path: str
    spec: Format
    tensors: dict[str, Tensor]
    values: dict[str, object]
    unread: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: the registry entry of each file a set's storages lie in (its shards may mix formats), by path
    _files: dict[str, Format] = field(default_factory=dict, repr=False)

    @property
    def format(self) -> str:
        """The registry name of the side's format (``torch-zip``, ``safetensors``, ...)."""
        return self.spec.name

    def _spec_of(self, t: Tensor) -> Format:
        """What records ``t``: the side's format, or in a set the format of the shard holding ``t``'s storage."""
        if self.spec.kind != "set":
            return self.spec
        path = t.storage.path
        if path not in self._files:
            self._files[path] = open_checkpoint(path).spec
        return self._files[path]

    def device(self, t: Tensor) -> str | None:
        """``t``'s saved location tag, None when its format records none (the tensor opens on the CPU)."""
        return t.storage.location if self._spec_of(t).location_tags else None

    @property
    def stores_sharing(self) -> bool:
        """Whether the side's format can record that tensors share a storage: not a format whose tensors keep no
        strides (``strides`` ``"none"``, a DCP folder: ``dcp.load`` copies each record into the caller's own
        tensors, so no tie or view survives a save)."""
        return self.spec.strides != "none"

    def stride(self, t: Tensor) -> tuple[int, ...] | None:
        """``t``'s strides as its file records them, None when it records none (the tensor is contiguous):
        every tensor's in a torch file or ``.pt2`` archive; in safetensors only a view ckptool's sharing record
        gave back (any other is stored contiguous); none in a DCP folder (``dcp.load`` copies into the caller's
        tensors, whatever view a record holds)."""
        strides = self._spec_of(t).strides
        if strides == "saved" or (strides == "views" and t.stride != contiguous_stride(t.shape)):
            return t.stride
        return None


def readable(t: Tensor) -> Tensor | None:
    """``t`` as read for its values: itself over a storage that is a byte range or ``segments``; for a tensor of a
    safetensors sharing group (``pieces``), the same view over the bytes of a stored piece that holds it (the
    piece itself, or a contiguous piece covering its span); None when no piece holds it."""
    st = t.storage
    if st.pieces is None:
        return t
    lo, hi = t.span
    for p in st.pieces:
        if (p.offset, p.shape, p.stride) == (t.offset, t.shape, t.stride):
            bytes_of = Storage(st.path, p.file_offset, p.nbytes, t.dtype)
            return Tensor(t.name, t.src_name, t.dtype, t.shape, contiguous_stride(t.shape), 0, bytes_of)
        if is_contiguous(p.shape, p.stride) and p.offset <= lo and hi <= p.offset + numel(p.shape):
            bytes_of = Storage(st.path, p.file_offset, numel(p.shape) * element_size(t.dtype), t.dtype)
            return Tensor(t.name, t.src_name, t.dtype, t.shape, t.stride, t.offset - p.offset, bytes_of)
    return None


def _read_side(p: Probe, key: str | None) -> Side:
    """The tensors (and a torch file's plain values) of side ``p``: with ``key``, the state_dict at that path as
    ``convert`` reads it (:meth:`~ckptool.readers.Opened.state_dict`); without, the side whole."""
    o = p.opened
    try:
        if key is None and o.spec.pickled:  # a torch file whole: every tensor, and its plain values
            src, unread = o.all_tensors()
            return Side(o.target, o.spec, {t.name: t for t in src.tensors}, o.values(), dict(unread))
        if key is None and p.root is not None:  # a DCP folder whole: every tensor by its fully qualified name
            key = ""
        return _source_side(o, restored(o.state_dict(key)))
    except RecursionError as e:
        raise CorruptCheckpointError(f"{p.path}: {too_deep(e)}") from None


def restored(src: Source) -> Source:
    """``src`` with the tied names ``safetensors.torch.save_model`` dropped given back (a safetensors source whose
    ``__metadata__`` records them; any other is returned as it is)."""
    restore_library_aliases(src)
    return src


def _source_side(o: Opened, src: Source) -> Side:
    """A side read as a :class:`Source` (:meth:`~ckptool.readers.Opened.state_dict`), without plain values but a
    DCP folder's non-tensor entries, compared by name (:data:`UNREAD`)."""
    side = Side(src.path, o.spec, {t.name: t for t in src.tensors}, {})
    side.unread = {t.name: "a view of a shared storage that no stored tensor holds" for t in src.tensors
                   if readable(t) is None}
    side.notes += src.notes
    suffix = ": " + NON_TENSOR
    names = [s[:-len(suffix)] for s in src.skipped if s.endswith(suffix)]
    if names:
        side.notes.append(f"{src.path}: non-tensor entries of a DCP folder are compared by name only")
        side.values.update((k, UNREAD) for k in names)
    left = src.left_out + [s for s in src.skipped if not s.endswith(suffix)]
    if left:
        side.notes.append(f"{src.path}: not compared: {'; '.join(left[:8])}{' ...' if len(left) > 8 else ''}")
    return side


class _Unread:
    """A plain value whose data was not read (a DCP folder's non-tensor entry): compared by name only."""

    def __repr__(self) -> str:
        return "<not read>"


UNREAD = _Unread()


def read_pair(a: str | Opened, b: str | Opened, key: str | None) -> tuple[Side, Side, str | None, str | None]:
    """Both sides of a diff, each read once its format is detected (:func:`probe`) and the part to compare chosen
    (:func:`choose_keys`): ``(side A, side B, key in A, key in B)``.

    Raises:
        UsageError: see :func:`choose_keys`; CorruptCheckpointError: a pickle nested too deep; and what the
            readers raise (:func:`probe`, ``convert``'s readers).
    """
    name_a, name_b = (x.path if isinstance(x, Opened) else x for x in (a, b))
    where = name_a
    try:
        pa = probe(a)
        where = name_b
        pb = probe(b)
        where = f"{name_a} or {name_b}"
        key_a, key_b = choose_keys(pa, pb, key)
    except RecursionError as e:
        raise CorruptCheckpointError(f"{where}: {too_deep(e)}") from None
    return _read_side(pa, key_a), _read_side(pb, key_b), key_a, key_b
