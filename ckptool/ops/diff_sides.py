"""Reading each side of ``ckptool diff``, and which part of it is compared: the whole file, or the state_dict
``convert`` picks.

Each side's format is detected once (:func:`probe`): a torch zip or legacy file is read through
:func:`ckptool.formats.torchfile.read_checkpoint` and :func:`ckptool.ops.inspect.describe` (every tensor, with its
storage, layout and saved location tag) plus its plain values; a safetensors file, a sharded set, a ``.pt2``
archive, a DeepSpeed ZeRO folder (its consolidated fp32 state_dict) and a selected state_dict of a torch file
through ``convert``'s readers (its :class:`~ckptool.readers.tensors.Source`); a DCP folder from its
``.metadata`` (names, dtypes and shapes only).

A training checkpoint (``{"epoch": 1, "model_state_dict": ..., "optimizer_state_dict": ...}``) compared with a bare
state_dict (safetensors, a sharded set, a DCP folder, a ``.pt2`` archive, a DeepSpeed folder, a torch file whose
state_dict is the top level) is compared through the state_dict that ``convert`` would convert from it
(:func:`ckptool.readers.read_torch.select_state_dict`, the same choice); two torch files whose state_dicts sit
at the same place are compared whole, as they are. ``key`` (``--key``) selects that state_dict on every torch side
where it resolves (:func:`ckptool.model.paths.resolve_path`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats import detect as formats
from ckptool.formats.deepspeed import is_deepspeed_folder
from ckptool.formats.dtypes import contiguous_stride, element_size, numel, storage_nbytes
from ckptool.formats.sharded import is_checkpoint_set, set_kind
from ckptool.formats.torchfile import Checkpoint, read_checkpoint, resolve_zip_offsets
from ckptool.model.graph import find_state_dicts, is_module, mapping_items, too_deep
from ckptool.model.paths import resolve_path
from ckptool.model.values import iter_values
from ckptool.model.zero import read_zero
from ckptool.ops.inspect import describe, inspect_set
from ckptool.readers.read_deepspeed import deepspeed_source
from ckptool.readers.read_pt2 import pt2_source
from ckptool.readers.read_safetensors import index_source, restore_library_aliases, safetensors_source
from ckptool.readers.read_torch import select_state_dict, torch_source
from ckptool.readers.tensors import Source, Storage, Tensor, is_contiguous

__all__ = ["UNREAD", "Probe", "Side", "SideTensor", "choose_keys", "probe", "read_pair", "restored"]

#: the kinds of side :func:`probe` tells apart (``torch``: a torch zip, legacy or TorchScript file)
DEEPSPEED, INDEX, DCP, SAFETENSORS, PT2, TORCH = "deepspeed", "index", "dcp", "safetensors", "pt2", "torch"


@dataclass
class Probe:
    """One side of a diff, its format detected once: ``path`` (a set's file or index once resolved), ``kind`` (one
    of the constants above), ``fmt`` (:mod:`ckptool.formats.detect`'s name for a torch file) and, for a torch file,
    its parsed pickle ``ck`` (nothing imported or run)."""

    path: str
    kind: str
    fmt: str = ""
    ck: Checkpoint | None = None

    @property
    def selectable(self) -> bool:
        """A torch.save file (zip or legacy): a state_dict can be chosen in it, as ``convert`` does."""
        return self.ck is not None and self.fmt in (formats.TORCH_ZIP, formats.TORCH_LEGACY)


def probe(path: str) -> Probe:
    """What ``path`` is, detected once, in the order ``convert`` tries them (a DeepSpeed folder first, then a
    checkpoint set, then the file's format); a torch file's pickle is read (:func:`read_checkpoint`).

    Raises:
        UsageError / NotACheckpointError / CorruptCheckpointError: as :func:`ckptool.formats.sharded.set_kind`,
            :func:`ckptool.formats.detect.detect_format` and :func:`read_checkpoint` raise.
    """
    if is_deepspeed_folder(path):
        return Probe(path, DEEPSPEED)
    if is_checkpoint_set(path):
        kind, set_path = set_kind(path)
        if kind == "file":
            return probe(set_path)
        return Probe(set_path, INDEX if kind == "index" else DCP)
    fmt = formats.detect_format(path)
    if fmt == formats.SAFETENSORS:
        return Probe(path, SAFETENSORS, fmt)
    if fmt == formats.PT2:
        return Probe(path, PT2, fmt)
    return Probe(path, TORCH, fmt, read_checkpoint(path, fmt))


def _auto(p: Probe) -> str | None:
    """The dotted path of the state_dict ``convert`` picks in ``p`` (``""``: the top level), None when ``p`` is no
    torch.save file or holds no single likely state_dict."""
    if not p.selectable:
        return None
    assert p.ck is not None
    try:
        return select_state_dict(p.ck.root, None, p.path).path
    except (UsageError, UnsupportedError):
        return None


def _resolves(p: Probe, key: str) -> bool:
    """True when ``key`` names a mapping or a pickled module in the torch file ``p``."""
    if not p.selectable:
        return False
    assert p.ck is not None
    try:
        trail = resolve_path(p.ck.root, key)
    except KeyError:
        return False
    obj = trail[-1].child if trail else p.ck.root
    return is_module(obj) or mapping_items(obj) is not None


def _listing(p: Probe) -> str:
    if not p.selectable:
        return f"{p.path} is {p.kind}: --key does not apply to it"
    assert p.ck is not None
    found = ", ".join(sd.path or "(top level)" for sd in find_state_dicts(p.ck.root)) or "none"
    return f"state_dicts in {p.path}: {found}"


def choose_keys(a: Probe, b: Probe, key: str | None) -> tuple[str | None, str | None]:
    """``(key in A, key in B)``: the dotted path of the state_dict to compare on each side, None to compare the
    side whole (any side that is not a torch.save file, and a torch file whose state_dict is the top level).

    With ``key``: that path on each torch side where it resolves; a torch side where it does not is then
    compared through its automatically chosen state_dict. Without: a torch side's automatically chosen state_dict
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
    bare_a = a.ck is None or auto_a == ""
    bare_b = b.ck is None or auto_b == ""
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
    """The tensors (and a torch file's plain values) of side ``p``: with ``key``, the state_dict at that path of a
    torch file as ``convert`` reads it (:func:`ckptool.readers.read_torch.torch_source`)."""
    if p.kind == DEEPSPEED:  # the consolidated fp32 state_dict, as convert reads it (zero_to_fp32's)
        return _source_side(deepspeed_source(read_zero(p.path, None)))
    if p.kind == INDEX:
        return _source_side(restored(index_source(p.path)))
    if p.kind == DCP:
        return _dcp_side(p.path)
    if p.kind == SAFETENSORS:
        return _source_side(restored(safetensors_source(p.path)))
    if p.kind == PT2:  # a torch.export archive: its state_dict (ckptool.readers.read_pt2)
        return _source_side(pt2_source(p.path, None))
    assert p.ck is not None
    try:
        if key is not None:
            return _source_side(torch_source(p.path, p.fmt, key))
        return _torch_side(p.path, p.ck)
    except RecursionError as e:
        raise CorruptCheckpointError(f"{p.path}: {too_deep(e)}") from None


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
    """A safetensors file, a ``.pt2`` archive or a sharded set read by ``convert``'s readers, without plain
    values. What each tensor's file can store (:func:`_stores`) decides which of its properties are recorded: a
    torch shard has location tags and strides; safetensors has neither (every tensor is stored contiguous, except
    the views ckptool's sharing record gives back), a ``.pt2`` archive strides only."""
    tensors: dict[str, SideTensor] = {}
    kinds: dict[str, str] = {}
    for t in src.tensors:
        path = t.storage.path
        if path not in kinds:
            kinds[path] = formats.detect_format(path)
        tensors[t.name] = _source_tensor(t, kinds[path])
    side = Side(src.path, src.format, tensors, {})
    side.notes += src.notes
    if src.left_out or src.skipped:
        left = src.left_out + src.skipped
        side.notes.append(f"{src.path}: not compared: {'; '.join(left[:8])}{' ...' if len(left) > 8 else ''}")
    return side


def _stores(fmt: str) -> tuple[bool, bool]:
    """``(location tags, strides)``: which of the two the files of format ``fmt`` record (torch.save files both,
    ``.pt2`` archives strides, safetensors neither)."""
    torch_file = fmt in (formats.TORCH_ZIP, formats.TORCH_LEGACY)
    return torch_file, torch_file or fmt == formats.PT2


def _source_tensor(t: Tensor, fmt: str) -> SideTensor:
    st = t.storage
    es = element_size(t.dtype)
    has_location, has_stride = _stores(fmt)
    # safetensors: a contiguous layout is the format's own; only the views of a sharing record carry a stride
    stride = t.stride if has_stride or t.stride != contiguous_stride(t.shape) else None
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


def _dcp_side(folder: str) -> Side:
    info = inspect_set(folder)
    tensors = {t.key: SideTensor(t.dtype, tuple(t.shape), None, None, t.key, unread="DCP tensor data is not read")
               for t in info.tensors}
    non_tensor = (info.metadata or {}).get("non_tensor_entries", "")
    side = Side(folder, info.format, tensors, {})
    if non_tensor:
        side.notes.append(f"{folder}: non-tensor entries of a DCP folder are compared by name only")
        for k in non_tensor.split(", "):
            side.values[k] = UNREAD
    return side


class _Unread:
    """A plain value whose data was not read (a DCP folder's non-tensor entry): compared by name only."""

    def __repr__(self) -> str:
        return "<not read>"


UNREAD = _Unread()


def read_pair(a: str, b: str, key: str | None) -> tuple[Side, Side, str | None, str | None]:
    """Both sides of a diff, each read once its format is detected (:func:`probe`) and the part to compare chosen
    (:func:`choose_keys`): ``(side A, side B, key in A, key in B)``.

    Raises:
        UsageError: see :func:`choose_keys`; CorruptCheckpointError: a pickle nested too deep; and what the
            readers raise (:func:`probe`, ``convert``'s readers).
    """
    where = a
    try:
        pa = probe(a)
        where = b
        pb = probe(b)
        where = f"{a} or {b}"
        key_a, key_b = choose_keys(pa, pb, key)
    except RecursionError as e:
        raise CorruptCheckpointError(f"{where}: {too_deep(e)}") from None
    return _read_side(pa, key_a), _read_side(pb, key_b), key_a, key_b
