"""Reading each side of ``ckptool diff``, and which part of it is compared: the whole file, or the state_dict
``convert`` picks.

Each side is opened once through the readers layer (:func:`ckptool.readers.open_checkpoint`: the format detected
once). A torch zip or legacy file compared whole is read through its node graph
(:meth:`~ckptool.readers.Opened.graph`) and :func:`ckptool.ops.inspect.entry.describe` (every tensor, with its storage,
layout and saved location tag) plus its plain values; every other side through
:meth:`~ckptool.readers.Opened.state_dict`, the same :class:`~ckptool.formats.tensors.Source` ``convert`` reads: a
safetensors file or a sharded set (the tied names ``safetensors.torch.save_model`` dropped given back), a ``.pt2``
archive, a DeepSpeed ZeRO folder (its consolidated fp32 state_dict), a DCP folder (every tensor's bytes in its
``.distcp`` records, :mod:`ckptool.readers.read_dcp`; its non-tensor entries, never read, are compared by name),
a torch.package archive (its state_dict chosen as ``convert`` chooses it, nothing of the package run:
:mod:`ckptool.readers.read_package`), and a selected state_dict of a torch file.

A training checkpoint (``{"epoch": 1, "model_state_dict": ..., "optimizer_state_dict": ...}``, or a DCP folder
saved from ``{"model": ..., "optim": ...}``) compared with a bare state_dict (safetensors, a sharded set, a ``.pt2``
archive, a DeepSpeed folder, a torch file or DCP folder whose state_dict is the top level) is compared through the
state_dict that ``convert`` would convert from it (:func:`ckptool.readers.read_torch.select_state_dict`, the same
choice; in a DCP folder, in the nesting its ``planner_data`` records); two checkpoints whose state_dicts sit at the
same place are compared whole, as they are. ``key`` (``--key``) selects that state_dict on every torch or DCP side
where it resolves (:func:`ckptool.model.paths.resolve_path`), and on a torch.package side that holds it
(``<member>:<path>``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats import detect as formats
from ckptool.formats.dtypes import contiguous_stride, element_size, numel, storage_nbytes
from ckptool.formats.tensors import Source, Storage, Tensor, is_contiguous
from ckptool.formats.torchfile import Checkpoint, read_checkpoint, resolve_zip_offsets
from ckptool.model.graph import find_state_dicts, is_module, mapping_items, too_deep
from ckptool.model.paths import resolve_path
from ckptool.model.values import iter_values
from ckptool.ops.inspect.entry import describe
from ckptool.readers import Opened, open_checkpoint
from ckptool.readers.read_dcp import NON_TENSOR, dcp_tree
from ckptool.readers.read_safetensors import restore_library_aliases
from ckptool.readers.read_torch import select_state_dict

__all__ = ["UNREAD", "Probe", "Side", "SideTensor", "choose_keys", "probe", "read_pair", "restored"]

DCP = "dcp"
#: the formats in which a state_dict is chosen as ``convert`` chooses it
_SELECTABLE = (formats.TORCH_ZIP, formats.TORCH_LEGACY, DCP)
#: the formats read whole through their node graph when no state_dict is chosen
_GRAPHS = (formats.TORCH_ZIP, formats.TORCH_LEGACY, formats.TORCHSCRIPT)


@dataclass
class Probe:
    """One side of a diff: the checkpoint as opened (:class:`~ckptool.readers.Opened`, its format detected once),
    the ``root`` in which a state_dict is chosen (a torch file's pickle as a node graph, a DCP folder's
    ``planner_data`` nesting: :func:`~ckptool.readers.read_dcp.dcp_tree`), and a torch file's parsed pickle ``ck``
    (nothing imported or run); both None for the other formats."""

    opened: Opened
    root: Any = None
    ck: Checkpoint | None = None

    @property
    def path(self) -> str:
        """The path read: a set's ``*.index.json``, a model folder's single weights file, else the path given."""
        return self.opened.target

    @property
    def selectable(self) -> bool:
        """A torch.save file (zip or legacy) or a DCP folder: a state_dict can be chosen in it, as ``convert``
        does."""
        return self.root is not None and self.opened.format in _SELECTABLE


def probe(path: str | Opened) -> Probe:
    """``path`` opened (:func:`ckptool.readers.open_checkpoint`) and, for a torch file, its pickle read as a node
    graph; for a DCP folder its ``.metadata``'s nesting.

    Raises:
        UsageError / NotACheckpointError / CorruptCheckpointError: as :func:`ckptool.readers.open_checkpoint` and
            :func:`ckptool.formats.torchfile.read_checkpoint` raise (a plain pickle: not a torch.save checkpoint).
    """
    o = path if isinstance(path, Opened) else open_checkpoint(path)
    if o.format == DCP:
        return Probe(o, dcp_tree(o.dcp_metadata()))
    if o.format in _GRAPHS:
        ck = o.graph()
    elif o.spec.tensors:
        return Probe(o)
    else:  # a plain pickle: refused as today, with the torch.save reader's message
        ck = read_checkpoint(o.target, o.format)
    return Probe(o, ck.root, ck)


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
    """True when ``key`` names a mapping or a pickled module in the torch file or DCP folder ``p``, or a
    state_dict of the torch.package archive ``p`` (``<member>:<path>``: :mod:`ckptool.readers.read_package`)."""
    if p.opened.format == formats.TORCH_PACKAGE:
        try:
            p.opened.state_dict(key)
        except UsageError:
            return False
        return True
    if not p.selectable:
        return False
    try:
        trail = resolve_path(p.root, key)
    except KeyError:
        return False
    obj = trail[-1].child if trail else p.root
    return is_module(obj) or mapping_items(obj) is not None


def _listing(p: Probe) -> str:
    if p.opened.format == formats.TORCH_PACKAGE:
        return f"state_dicts in {p.path}: {', '.join(e.path for e in p.opened.state_dicts()) or 'none'}"
    if not p.selectable:
        return f"{p.path} is {p.opened.format}: --key does not apply to it"
    found = ", ".join(sd.path or "(top level)" for sd in find_state_dicts(p.root)) or "none"
    return f"state_dicts in {p.path}: {found}"


def choose_keys(a: Probe, b: Probe, key: str | None) -> tuple[str | None, str | None]:
    """``(key in A, key in B)``: the dotted path of the state_dict to compare on each side, None to compare the
    side whole (any side that is not a torch.save file or a DCP folder, and one whose state_dict is the top
    level).

    With ``key``: that path on each torch or DCP side where it resolves; a side where it does not is then
    compared through its automatically chosen state_dict. Without: a side's automatically chosen state_dict
    (``convert``'s choice) when the other side is a bare state_dict, or when both sides are training checkpoints
    whose state_dicts sit at different paths; otherwise both sides whole.

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
@dataclass(eq=False)
class SideTensor:
    """One tensor of a side. ``dtype``, ``shape``, ``stride`` (None: the format records none, so the tensor is
    contiguous), ``device`` (None: the format records none, so the tensor opens on the CPU) as the file declares
    them; ``group`` identifies its storage (tensors sharing one share it). Its
    elements are read from ``path``: the view ``(offset, shape, read_stride)`` of the storage whose element 0 is at
    byte ``base``, holding ``limit`` elements; ``path`` None when the data cannot be read (``unread`` says why)."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None
    device: str | None
    group: object
    path: str | None = None
    base: int = 0
    offset: int = 0
    read_stride: tuple[int, ...] = ()
    limit: int = 0
    unread: str = ""
    #: the element size whose bytes are reversed as they are read (a big-endian file), 0 for none
    swap: int = 0
    #: a storage gathered from byte ranges of several files (a DeepSpeed ZeRO parameter, widened 16-bit floats):
    #: its bytes are read through it (``base`` 0) instead of from ``path``
    gathered: Storage | None = None


@dataclass
class Side:
    """One side of a diff as read: its ``path`` and ``format``, tensors and plain values by key, ``notes``."""

    path: str
    format: str
    tensors: dict[str, SideTensor]
    values: dict[str, object]
    notes: list[str] = field(default_factory=list)


def _read_side(p: Probe, key: str | None) -> Side:
    """The tensors (and a torch file's plain values) of side ``p``: with ``key``, the state_dict at that path as
    ``convert`` reads it (:meth:`~ckptool.readers.Opened.state_dict`); without, the side whole."""
    o = p.opened
    if o.format == DCP:  # every tensor by its fully qualified name, or the state_dict at key
        return _source_side(o.state_dict("" if key is None else key))
    if p.ck is None:  # safetensors, sharded sets, .pt2, DeepSpeed: one mapping of tensors; a package's state_dict
        src = o.state_dict(key if o.format == formats.TORCH_PACKAGE else None)  # a package: its <member>:<path>
        return _source_side(restored(src) if o.format in _ALIASED else src)
    try:
        if key is not None:
            return _source_side(o.state_dict(key))
        return _torch_side(p.path, p.ck)
    except RecursionError as e:
        raise CorruptCheckpointError(f"{p.path}: {too_deep(e)}") from None


#: the formats whose files may carry the tied names ``safetensors.torch.save_model`` dropped
_ALIASED = (formats.SAFETENSORS, "sharded-safetensors", "sharded-bin")


def restored(src: Source) -> Source:
    """``src`` with the tied names ``safetensors.torch.save_model`` dropped given back."""
    restore_library_aliases(src)
    return src


def _torch_side(path: str, ck: Checkpoint) -> Side:
    info = describe(ck)
    records = {r.name: r for r in ck.records}
    if ck.format != formats.TORCH_LEGACY:
        with source.open_binary(path) as f:
            resolve_zip_offsets(ck, f)
    tensors: dict[str, SideTensor] = {}
    for t in info.tensors:
        folder = "constants/" if t.key.startswith("constants.") and ck.extra_roots else "data/"
        ref = ck.storages.get(t.storage_key) if t.storage_key is not None else None
        entry = SideTensor(t.dtype, tuple(t.shape), tuple(t.stride), t.device, (path, t.storage_key), path,
                        offset=t.storage_offset, read_stride=tuple(t.stride))
        rec = records.get(folder + t.storage_key) if t.storage_key is not None else None
        if ref is None or rec is None:
            entry.path, entry.unread = None, "no storage"
        elif rec.zipinfo is not None and rec.zipinfo.method != 0:
            entry.path, entry.unread = None, f"record {rec.name} is compressed"
        else:
            entry.base = rec.offset
            entry.limit = storage_nbytes(ref) // element_size(t.dtype)
            entry.swap = ck.byteswap_size(ref)
        tensors[t.key] = entry
    values = dict(iter_values(ck.root))
    for name, extra in ck.extra_roots.items():
        values.update((f"{name}.{k}", v) for k, v in iter_values(extra))
    return Side(path, ck.format, tensors, values)


def _source_side(src: Source) -> Side:
    """A side read as a :class:`Source` (:meth:`~ckptool.readers.Opened.state_dict`), without plain values but a
    DCP folder's non-tensor entries, compared by name (:data:`UNREAD`). What each tensor's file can store
    (:func:`_stores`) decides which of its properties are recorded: a torch shard has location tags and strides;
    safetensors has neither (every tensor is stored contiguous, except the views ckptool's sharing record gives
    back), a ``.pt2`` archive strides only, a DCP folder neither (it loads into the caller's tensors)."""
    tensors: dict[str, SideTensor] = {}
    kinds: dict[str, str] = {}
    for t in src.tensors:
        path = t.storage.path
        if path not in kinds:
            kinds[path] = DCP if src.format == DCP else formats.detect_format(path)
        tensors[t.name] = _source_tensor(t, kinds[path])
    side = Side(src.path, src.format, tensors, {})
    side.notes += src.notes
    skipped = src.skipped
    if src.format == DCP:
        suffix = ": " + NON_TENSOR
        names = [s[:-len(suffix)] for s in skipped if s.endswith(suffix)]
        if names:
            side.notes.append(f"{src.path}: non-tensor entries of a DCP folder are compared by name only")
            side.values.update((k, UNREAD) for k in names)
        skipped = [s for s in skipped if not s.endswith(suffix)]
    if src.left_out or skipped:
        left = src.left_out + skipped
        side.notes.append(f"{src.path}: not compared: {'; '.join(left[:8])}{' ...' if len(left) > 8 else ''}")
    return side


def _stores(fmt: str) -> tuple[bool, bool]:
    """``(location tags, strides)``: which of the two the files of format ``fmt`` record (torch.save files and
    torch.package archives both, ``.pt2`` archives strides, safetensors neither)."""
    torch_file = fmt in (formats.TORCH_ZIP, formats.TORCH_LEGACY, formats.TORCH_PACKAGE)
    return torch_file, torch_file or fmt == formats.PT2


def _source_tensor(t: Tensor, fmt: str) -> SideTensor:
    st = t.storage
    es = element_size(t.dtype)
    has_location, has_stride = _stores(fmt)
    # safetensors: a contiguous layout is the format's own; only the views of a sharing record carry a stride. DCP
    # loads into the caller's tensors (dcp_to_torch_save: contiguous ones), whatever view a record holds
    stride = t.stride if has_stride or (fmt != DCP and t.stride != contiguous_stride(t.shape)) else None
    out = SideTensor(t.dtype, t.shape, stride, st.location if has_location else None, st, st.path, st.offset, t.offset,
                  t.stride, st.nbytes // es)
    if st.segments is not None:  # one byte-swapped range (a big-endian torch shard) is read here; others are not
        seg = st.segments[0]
        if len(st.segments) == 1 and seg.widen is None and seg.nbytes == st.nbytes:
            out.path, out.base, out.swap = seg.path, seg.offset, seg.swap
        else:  # gathered from several files (DeepSpeed ZeRO partitions), or widened: read through its segments
            out.gathered, out.base = st, 0
        return out
    if st.pieces is None:
        return out
    lo, hi = t.span
    for p in st.pieces:  # a sharing group stored as pieces: read the view from a piece that holds it
        if (p.offset, p.shape, p.stride) == (t.offset, t.shape, t.stride):
            out.base, out.offset, out.read_stride, out.limit = p.file_offset, 0, contiguous_stride(t.shape), numel(
                t.shape)
            return out
        if is_contiguous(p.shape, p.stride) and p.offset <= lo and hi <= p.offset + numel(p.shape):
            out.base, out.limit = p.file_offset - p.offset * es, p.offset + numel(p.shape)
            return out
    out.path, out.unread = None, "a view of a shared storage that no stored tensor holds"
    return out


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
