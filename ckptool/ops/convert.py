"""``ckptool.convert``: move a state_dict between torch.save files, safetensors, sharded sets and DCP folders.

One pass from SRC to DST, memory bounded by the largest storage, not by the file:

* **torch -> safetensors.** The pickle is read as a node graph (:func:`ckptool.checkpoint.read_checkpoint`, nothing
  imported or run) and the state_dict is selected (``key``, or found automatically; what else the file held, such as
  optimizer state, is reported as not carried). Each tensor's bytes are read from its storage record (zip member or
  legacy data block) and written straight into the safetensors data block; only a tensor that needs a new layout
  (a non-contiguous view) or a ``dtype`` cast is materialised with torch, one storage at a time.
  The safetensors format (8-byte little-endian header length N, N bytes of JSON ``{name: {"dtype", "shape",
  "data_offsets"}, "__metadata__": {str: str}}`` padded with spaces to a multiple of 8, then the data block with no
  holes) is written here rather than with ``safetensors.torch.save_file``, which needs every tensor in memory at once;
  the result is re-opened with ``safetensors.safe_open`` to verify it.
* **Shared storages** (tied weights, views): safetensors holds no sharing, so each storage is stored once. A tensor
  that lies inside a stored contiguous tensor of the same storage is not stored again: it becomes an *alias*. The
  kept tensor is the first in state_dict order (the embedding before the head it is tied to), so
  ``safetensors.torch.load_model`` (which re-ties from the model side) and ckptool both restore the model. The
  layout of every shared storage is recorded in ``__metadata__["ckptool.shared"]`` (JSON, see
  :data:`SHARED_KEY`), and each exact alias also as ``__metadata__[alias] = kept name``, the convention of
  ``safetensors.torch.save_model``. Reading the file back with ckptool (``convert`` to torch) restores the aliases
  as views of one storage, with their original offsets, shapes and strides.
* **safetensors -> torch.** A zip checkpoint in the layout ``torch.save`` writes (:class:`ckptool.writer.
  TorchZipWriter`, records 64-byte aligned so ``torch.load(mmap=True)`` maps it) holding an ``OrderedDict``
  state_dict; ``torch.load(dst, weights_only=True)`` opens it. Storages are tagged ``cpu`` or ``to``.
* **dtype.** ``dtype`` casts floating tensors (float16, bfloat16, float32, float64); integer, bool, complex and
  float8 tensors are untouched. A cast is applied to a whole storage, so views keep their offsets and strides.
* **Sharded sets.** An ``*.index.json`` (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``, with a
  ``weight_map`` from tensor name to shard file) is read as one checkpoint. ``max_shard_size`` writes a folder of
  shards plus an index with the ``{"metadata": {"total_size": bytes}, "weight_map": {...}}`` layout that
  ``transformers`` and ``huggingface_hub`` read; tensors that share a storage stay in one shard.
* **DCP folders** (``torch.distributed.checkpoint``: ``.metadata`` plus ``__<rank>_<n>.distcp``) are converted with
  torch's own machinery: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` in, and
  ``torch.distributed.checkpoint.save`` out (``format_utils.torch_save_to_dcp`` would ``torch.load`` the source with
  ``weights_only=False``). DCP's ``FileSystemReader`` unpickles ``.metadata`` and non-tensor entries without
  restriction, so both are first read with ckptool's restricted unpickler and refused unless every global they name
  is one DCP itself writes (or the weights-only allowlist accepts), or ``trust=True``.
* **Verification** (on by default): the output is re-opened lazily by the format's own reader
  (``safetensors.safe_open``, ``torch.load(mmap=True, weights_only=True)`` plus the zip records' CRC-32) and every
  tensor's name, shape and dtype, and a CRC-32 of its bytes (per storage record for torch output), is compared with
  what was read from the source.

Importing this module does not import torch; the functions import it when they need it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import struct
import tempfile
import warnings
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptool.formats import detect as formats
from ckptool.formats.torchfile import (
    DTYPE_SIZES,
    STORAGE_TYPES,
    read_checkpoint,
    resolve_zip_offsets,
    storage_nbytes,
)
from ckptool.errors import (
    CkptError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedError,
    UsageError,
)
from ckptool.model.graph import (
    find_state_dicts,
    get_path,
    is_module,
    is_optimizer_state,
    is_state_dict,
    iter_state_dict_of_module,
    iter_tensors,
    join,
    mapping_items,
    module_state,
    unwrap_tensor,
)
from ckptool.model.keys import raise_on_collisions
from ckptool.formats.unpickler import (
    REBUILD_FROM_TYPE_V2,
    REBUILD_QTENSOR,
    GlobalMeta,
    ObjectNode,
    PickledObject,
    ReduceNode,
    RestrictedUnpickler,
    StorageRef,
    TensorNode,
    load_structure,
    qualified_name,
)
from ckptool._fileio import atomic_output
from ckptool.formats.torchzip import TorchZipWriter
from ckptool._fileio import copy_range as _copy_kernel
from ckptool._fileio import copy_range_crc as _copy_crc

__all__ = [
    "SHARED_KEY", "ConvertResult", "convert", "inspect_set", "is_checkpoint_set", "parse_size", "read_dcp_metadata",
]

#: ``__metadata__`` key holding the layout of shared storages (JSON; see :func:`_shared_metadata`)
SHARED_KEY = "ckptool.shared"

#: torch dtype name -> safetensors dtype code (safetensors format description; ``safetensors.torch._TYPES``)
ST_CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0", "complex64": "C64",
}
ST_NAMES: dict[str, str] = {v: k for k, v in ST_CODES.items()}

#: dtypes ``dtype=`` casts (floating point; float8 formats carry scales elsewhere and are left alone)
CAST_FROM = ("float16", "bfloat16", "float32", "float64")
CAST_TO = ("float16", "bfloat16", "float32", "float64")

#: dtype name -> legacy storage class ``torch.save`` names with ``_rebuild_tensor_v2`` (torch/storage.py); other
#: dtypes are written as ``_rebuild_tensor_v3`` over an ``UntypedStorage``, as torch does for uint16, float8...
_V2_STORAGE = {dt: cls for cls, (dt, _n) in STORAGE_TYPES.items() if not cls.startswith(("Q", "Untyped"))}

_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar", ".pkl")
_CHUNK = 8 << 20
_SHARD_NAMES = {"safetensors": ("model", ".safetensors"), "torch": ("pytorch_model", ".bin")}
_PROGRESS_MIN = 256 << 20  # show a progress bar from this many bytes (when stderr is a terminal)


# ================================================================================================ results
@dataclass
class ConvertResult:
    """What :func:`convert` did.

    ``dst`` is the file written, or the folder for sharded and DCP output; ``files`` lists every file written
    (shards, then the index). ``key`` is the dotted path of the state_dict converted (``""``: top level; None for
    safetensors, sharded and whole-object conversions). ``tensors`` counts the tensors of the output (aliases
    included), ``stored`` those whose bytes were written, ``bytes_written`` the output size in bytes.
    ``left_out`` describes the other entries of the source that were not carried (``"optimizer_state: optimizer
    state (12 tensors)"``); ``skipped`` the non-tensor entries of the selected state_dict, which safetensors cannot
    hold. ``aliases`` maps each tensor stored as a view of another to that tensor; ``made_contiguous`` lists tensors
    stored contiguous although their layout was not; ``trimmed_bytes`` counts storage bytes that no tensor reached
    (``torch.save`` of a slice keeps its whole storage). ``cast`` counts ``"float32->float16": tensors``.
    ``renamed`` counts renamed keys. ``verified`` is True after a passing verification (``checked`` says what was
    compared), None with ``verify=False``.
    """

    src: str
    dst: str
    format_in: str
    format_out: str
    key: str | None = None
    tensors: int = 0
    stored: int = 0
    bytes_written: int = 0
    files: list[str] = field(default_factory=list)
    shards: int = 1
    left_out: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    made_contiguous: list[str] = field(default_factory=list)
    trimmed_bytes: int = 0
    cast: dict[str, int] = field(default_factory=dict)
    renamed: int = 0
    notes: list[str] = field(default_factory=list)
    verified: bool | None = None
    checked: str = "names, shapes, dtypes and checksums"


# ================================================================================================ source model
@dataclass(eq=False)
class _Piece:
    """A stored tensor of a safetensors sharing group: its data at ``file_offset`` (``nbytes``) is the contiguous
    copy of the view ``(offset, shape, stride)`` (elements) of the group's storage."""

    file_offset: int
    nbytes: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(eq=False)
class _Storage:
    """The bytes of one source storage: ``nbytes`` at ``offset`` of file ``path`` (or, for a safetensors sharing
    group, assembled from ``pieces``), elements of ``dtype``, saved with location tag ``location``; ``crc`` is the
    CRC-32 of the bytes when the source records it (zip members)."""

    path: str
    offset: int
    nbytes: int
    dtype: str
    location: str = "cpu"
    crc: int | None = None
    pieces: list[_Piece] | None = None

    @property
    def numel(self) -> int:
        return self.nbytes // DTYPE_SIZES[self.dtype]


@dataclass(eq=False)
class _Tensor:
    """One tensor of the source: output key ``name`` (``src_name`` in the source), ``dtype``, ``shape``, ``stride``
    and storage ``offset`` in elements, its :class:`_Storage`, and ``index`` (position in the state_dict)."""

    name: str
    src_name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage: _Storage
    requires_grad: bool = False
    index: int = 0

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def span(self) -> tuple[int, int]:
        """``[lo, hi)``: the elements of the storage this tensor reaches (``lo == hi`` when empty)."""
        return _span(self.offset, self.shape, self.stride)


@dataclass
class _Source:
    """A source checkpoint read for conversion: its tensors in state_dict order plus what was not carried."""

    path: str
    format: str
    tensors: list[_Tensor]
    key: str | None = None
    left_out: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    metadata: dict[str, str] | None = None
    sd_state: Any = None  # the selected OrderedDict node's BUILD state (``_metadata``), for torch output
    notes: list[str] = field(default_factory=list)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _span(offset: int, shape: Sequence[int], stride: Sequence[int]) -> tuple[int, int]:
    if _numel(shape) == 0:
        return offset, offset
    return offset, offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def _is_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """torch's ``is_contiguous()`` for a strided layout: row-major strides, dimensions of size 1 ignored."""
    if _numel(shape) == 0:
        return True
    expected = 1
    for s, st in zip(reversed(shape), reversed(stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


def _elsize(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise UnsupportedError(f"dtype {dtype!r} is not supported by ckptool convert") from None


# ================================================================================================ sizes, formats
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"`` (10**9, as ``huggingface_hub``'s
    ``parse_size_to_int``), ``"2GiB"`` (2**30), ``"500MB"``, ``"1048576"``.

    Raises:
        UsageError: not a positive size.
    """
    if isinstance(size, int):
        n = size
    else:
        m = _SIZE_RE.match(str(size))
        if not m:
            raise UsageError(f"size {size!r}: give bytes or a number with a unit, e.g. 5GB, 500MB, 2GiB")
        num, unit = float(m.group(1)), (m.group(2) or "b").lower()
        base = 1024 if "i" in unit else 1000
        power = {"b": 0, "k": 1, "m": 2, "g": 3, "t": 4}[unit[0]]
        n = int(num * base ** power)
    if n <= 0:
        raise UsageError(f"size {size!r} must be positive")
    return n


def is_checkpoint_set(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a sharded index (``*.index.json``) or a folder (a DCP checkpoint, or a model folder
    holding one index): the inputs :func:`inspect_set` and :func:`convert` read as one checkpoint."""
    p = os.fspath(path)
    return p.endswith(".index.json") or os.path.isdir(p)


def _set_kind(path: str) -> tuple[str, str]:
    """``("index", index path)``, ``("dcp", folder)``, or ``("file", path)`` for a model folder holding only
    ``model.safetensors`` or ``pytorch_model.bin``.

    Raises:
        UsageError: a folder that is neither a DCP checkpoint nor holds exactly one ``*.index.json``.
    """
    if path.endswith(".index.json"):
        if not os.path.isfile(path):
            raise UsageError(f"{path}: no such file; check the path")
        return "index", path
    if os.path.isfile(os.path.join(path, ".metadata")):
        return "dcp", path
    indexes = sorted(n for n in os.listdir(path) if n.endswith(".index.json"))
    if len(indexes) == 1:
        return "index", os.path.join(path, indexes[0])
    if indexes:
        raise UsageError(f"{path} holds several sharded indexes ({', '.join(indexes)}); pass one of them")
    singles = sorted(n for n in os.listdir(path) if n in ("model.safetensors", "pytorch_model.bin"))
    if len(singles) == 1:  # a model folder whose weights fit one file (save_pretrained writes no index then)
        return "file", os.path.join(path, singles[0])
    raise UsageError(
        f"{path} is a folder but neither a torch.distributed.checkpoint folder (no .metadata) nor a sharded "
        "checkpoint (no *.index.json, model.safetensors or pytorch_model.bin); pass the checkpoint file")


# ================================================================================================ reading torch
def _node_dtype(t: TensorNode) -> str:
    from ckptool.ops.inspect import tensor_dtype

    return tensor_dtype(t)


def _describe(v: Any) -> str:
    """A short description of a graph value for the ``left_out`` report."""
    t = unwrap_tensor(v)
    if t is not None:
        return f"tensor {'x'.join(map(str, t.shape)) or 'scalar'} {_node_dtype(t)}"
    if is_module(v):
        st = module_state(v)
        cls = v.global_name if isinstance(v, ObjectNode) else "module"
        n = sum(1 for _ in iter_state_dict_of_module(v)) if st is not None else 0
        return f"pickled nn.Module {cls} ({n} tensors)"
    items = mapping_items(v)
    if items is not None:
        n = sum(1 for _ in iter_tensors(v))
        if is_optimizer_state(items):
            return f"optimizer state ({n} tensors)"
        if is_state_dict(v):
            return f"state_dict ({n} tensors)"
        return f"mapping of {len(items)} entries" + (f", {n} tensors" if n else "")
    if isinstance(v, (list, tuple)):
        n = sum(1 for _ in iter_tensors(v))
        return f"{type(v).__name__} of {len(v)} items" + (f", {n} tensors" if n else "")
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        r = repr(v)
        return f"{type(v).__name__} {r if len(r) <= 40 else r[:37] + '...'}"
    if isinstance(v, (ReduceNode, ObjectNode)):
        return f"{v.global_name or 'object'} object"
    return type(v).__name__


def _left_out(root: Any, path: str) -> list[str]:
    """``"name: description"`` for every entry beside the one at dotted ``path``, at each level down to it."""
    out: list[str] = []
    node, prefix = root, ""
    for comp in path.split(".") if path else []:
        items = mapping_items(node)
        if items is None and isinstance(node, (list, tuple)):
            items = list(enumerate(node))
        if items is None:
            break
        nxt = None
        for k, v in items:
            if str(k) == comp and nxt is None:
                nxt = v
            else:
                out.append(f"{join(prefix, k)}: {_describe(v)}")
        if nxt is None:
            break
        node, prefix = nxt, join(prefix, comp)
    return out


def _state_dict_names() -> tuple[str, ...]:
    from ckptool.torch_ops.loading import STATE_DICT_NAMES  # no torch import at module level

    return STATE_DICT_NAMES


def _select_state_dict(root: Any, key: str | None, where: str) -> tuple[str, Any, bool]:
    """``(dotted path, container, is_module)`` of the state_dict to convert.

    Without ``key``: the only state_dict found, or among several the one whose name ranks first in
    :data:`ckptool.loading.STATE_DICT_NAMES` (``state_dict`` before ``ema``); ties are refused.

    Raises:
        UsageError: ``key`` names no entry or not a mapping / module; several equally likely state_dicts.
        UnsupportedError: no state_dict at all.
    """
    found = find_state_dicts(root)
    listing = ", ".join(f"{sd.path or '(top level)'} ({len(sd.keys())} tensors)" for sd in found) or "none"
    if key is not None:
        try:
            obj = get_path(root, key)
        except KeyError:
            raise UsageError(f"{where}: no entry {key!r} (--key); state_dicts found: {listing}") from None
        if is_module(obj):
            return key, obj, True
        if mapping_items(obj) is None:
            raise UsageError(f"{where}: --key {key!r} selects a {_describe(obj)}, not a state_dict; "
                             f"state_dicts found: {listing}")
        return key, obj, False
    if not found:
        raise UnsupportedError(
            f"{where}: no state_dict found (a mapping of parameter names to tensors, or a pickled nn.Module); "
            "pass --key PATH (key=...) to select the mapping to convert")
    if len(found) == 1:
        return found[0].path, found[0].obj, found[0].is_module
    names = _state_dict_names()

    def rank(sd: Any) -> tuple[int, int]:
        last = sd.path.rsplit(".", 1)[-1]
        return (names.index(last) if last in names else len(names), sd.path.count("."))

    ranked = sorted(found, key=rank)
    if rank(ranked[0]) == rank(ranked[1]) or rank(ranked[0])[0] == len(names):
        raise UsageError(f"{where} holds several state_dicts: {listing}; choose one with --key PATH (key=...)")
    best = ranked[0]
    return best.path, best.obj, best.is_module


def _check_tensor_node(t: TensorNode, name: str, where: str) -> None:
    if t.rebuild_name == REBUILD_QTENSOR:
        raise UnsupportedError(
            f"{where}: {name!r} is a quantized tensor (torch._utils._rebuild_qtensor): its scales and zero points "
            "do not fit safetensors or a plain state_dict; dequantize it (tensor.dequantize()) and save again")
    if t.storage is None:
        raise UnsupportedError(f"{where}: {name!r} is a tensor without a storage; it cannot be converted")


def _torch_source(path: str, fmt: str, key: str | None) -> _Source:
    """Read a torch zip or legacy file's selected state_dict as a :class:`_Source` (no tensor bytes read).

    Raises:
        UsageError / UnsupportedError: see :func:`_select_state_dict`; quantized tensors, compressed records,
            tensors of different dtypes on one storage, TorchScript archives.
        CorruptCheckpointError: a storage record is missing, too short, or a view runs past its storage.
    """
    if fmt == formats.TORCHSCRIPT:
        raise UnsupportedError(
            f"{path} is a TorchScript archive, not a torch.save checkpoint; load it with torch.jit.load(path, "
            "map_location='cpu'), save model.state_dict() with torch.save, then convert that file")
    ck = read_checkpoint(path, fmt)
    sel_path, obj, is_mod = _select_state_dict(ck.root, key, path)
    src = _Source(path, ck.format, [], key=sel_path, left_out=_left_out(ck.root, sel_path))
    entries: list[tuple[str, TensorNode, bool]] = []
    if is_mod:
        entries = [(k, t, False) for k, t, _is_param in iter_state_dict_of_module(obj)]
        src.notes.append("the source is a pickled nn.Module: its state_dict (parameters and persistent buffers) "
                         "was converted; the module's class and code are not part of the output")
    else:
        for k, v in mapping_items(obj) or []:
            t = unwrap_tensor(v)
            if t is None or not isinstance(k, str):
                src.skipped.append(f"{k}: {_describe(v)}" if isinstance(k, str) else f"{k!r} (not a string key)")
                continue
            rg = bool(v.args[1]) if t is not v and len(v.args) > 1 and isinstance(v.args[1], bool) else t.requires_grad
            entries.append((k, t, rg))
        if isinstance(obj, PickledObject) and type(obj.state) is dict:
            src.sd_state = obj.state
    records = {r.name: r for r in ck.records}
    if ck.format != formats.TORCH_LEGACY:
        with open(path, "rb") as f:
            resolve_zip_offsets(ck, f)
    storages: dict[str, _Storage] = {}
    subclass = 0
    for i, (name, t, rg) in enumerate(entries):
        _check_tensor_node(t, name, path)
        if t.func.module == REBUILD_FROM_TYPE_V2[0] and t.func.name == REBUILD_FROM_TYPE_V2[1]:
            subclass += 1
        ref: StorageRef = t.storage  # type: ignore[assignment]
        dtype = _node_dtype(t)
        st = storages.get(ref.key)
        if st is None:
            rec = records.get("data/" + ref.key)
            if rec is None:
                raise CorruptCheckpointError(f"{path}: storage {ref.key!r} of {name!r} has no data record; "
                                             "the file is damaged, re-download or re-save it")
            if rec.zipinfo is not None and rec.zipinfo.method != 0:
                raise UnsupportedError(f"{path}: record data/{ref.key} is compressed; torch never writes that. "
                                       f"Re-save the file with torch.save (or `ckptool remap {path} --to cpu`) first")
            nbytes = storage_nbytes(ref)
            if rec.size != nbytes:
                raise CorruptCheckpointError(
                    f"{path}: storage {ref.key!r} declares {nbytes} bytes but its record holds {rec.size}; the file "
                    "is damaged, re-download or re-save it")
            st = storages[ref.key] = _Storage(path, rec.offset, nbytes, dtype, ref.location, rec.crc)
            if nbytes % _elsize(dtype):
                raise CorruptCheckpointError(f"{path}: storage {ref.key!r} ({nbytes} bytes) is not a whole number "
                                             f"of {dtype} elements; the file is damaged")
        elif st.dtype != dtype:
            raise UnsupportedError(f"{path}: {name!r} views storage {ref.key!r} as {dtype} while another tensor views "
                                   f"it as {st.dtype}; such a checkpoint cannot be converted")
        shape, stride = tuple(t.shape), tuple(t.stride)
        if len(stride) != len(shape) or any(s < 0 for s in stride):
            raise UnsupportedError(f"{path}: {name!r} has an unsupported layout (shape {shape}, stride {stride})")
        tensor = _Tensor(name, name, dtype, shape, stride, t.storage_offset, st, rg, i)
        lo, hi = tensor.span
        if hi > st.numel or lo < 0:
            raise CorruptCheckpointError(f"{path}: {name!r} reaches element {hi} of a storage of {st.numel}; the "
                                         "file is damaged")
        src.tensors.append(tensor)
    if subclass:
        src.notes.append(f"{subclass} tensor subclass instance(s) (torch._tensor._rebuild_from_type_v2) were "
                         "converted as plain tensors")
    return src


# ================================================================================================ reading safetensors
def _safetensors_header(path: str) -> tuple[dict[str, Any], dict[str, str] | None, int]:
    """``(tensor entries, __metadata__, data start offset)`` of a safetensors file.

    Raises:
        CorruptCheckpointError: as :func:`ckptool.inspect.read_safetensors_header`.
    """
    from ckptool.ops.inspect import read_safetensors_header

    header = read_safetensors_header(path)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CorruptCheckpointError(f"{path}: safetensors __metadata__ is not a mapping of strings; the file is damaged")
    return header, meta, 8 + n


def _safetensors_source(path: str) -> _Source:
    """Read a safetensors file as a :class:`_Source`: one storage per stored tensor, and for the sharing groups
    recorded under :data:`SHARED_KEY` one storage per group with every member (aliases included) a view of it.

    Raises:
        UnsupportedError: a dtype code ckptool does not know (``F4``...).
        CorruptCheckpointError: a malformed header, an entry whose byte size does not match its shape, or an
            inconsistent sharing record.
    """
    header, meta, start = _safetensors_header(path)
    src = _Source(path, formats.SAFETENSORS, [], key=None, metadata=meta)
    by_name: dict[str, _Tensor] = {}
    for i, (name, e) in enumerate(header.items()):
        dtype = ST_NAMES.get(e["dtype"])
        if dtype is None:
            raise UnsupportedError(f"{path}: tensor {name!r} has safetensors dtype {e['dtype']!r}, which ckptool "
                                   "cannot convert")
        shape = tuple(e["shape"])
        b, end = e["data_offsets"]
        if end - b != _numel(shape) * _elsize(dtype):
            raise CorruptCheckpointError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) needs "
                                         f"{_numel(shape) * _elsize(dtype)} bytes but its data_offsets span {end - b}; "
                                         "the file is damaged")
        st = _Storage(path, start + b, end - b, dtype, "cpu")
        t = _Tensor(name, name, dtype, shape, _contiguous_stride(shape), 0, st, False, i)
        by_name[name] = t
        src.tensors.append(t)
    raw = (meta or {}).get(SHARED_KEY)
    members = _restore_groups(src, by_name, raw, path) if raw is not None else set()
    if meta:  # carried to safetensors output, less what ckptool writes anew there
        src.metadata = {k: v for k, v in meta.items() if k != SHARED_KEY and k not in members}
    return src


def _restore_groups(src: _Source, by_name: dict[str, _Tensor], raw: str, path: str) -> set[str]:
    """Rebuild the storages recorded under :data:`SHARED_KEY` (see :func:`_shared_metadata`), in place; returns the
    names of every group member."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: the {SHARED_KEY} metadata is inconsistent ({why}); the file was "
                                      "edited or damaged. Remove that metadata entry to read the stored tensors alone")

    try:
        doc = json.loads(raw)
        groups = doc["groups"]
        if doc.get("version") != 1 or not isinstance(groups, list):
            raise bad("unknown version")
    except (ValueError, KeyError, TypeError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None
    aliases: list[tuple[int, _Tensor]] = []
    names: set[str] = set()
    for g in groups:
        try:
            dtype, numel, members = g["dtype"], int(g["numel"]), g["tensors"]
            esize = _elsize(dtype)
            parsed = {n: (int(m[0]), int(m[1]), tuple(int(x) for x in m[2]), tuple(int(x) for x in m[3]))
                      for n, m in members.items()}
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise bad(f"{type(e).__name__}: {e}") from None
        names.update(parsed)
        pieces = []
        for name, (_idx, off, shape, stride) in parsed.items():
            lo, hi = _span(off, shape, stride)
            if lo < 0 or hi > numel or len(shape) != len(stride):
                raise bad(f"{name!r} runs past its storage")
            t = by_name.get(name)
            if t is not None:
                if t.dtype != dtype or t.shape != shape:
                    raise bad(f"{name!r} is stored as {t.dtype} {list(t.shape)}")
                pieces.append(_Piece(t.storage.offset, t.storage.nbytes, off, shape, stride))
        if not pieces:
            raise bad("a group without a stored tensor")
        p0 = pieces[0]
        if len(pieces) == 1 and p0.offset == 0 and p0.nbytes == numel * esize and _is_contiguous(p0.shape, p0.stride):
            storage = _Storage(path, p0.file_offset, p0.nbytes, dtype, "cpu")  # the common case: one stored tensor
        else:
            storage = _Storage(path, -1, numel * esize, dtype, "cpu", pieces=pieces)
        for name, (idx, off, shape, stride) in parsed.items():
            t = by_name.get(name)
            if t is None:
                t = _Tensor(name, name, dtype, shape, stride, off, storage)
                aliases.append((idx, t))
            else:
                t.shape, t.stride, t.offset, t.storage = shape, stride, off, storage
    for idx, t in sorted(aliases, key=lambda a: a[0]):  # back at their places in the state_dict order
        src.tensors.insert(min(max(idx, 0), len(src.tensors)), t)
    for i, t in enumerate(src.tensors):
        t.index = i
    return names


# ================================================================================================ index (sharded)
def _index_source(index_path: str) -> _Source:
    """Read a sharded set through its ``*.index.json``: every shard's tensors, shard by shard in ``weight_map`` order.

    Raises:
        CorruptCheckpointError: the index is not JSON or has no ``weight_map``; a shard lacks a tensor the index
            assigns to it; a tensor appears in two shards.
        UsageError: a shard file is missing.
        (and what reading each shard raises)
    """
    try:
        with open(index_path, encoding="utf-8") as f:
            doc = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{index_path} is not valid JSON ({e}); re-download it") from e
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CorruptCheckpointError(f"{index_path} has no weight_map (tensor name -> shard file); it is not a "
                                     "sharded checkpoint index")
    folder = os.path.dirname(os.path.abspath(index_path))
    shards = list(dict.fromkeys(wm.values()))
    src = _Source(index_path, "sharded", [])
    kinds = set()
    seen: dict[str, str] = {}
    for shard in shards:
        p = os.path.join(folder, shard)
        if os.path.isabs(shard) or os.path.normpath(shard).startswith(".."):
            raise CorruptCheckpointError(f"{index_path}: shard path {shard!r} points outside the index's folder")
        if not os.path.isfile(p):
            raise UsageError(f"{index_path} lists shard {shard} but {p} does not exist; download every shard")
        fmt = formats.detect_format(p)
        sub = _safetensors_source(p) if fmt == formats.SAFETENSORS else _torch_source(p, fmt, None)
        kinds.add("safetensors" if fmt == formats.SAFETENSORS else "torch")
        names = {t.name for t in sub.tensors}
        missing = [n for n, s in wm.items() if s == shard and n not in names]
        if missing:
            raise CorruptCheckpointError(f"{index_path} assigns {missing[0]!r} to {shard} but that shard does not hold "
                                         "it; the set is incomplete or mixed from two versions")
        for t in sub.tensors:
            if t.name in seen:
                raise CorruptCheckpointError(f"{index_path}: {t.name!r} is in both {seen[t.name]} and {shard}")
            seen[t.name] = shard
            src.tensors.append(t)
        src.left_out += [f"{shard}: {x}" for x in sub.left_out]
        src.skipped += [f"{shard}: {x}" for x in sub.skipped]
        if src.metadata is None and sub.metadata:
            src.metadata = sub.metadata
    for i, t in enumerate(src.tensors):
        t.index = i
    src.format = "sharded-" + (kinds.pop() if len(kinds) == 1 else "mixed")
    return src


# ================================================================================================ materialising
class _Files:
    """Open source files by path (closed by :meth:`close`)."""

    def __init__(self) -> None:
        self._open: dict[str, Any] = {}

    def get(self, path: str) -> Any:
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = open(path, "rb")  # noqa: SIM115 - closed in close()
        return f

    def read(self, path: str, offset: int, n: int) -> bytearray:
        f = self.get(path)
        f.seek(offset)
        buf = bytearray(n)
        got = f.readinto(buf) if n else 0
        if got != n:
            raise CorruptCheckpointError(f"{path} is truncated: {n} bytes expected at offset {offset}, {got} found; "
                                         "re-download it")
        return buf

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def _torch_dtype(name: str) -> Any:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UnsupportedError(f"dtype {name!r} is not available in this torch ({torch.__version__})")
    return dt


def _from_bytes(buf: bytearray, dtype: str) -> Any:
    """A 1-D tensor of ``dtype`` over ``buf`` (no copy)."""
    import torch

    if not buf:
        return torch.empty(0, dtype=_torch_dtype(dtype))
    return torch.frombuffer(buf, dtype=torch.uint8).view(_torch_dtype(dtype))


class _StorageCache:
    """Materialises source storages as 1-D torch tensors (cast to the output dtype), keeping only the last one."""

    def __init__(self, files: _Files, cast: str | None) -> None:
        self.files, self.cast = files, cast
        self._key: int | None = None
        self._flat: Any = None

    def flat(self, st: _Storage) -> Any:
        if self._key == id(st):
            return self._flat
        self._flat = None  # release the previous storage before reading the next
        import torch

        if st.pieces is None:
            flat = _from_bytes(self.files.read(st.path, st.offset, st.nbytes), st.dtype)
        else:
            flat = torch.empty(st.numel, dtype=_torch_dtype(st.dtype))
            for p in st.pieces:
                data = _from_bytes(self.files.read(st.path, p.file_offset, p.nbytes), st.dtype)
                flat.as_strided(p.shape, p.stride, p.offset).copy_(data.reshape(p.shape))
        out = _out_dtype(st.dtype, self.cast)
        if out != st.dtype:
            flat = flat.to(_torch_dtype(out))
        self._key, self._flat = id(st), flat
        return flat

    def view(self, t: _Tensor) -> Any:
        """The tensor ``t`` (its view of the materialised storage, output dtype)."""
        return self.flat(t.storage).as_strided(t.shape, t.stride, t.offset)


def _out_dtype(dtype: str, cast: str | None) -> str:
    return cast if cast is not None and dtype in CAST_FROM else dtype


def _tensor_buffer(t: Any) -> Any:
    """The bytes of tensor ``t`` in row-major order, as a NumPy uint8 array (a buffer for write / crc32)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


# ================================================================================================ planning
@dataclass(eq=False)
class _Unit:
    """The tensors of one source storage, as they go into the output.

    ``stored`` tensors get their bytes written (safetensors); ``aliases`` maps each other tensor to the stored
    contiguous tensor whose bytes it lies in. ``lo`` / ``hi`` bound the elements any member reaches.
    """

    storage: _Storage
    members: list[_Tensor]
    dtype: str
    stored: list[_Tensor] = field(default_factory=list)
    aliases: dict[int, _Tensor] = field(default_factory=dict)  # id(alias) -> keeper
    lo: int = 0
    hi: int = 0

    @property
    def first(self) -> int:
        return self.members[0].index

    def stored_bytes(self) -> int:
        return sum(t.numel for t in self.stored) * DTYPE_SIZES[self.dtype]


def _units(tensors: list[_Tensor], cast: str | None) -> list[_Unit]:
    """Group tensors by storage (order of first use) and choose, per storage, what safetensors stores.

    A member is an alias when its elements lie inside a stored contiguous member; contiguous members are tried
    first, longest first, then in state_dict order, so of two tied weights the first in the state_dict is kept.
    """
    by_storage: dict[int, _Unit] = {}
    units: list[_Unit] = []
    for t in tensors:
        u = by_storage.get(id(t.storage))
        if u is None:
            u = by_storage[id(t.storage)] = _Unit(t.storage, [], _out_dtype(t.dtype, cast))
            units.append(u)
        u.members.append(t)
    for u in units:
        spans = [t.span for t in u.members if t.numel]
        u.lo = min((s[0] for s in spans), default=0)
        u.hi = max((s[1] for s in spans), default=0)
        if len(u.members) == 1:
            u.stored = list(u.members)
            continue
        keepers: list[_Tensor] = []
        order = sorted(u.members, key=lambda t: (not _is_contiguous(t.shape, t.stride), -(t.span[1] - t.span[0]),
                                                 t.index))
        for t in order:
            lo, hi = t.span
            keeper = next((k for k in keepers if t.numel and k.span[0] <= lo and hi <= k.span[1]), None)
            if keeper is not None:
                u.aliases[id(t)] = keeper
                continue
            u.stored.append(t)
            if t.numel and _is_contiguous(t.shape, t.stride):
                keepers.append(t)
        u.stored.sort(key=lambda t: t.index)
    return units


def _union_elements(members: list[_Tensor]) -> int:
    total, end = 0, None
    for lo, hi in sorted(t.span for t in members if t.numel):
        if end is None or lo >= end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def _shared_metadata(units: list[_Unit], positions: dict[int, int]) -> str | None:
    """The :data:`SHARED_KEY` value for ``units`` holding more than one tensor, or None.

    JSON ``{"version": 1, "groups": [{"dtype": "float32", "numel": N, "tensors": {name: [index, offset, shape,
    stride]}}]}``: one group per shared storage, trimmed to the elements its tensors reach (``numel``); each
    member's ``offset`` / ``stride`` are in elements of that trimmed storage and ``index`` is its position in the
    state_dict. Members present in the file are stored contiguous copies of their view; the others are aliases.
    """
    groups = []
    for u in units:
        if len(u.members) < 2:
            continue
        groups.append({"dtype": u.dtype, "numel": u.hi - u.lo, "tensors": {
            t.name: [positions[id(t)], (t.offset - u.lo) if t.numel else 0, list(t.shape),
                     list(t.stride)] for t in u.members}})
    if not groups:
        return None
    return json.dumps({"version": 1, "groups": groups}, separators=(",", ":"))


def _check_safetensors_dtypes(tensors: list[_Tensor], cast: str | None, where: str) -> None:
    bad = [t for t in tensors if _out_dtype(t.dtype, cast) not in ST_CODES]
    if bad:
        names = ", ".join(f"{t.name} ({t.dtype})" for t in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise UnsupportedError(f"{where}: safetensors has no dtype for {names}; convert with --format torch instead")


# ================================================================================================ writing safetensors
@dataclass
class _Written:
    """What one output file holds, for verification: ``expect`` = ``[(name, dtype, shape, crc or None)]`` of the
    stored tensors, ``metadata`` the ``__metadata__`` written, ``tensors`` every output tensor (aliases included)."""

    path: str
    expect: list[tuple[str, str, tuple[int, ...], int | None]]
    metadata: dict[str, str] | None
    tensors: list[_Tensor]
    units: list[_Unit]
    nbytes: int = 0
    records: dict[str, int] = field(default_factory=dict)  # torch output: record name -> CRC-32


def _write_safetensors(out: Any, units: list[_Unit], base_meta: dict[str, str] | None, files: _Files,
                       cast: str | None, progress: Callable[[int], None] | None, res: ConvertResult,
                       need_crc: bool = True) -> _Written:
    """Write ``units`` as one safetensors file into the open binary file ``out``.

    Header keys follow state_dict order; data is laid out by element size (largest first), so every tensor starts
    on a multiple of its element size, as the safetensors writer does. Tensor bytes that need no change are copied
    by the kernel when their CRC-32 is known from the source zip (a tensor filling its storage record) or
    ``need_crc`` is False; otherwise they pass through an 8 MiB buffer that computes it.
    """
    members = sorted((t for u in units for t in u.members), key=lambda t: t.index)
    positions = {id(t): i for i, t in enumerate(members)}
    meta: dict[str, str] = dict(base_meta or {})
    shared = _shared_metadata(units, positions)
    if shared is not None:
        meta[SHARED_KEY] = shared
    for u in units:
        for t in u.members:
            k = u.aliases.get(id(t))
            if k is not None and (k.offset, k.shape, k.stride) == (t.offset, t.shape, t.stride):
                meta.setdefault(t.name, k.name)  # safetensors.torch.save_model's record of a dropped name
    if meta:
        meta.setdefault("format", "pt")  # transformers requires it whenever metadata is present
    stored = [(u, t) for u in units for t in u.stored]
    layout = sorted(stored, key=lambda ut: (-DTYPE_SIZES[ut[0].dtype], ut[0].first, ut[1].index))
    offsets: dict[int, tuple[int, int]] = {}
    pos = 0
    for u, t in layout:
        n = t.numel * DTYPE_SIZES[u.dtype]
        offsets[id(t)] = (pos, pos + n)
        pos += n
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    for u, t in sorted(stored, key=lambda ut: ut[1].index):
        header[t.name] = {"dtype": ST_CODES[u.dtype], "shape": list(t.shape), "data_offsets": list(offsets[id(t)])}
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    out.write(struct.pack("<Q", len(raw)))
    out.write(raw)
    cache = _StorageCache(files, cast)
    crcs: dict[int, int] = {}
    for u, t in layout:
        esize = DTYPE_SIZES[u.dtype]
        st = t.storage
        if u.dtype == t.dtype and st.pieces is None and _is_contiguous(t.shape, t.stride):
            whole = t.offset == 0 and t.numel * esize == st.nbytes
            if (whole and st.crc is not None) or not need_crc:  # the checksum is known, or not needed
                _copy_kernel(files.get(st.path), out, st.offset, t.numel * esize)
                crc = st.crc if whole else None
            else:
                crc = _copy_crc(files.get(st.path), out, st.offset + t.offset * esize, t.numel * esize)
        else:
            buf = _tensor_buffer(cache.view(t))
            out.write(buf)
            crc = zlib.crc32(buf)
            if not _is_contiguous(t.shape, t.stride):
                res.made_contiguous.append(t.name)
        crcs[id(t)] = crc
        if progress:
            progress(t.numel * esize)
    w = _Written(getattr(out, "name", ""), [], meta or None, members, units, nbytes=8 + len(raw) + pos)
    for u, t in stored:
        w.expect.append((t.name, u.dtype, t.shape, crcs[id(t)]))
    for u in units:
        for t in u.members:
            k = u.aliases.get(id(t))
            if k is not None:
                res.aliases[t.name] = k.name
    return w


# ================================================================================================ writing torch
def _od(G: Callable[[str, str], Any]) -> Any:
    return G("collections", "OrderedDict")()


def _renamed_meta_state(state: Any, rename_path: Callable[[str], str] | None, G: Callable[[str, str], Any]) -> Any:
    """The selected OrderedDict's BUILD state (``{"_metadata": ...}``) with module paths renamed."""
    if type(state) is not dict:
        return None
    meta = state.get("_metadata")
    items = mapping_items(meta)
    if items is None or rename_path is None:
        return state
    renamed: dict[Any, Any] = {}
    for m, v in items:
        renamed[rename_path(m) if isinstance(m, str) else m] = v
    node = _od(G)
    node.dictitems = list(renamed.items())
    node.order = ["setitems"]
    return {**state, "_metadata": node}


def _torch_pickle(tensors: list[_Tensor], keys: dict[int, str], cast: str | None, location: Callable[[str], str],
                  sd_state: Any, rename_path: Callable[[str], str] | None) -> bytes:
    """``data.pkl`` of an ``OrderedDict`` state_dict of ``tensors``, as ``torch.save`` writes it (protocol 2,
    ``_rebuild_tensor_v2`` over a typed storage class, ``_rebuild_tensor_v3`` over ``UntypedStorage`` for dtypes
    without one). Storages are named by ``keys[id(storage)]``."""
    from ckptool.formats.pickler import dumps

    up = RestrictedUnpickler(io.BytesIO(b""))  # used only to make global placeholders
    G = up.find_class
    refs: dict[int, StorageRef] = {}
    items = []
    for t in tensors:
        st = t.storage
        dt = _out_dtype(st.dtype, cast)
        ref = refs.get(id(st))
        if ref is None:
            numel = st.numel
            if dt in _V2_STORAGE:
                ref = StorageRef("storage", G("torch", _V2_STORAGE[dt]), keys[id(st)], location(st.location), numel, ())
            else:
                ref = StorageRef("storage", G("torch.storage", "UntypedStorage"), keys[id(st)], location(st.location),
                                 numel * DTYPE_SIZES[dt], ())
            refs[id(st)] = ref
        if dt in _V2_STORAGE:
            node = G("torch._utils", "_rebuild_tensor_v2")(ref, t.offset, t.shape, t.stride, t.requires_grad, _od(G))
        else:
            node = G("torch._utils", "_rebuild_tensor_v3")(ref, t.offset, t.shape, t.stride, t.requires_grad, _od(G),
                                                           G("torch", dt))
        items.append((t.name, node))
    root = _od(G)
    root.dictitems = items
    root.order = ["setitems"]
    state = _renamed_meta_state(sd_state, rename_path, G) if sd_state is not None else None
    if state is not None:
        root.state = state
        root.order = ["setitems", "build"]
    return dumps(root, protocol=2)


def _write_torch(out: Any, tensors: list[_Tensor], files: _Files, cast: str | None, location: Callable[[str], str],
                 archive: str, sd_state: Any, rename_path: Callable[[str], str] | None,
                 progress: Callable[[int], None] | None) -> _Written:
    """Write ``tensors`` as a torch zip checkpoint (an ``OrderedDict`` state_dict) into the open file ``out``.

    Storage records are copied from the source byte for byte (kernel copy when the source's CRC-32 is known);
    a storage that is cast or assembled from safetensors pieces is materialised, one at a time.
    """
    import secrets

    storages: list[_Storage] = []
    keys: dict[int, str] = {}
    for t in tensors:
        if id(t.storage) not in keys:
            keys[id(t.storage)] = str(len(storages))
            storages.append(t.storage)
    pkl = _torch_pickle(tensors, keys, cast, location, sd_state, rename_path)
    w = TorchZipWriter(out, archive)
    w.write_bytes("data.pkl", pkl)
    w.write_bytes(".format_version", b"1")
    w.write_bytes(".storage_alignment", b"64")
    w.write_bytes("byteorder", b"little")
    cache = _StorageCache(files, cast)
    written = _Written(getattr(out, "name", ""), [], None, list(tensors), [])
    for st in storages:
        name = f"data/{keys[id(st)]}"
        if st.pieces is None and _out_dtype(st.dtype, cast) == st.dtype:
            w.copy_record(name, files.get(st.path), st.offset, st.nbytes, st.crc)
        else:
            buf = _tensor_buffer(cache.flat(st))
            w.write_bytes(name, buf)  # type: ignore[arg-type] - any buffer: len() is its byte count (uint8)
            del buf
        written.records[name] = w.entries[-1][1]
        if progress:
            progress(st.numel * DTYPE_SIZES[_out_dtype(st.dtype, cast)])
    w.write_bytes("version", b"3\n")
    w.write_bytes(".data/serialization_id", str(secrets.randbits(128)).zfill(40).encode())
    w.close()
    written.nbytes = w.pos
    return written


# ================================================================================================ verification
class VerificationError(CkptError):
    """The written output does not read back as the source: a name, shape, dtype, sharing or checksum differs.
    Nothing is left at the destination (or the output written there is removed)."""


def _verify_fail(path: str, what: str) -> VerificationError:
    return VerificationError(f"verification of {path} failed: {what}; the output was not kept. Check the disk and "
                             "retry; if it fails again, report it with the source file's `ckptool inspect --json`")


#: dtypes NumPy holds: files of only these are verified through safetensors' NumPy framework, without torch
_NUMPY_DTYPES = frozenset({"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "uint16",
                           "uint32", "uint64", "bool", "complex64"})


def _safe_open(path: str, framework: str) -> Any:
    from safetensors import safe_open

    try:  # pread: each tensor read into its own buffer, so memory stays bounded by one tensor
        return safe_open(path, framework=framework, backend="pread")
    except TypeError:  # safetensors < 0.7 has no backend choice
        return safe_open(path, framework=framework)


def _array_crc(a: Any) -> int:
    """CRC-32 of the bytes of a NumPy array or torch tensor, in row-major order."""
    if hasattr(a, "untyped_storage"):
        return zlib.crc32(_tensor_buffer(a))
    import numpy as np

    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _verify_safetensors(w: _Written, path: str) -> None:
    """Re-open ``path`` with ``safetensors.safe_open`` (its NumPy framework when NumPy holds every dtype, so torch
    is not needed; else torch) and compare every stored tensor's name, dtype, shape and CRC-32 with ``w.expect``,
    and the ``__metadata__``; then read it back with ckptool and compare every tensor (aliases included) and the
    storage sharing with ``w``.

    Raises:
        VerificationError: any difference.
    """
    numpy = all(e[1] in _NUMPY_DTYPES for e in w.expect)
    try:
        with _safe_open(path, "numpy" if numpy else "pt") as f:
            names = set(f.keys())
            want = {e[0] for e in w.expect}
            if names != want:
                diff = sorted(names ^ want)[:3]
                raise _verify_fail(path, f"tensor names differ ({', '.join(diff)})")
            if (f.metadata() or None) != (w.metadata or None):
                raise _verify_fail(path, "__metadata__ differs")
            for name, dtype, shape, crc in w.expect:
                t = f.get_tensor(name)
                if str(t.dtype).removeprefix("torch.") != dtype or tuple(t.shape) != tuple(shape):
                    raise _verify_fail(path, f"{name!r} reads back as {t.dtype} {list(t.shape)}, expected {dtype} "
                                             f"{list(shape)}")
                if crc is not None and _array_crc(t) != crc:
                    raise _verify_fail(path, f"{name!r} reads back with different bytes (CRC-32)")
                del t
    except VerificationError:
        raise
    except Exception as e:  # the safetensors library refused the file
        raise _verify_fail(path, f"safetensors.safe_open refused it ({type(e).__name__}: {e})") from e
    back = _safetensors_source(path)
    unit_of = {id(t): u for u in w.units for t in u.members}

    def expected(t: _Tensor) -> tuple:
        u = unit_of[id(t)]
        if len(u.members) > 1:
            return (t.name, u.dtype, t.shape, t.stride, (t.offset - u.lo) if t.numel else 0)
        return (t.name, u.dtype, t.shape, _contiguous_stride(t.shape), 0)

    got = [(t.name, t.dtype, t.shape, t.stride, t.offset) for t in back.tensors]
    exp = [expected(t) for t in w.tensors]
    if got != exp:
        g, x = next(((g, x) for g, x in zip(got, exp) if g != x), (got[len(exp):], exp[len(got):]))
        raise _verify_fail(path, f"reading it back with ckptool gives {g}, expected {x}")
    by_name = {t.name: t for t in back.tensors}
    for u in w.units:
        if len({id(by_name[t.name].storage) for t in u.members}) != 1:
            raise _verify_fail(path, f"{u.members[0].name!r} and the tensors sharing its storage no longer share one")


def _verify_torch(w: _Written, path: str, cast: str | None, location: Callable[[str], str]) -> None:
    """Open ``path`` with ``torch.load(mmap=True, weights_only=True)`` and compare every tensor's name, dtype, shape,
    stride, storage offset, requires_grad and storage sharing with ``w``; then read every storage record through
    ``zipfile`` (which checks its CRC-32) and compare the CRC-32 with the one expected from the source.

    Raises:
        VerificationError: any difference.
    """
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise _verify_fail(path, f"torch.load(weights_only=True) refused it ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict) or list(obj) != [t.name for t in w.tensors]:
        raise _verify_fail(path, "the state_dict keys differ")
    owner: dict[int, int] = {}
    for t in w.tensors:
        v = obj[t.name]
        want = (f"torch.{_out_dtype(t.dtype, cast)}", tuple(t.shape), tuple(t.stride), t.offset, t.requires_grad)
        got = (str(v.dtype), tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.requires_grad)
        if got != want:
            raise _verify_fail(path, f"{t.name!r} reads back as {got}, expected {want}")
        st = v.untyped_storage()
        if st.nbytes() and owner.setdefault(st.data_ptr(), id(t.storage)) != id(t.storage):
            raise _verify_fail(path, f"{t.name!r} shares a storage it should not")
    by_storage: dict[int, int] = {}
    for t in w.tensors:
        st = obj[t.name].untyped_storage()
        if st.nbytes() and by_storage.setdefault(id(t.storage), st.data_ptr()) != st.data_ptr():
            raise _verify_fail(path, f"{t.name!r} no longer shares its storage")
    del obj
    try:
        with zipfile.ZipFile(path) as z:
            infos = {i.filename.split("/", 1)[-1]: i for i in z.infolist()}
            for name, crc in w.records.items():
                info = infos.get(name)
                if info is None or info.CRC != crc:
                    raise _verify_fail(path, f"record {name} is missing or its CRC-32 differs from the source's")
                with z.open(info) as fh:
                    while fh.read(_CHUNK):
                        pass
    except zipfile.BadZipFile as e:
        raise _verify_fail(path, f"a record fails its CRC-32 check ({e})") from e


def _fd_path(f: Any) -> str | None:
    """The path of the open file ``f`` (Linux ``/proc/self/fd``), or None where the platform does not say."""
    try:
        p = os.readlink(f"/proc/self/fd/{f.fileno()}")
    except (OSError, AttributeError, ValueError):
        return None
    return p if os.path.isfile(p) else None


def _emit(path: str, write: Callable[[Any], _Written], check: Callable[[_Written, str], None] | None) -> _Written:
    """Write one output file atomically (:func:`ckptool.writer.atomic_output`), verifying it with ``check`` before it
    is renamed into place (or, where the temporary file cannot be named, right after, removing it on failure)."""
    with atomic_output(path) as out:
        w = write(out)
        out.flush()
        tmp = _fd_path(out)
        if check is not None and tmp is not None:
            check(w, tmp)
            check = None
    w.path = path
    if check is not None:
        try:
            check(w, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
    return w


# ================================================================================================ DCP
#: globals a ``torch.distributed.checkpoint`` ``.metadata`` pickle names (torch/distributed/checkpoint/metadata.py,
#: filesystem.py); besides these only the ``weights_only`` allowlist is accepted without ``trust``
DCP_GLOBALS = frozenset({
    *(f"torch.distributed.checkpoint.metadata.{n}" for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath", "pathlib.PureWindowsPath",
})


def _dcp_allowed(name: str) -> bool:
    from ckptool.model.allowlist import is_allowed

    return name in DCP_GLOBALS or is_allowed(name)


def _state(node: Any) -> Any:
    return node.state if isinstance(node, PickledObject) else None


def read_dcp_metadata(folder: str | os.PathLike[str]) -> tuple[Any, list[str]]:
    """Read the ``.metadata`` pickle of a DCP folder with ckptool's restricted unpickler (nothing imported or run).

    Returns ``(root node, qualified names of the globals it names)``.

    Raises:
        UsageError: no ``.metadata`` in ``folder``.
        CorruptCheckpointError: the pickle is damaged, or is not a DCP ``Metadata``.
    """
    p = os.path.join(os.fspath(folder), ".metadata")
    if not os.path.isfile(p):
        raise UsageError(f"{folder} has no .metadata: not a torch.distributed.checkpoint folder")
    with open(p, "rb") as f:
        data = f.read()
    root, up = load_structure(data, f".metadata of {folder}")
    names = [qualified_name(m, n) for m, n in up.globals_seen]
    st = _state(root)
    if not (isinstance(root, ObjectNode) and root.global_name.endswith("checkpoint.metadata.Metadata")
            and type(st) is dict and isinstance(st.get("state_dict_metadata"), dict)):
        raise CorruptCheckpointError(f"{p} is not a torch.distributed.checkpoint Metadata pickle; the folder is "
                                     "damaged or not a DCP checkpoint")
    return root, names


def _dcp_entries(root: Any) -> list[tuple[str, str | None, tuple[int, ...] | None]]:
    """``(fqn, dtype name or None, shape or None)`` per entry of ``state_dict_metadata`` (None: a non-tensor)."""
    out = []
    for fqn, md in root.state["state_dict_metadata"].items():
        st = _state(md)
        if type(st) is dict and "size" in st:
            props = _state(st.get("properties"))
            dt = props[0] if isinstance(props, tuple) and props else (props or {}).get("dtype") if type(props) is dict else None
            size = st["size"]
            shape = tuple(size.args[0]) if isinstance(size, ReduceNode) and size.args else tuple(size or ())
            out.append((str(fqn), dt.name if isinstance(dt, GlobalMeta) else "unknown", shape))
        else:
            out.append((str(fqn), None, None))
    return out


def _dcp_check_safe(folder: str, trust: bool) -> None:
    """Refuse (unless ``trust``) a DCP folder whose ``.metadata`` or non-tensor entries name globals that DCP does
    not write and ``torch.load(weights_only=True)`` does not allow: torch's ``FileSystemReader`` unpickles
    ``.metadata`` with ``pickle.load`` and ``DefaultLoadPlanner`` loads non-tensor entries with
    ``torch.load(weights_only=False)``.

    Raises:
        UnsafeCheckpointError: such globals, or a non-tensor entry that cannot be read to check it.
    """
    root, names = read_dcp_metadata(folder)
    if trust:
        return
    unsafe = [n for n in dict.fromkeys(names) if not _dcp_allowed(n)]
    byte_fqns = {fqn for fqn, dt, _s in _dcp_entries(root) if dt is None}
    for idx, info in (root.state.get("storage_data") or {}).items():
        ist, sst = _state(idx), _state(info)
        if type(ist) is not dict or ist.get("fqn") not in byte_fqns or type(sst) is not dict:
            continue
        if sst.get("transform_descriptors"):
            unsafe.append(f"(transformed entry {ist['fqn']!r}, cannot be checked)")
            continue
        rel = str(sst.get("relative_path", ""))
        p = os.path.join(folder, rel)
        if os.path.isabs(rel) or os.path.normpath(rel).startswith("..") or not os.path.isfile(p):
            raise CorruptCheckpointError(f"{folder}: entry {ist['fqn']!r} points at a missing file {rel!r}")
        with open(p, "rb") as f:
            f.seek(int(sst.get("offset", 0)))
            blob = f.read(int(sst.get("length", 0)))
        try:
            with zipfile.ZipFile(io.BytesIO(blob)) as z:
                pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
                _obj, up = load_structure(z.read(pkl), f"entry {ist['fqn']!r} of {folder}")
        except (zipfile.BadZipFile, StopIteration) as e:
            raise CorruptCheckpointError(f"{folder}: entry {ist['fqn']!r} is not a torch.save record; the folder "
                                         "is damaged") from e
        from ckptool.model.allowlist import is_allowed

        unsafe += [qualified_name(m, n) for m, n in up.globals_seen if not is_allowed(qualified_name(m, n))]
    if unsafe:
        unsafe = list(dict.fromkeys(unsafe))
        raise UnsafeCheckpointError(
            f"{folder}: loading this DCP checkpoint would import {', '.join(unsafe[:5])}"
            f"{' and more' if len(unsafe) > 5 else ''}, outside torch's weights_only allowlist (torch.distributed."
            "checkpoint unpickles .metadata and non-tensor entries without restriction). Pass --trust (trust=True) "
            "only if you trust where the folder came from", unsafe)


@contextlib.contextmanager
def _temp_file(near: str, suffix: str) -> Any:
    """A temporary file path beside ``near`` (same filesystem), removed afterwards."""
    folder = os.path.dirname(os.path.abspath(near)) or "."
    if not os.path.isdir(folder):
        raise UsageError(f"output folder {folder} does not exist; create it first or choose another -o path")
    fd, p = tempfile.mkstemp(prefix=".ckptool-convert.", suffix=suffix, dir=folder)
    os.close(fd)
    try:
        yield p
    finally:
        with contextlib.suppress(OSError):
            os.unlink(p)


def _flat_tensors(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor in nested dicts / lists, by dotted path."""
    import torch

    out: dict[str, Any] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_tensors(v, join(prefix, k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flat_tensors(v, join(prefix, i)))
    return out


def _same_tensors(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when both maps hold the same names with equal dtype, shape and bytes; else the first difference."""
    if list(a) != list(b) and set(a) != set(b):
        return f"tensor names differ ({', '.join(sorted(set(a) ^ set(b))[:3])})"
    for k, x in a.items():
        y = b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{k!r} is {y.dtype} {list(y.shape)}, expected {x.dtype} {list(x.shape)}"
        if zlib.crc32(_tensor_buffer(x.detach().cpu())) != zlib.crc32(_tensor_buffer(y.detach().cpu())):
            return f"{k!r} has different bytes"
    return None


def _to_dcp(src: str, dst: str, *, key: str | None, trust: bool, verify: bool, renames: dict[str, Any],
            cast: str | None, fmt_in: str) -> ConvertResult:
    """Write a DCP folder at ``dst`` with ``torch.distributed.checkpoint.save`` (no process group needed).

    A torch file converts whole (training state included) unless ``key``, renames or ``cast`` ask for one
    state_dict; other inputs are first converted to a temporary torch file.
    """
    import torch.distributed.checkpoint as dcp

    from ckptool.torch_ops.loading import load_checkpoint

    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise UsageError(f"{dst} already exists and is not an empty folder; a DCP checkpoint is written into a new "
                         "folder: choose another -o path")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise UsageError(f"output folder {parent} does not exist; create it first or choose another -o path")
    res = ConvertResult(src, dst, fmt_in, "dcp")
    with _temp_file(dst, ".pt") as tmp:
        whole = fmt_in in (formats.TORCH_ZIP, formats.TORCH_LEGACY) and key is None and not renames and cast is None
        if whole:
            path = src
            res.notes.append("the whole checkpoint was converted (pass --key to convert one state_dict)")
        else:
            sub = convert(src, tmp, format="torch", key=key, dtype=cast, verify=False, trust=trust, **renames)
            path = tmp
            res.key, res.left_out, res.skipped, res.cast, res.renamed = (sub.key, sub.left_out, sub.skipped,
                                                                         sub.cast, sub.renamed)
        obj, _saved = load_checkpoint(path, "cpu", trust=trust)
        if not isinstance(obj, dict):
            raise UnsupportedError(f"{src} holds a {type(obj).__name__}, not a dict; DCP saves a state_dict (a dict)")
        stage = tempfile.mkdtemp(prefix=".ckptool-dcp.", dir=parent)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                dcp.save(obj, checkpoint_id=stage, no_dist=True)
            if verify:
                import torch
                from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

                with _temp_file(dst, ".pt") as back:
                    dcp_to_torch_save(stage, back)
                    again = torch.load(back, map_location="cpu", weights_only=True)
                diff = _same_tensors(_flat_tensors(obj), _flat_tensors(again))
                if diff:
                    raise _verify_fail(dst, diff)
                res.verified = True
            if os.path.isdir(dst):
                os.rmdir(dst)
            os.replace(stage, dst)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    flat = _flat_tensors(obj)
    res.tensors = res.stored = len(flat)
    res.files = sorted(os.path.join(dst, n) for n in os.listdir(dst))
    res.bytes_written = sum(os.path.getsize(p) for p in res.files)
    return res


def _from_dcp(src: str, dst: str, *, fmt_out: str, trust: bool, kwargs: dict[str, Any]) -> ConvertResult:
    """Convert a DCP folder: ``format_utils.dcp_to_torch_save`` into a temporary torch file beside ``dst``, then
    that file to ``dst`` with the other options."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, _names = read_dcp_metadata(src)
    _dcp_check_safe(src, trust)
    with _temp_file(dst, ".pt") as tmp:
        try:
            dcp_to_torch_save(src, tmp)
        except CkptError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(f"{src}: torch.distributed.checkpoint could not read it "
                                         f"({type(e).__name__}: {e}); the folder is incomplete or damaged") from e
        whole = fmt_out == "torch" and not any(kwargs.get(k) for k in ("key", "to", "max_shard_size", "dtype",
                                                                          "unwrap", "strip_prefixes"))
        if whole:
            return _place_whole_dcp(src, tmp, dst, root, kwargs.get("verify", True))
        res = convert(tmp, dst, format=fmt_out, trust=True, **kwargs)  # the file was written by torch just now
    res.src, res.format_in = src, "dcp"
    return res


def _place_whole_dcp(src: str, tmp: str, dst: str, root: Any, verify: bool) -> ConvertResult:
    """Move the file ``dcp_to_torch_save`` wrote into place as the output, after checking that it opens with
    ``torch.load(weights_only=True)`` and holds every tensor ``.metadata`` lists with its dtype and shape."""
    import torch

    note = "the whole checkpoint was converted (pass --key to convert one state_dict)"
    res = ConvertResult(src, dst, "dcp", "torch", notes=[note])
    obj = torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
    flat = _flat_tensors(obj)
    res.tensors = res.stored = len(flat)
    if verify:
        for fqn, dt, shape in _dcp_entries(root):
            if dt is None:
                continue
            t = flat.get(fqn)
            if t is None or str(t.dtype) != f"torch.{dt}" or tuple(t.shape) != shape:
                raise _verify_fail(dst, f"{fqn!r} is missing or differs from the DCP metadata ({dt} {list(shape or ())})")
        res.verified = True
        res.checked = "names, shapes and dtypes of .metadata (DCP records no checksums)"
    del obj, flat
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, dst)
    res.files = [dst]
    res.bytes_written = os.path.getsize(dst)
    return res


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ================================================================================================ convert
def _output_format(dst: str, fmt: str | None, sharded: bool) -> str:
    if fmt is not None:
        if fmt not in ("torch", "safetensors", "dcp"):
            raise UsageError(f"unknown format {fmt!r}: choose torch, safetensors or dcp")
        return fmt
    if sharded:
        return "safetensors"
    low = dst.lower()
    if low.endswith(".safetensors"):
        return "safetensors"
    if low.endswith(_TORCH_SUFFIXES):
        return "torch"
    raise UsageError(f"cannot tell the output format from {dst!r}: name it *.safetensors or *.pt / *.pth / *.bin, "
                     "or pass --format torch|safetensors|dcp")


def _apply_renames(src: _Source, unwrap: bool, strip_prefixes: Sequence[str]) -> tuple[int, Any]:
    """Rename the source's keys in place with :func:`ckptool.prefixes.build_plan`; returns ``(renamed keys, plan)``.

    Raises:
        UsageError: a bad prefix.
        PrefixNotFoundError: a prefix to strip is carried by no key.
        KeyCollisionError: two keys would get one name.
    """
    if not unwrap and not strip_prefixes:
        return 0, None
    from ckptool.errors import PrefixNotFoundError
    from ckptool.ops.rename import build_plan

    plan = build_plan(strip_prefixes=list(strip_prefixes), unwrap=unwrap)
    mapping: dict[str, str] = {}
    hits: set[str] = set()
    for t in src.tensors:
        new, removed, _added = plan.trace(t.name)
        mapping[t.name] = new
        hits.update(c for step in removed for c in step)
    for step in plan.steps:
        if step.kind == "strip":
            missing = [p for p in step.prefixes if p not in hits]
            if missing:
                seen = ", ".join(repr(t.name) for t in src.tensors[:3]) or "no keys"
                raise PrefixNotFoundError(f"{src.path}: no key starts with {' or '.join(map(repr, missing))} (keys look "
                                          f"like {seen}); nothing was written. Check the prefix with `ckptool inspect`")
    raise_on_collisions(mapping, where=src.path)
    n = 0
    for t in src.tensors:
        if mapping[t.name] != t.name:
            n += 1
            t.name = mapping[t.name]
    if unwrap and not n:
        src.notes.append("no key carried a wrapper component: nothing to unwrap")
    return n, plan


def _refuse_overwriting_input(src: _Source, dst: str, folder: bool) -> None:
    """Raise UsageError when the output would replace an input file (a shard of the input set), or when sharded
    output goes into the folder holding the input (its shards could carry the same names)."""
    inputs = {os.path.abspath(src.path)} | {os.path.abspath(t.storage.path) for t in src.tensors}
    target = os.path.abspath(dst)
    if folder and any(os.path.dirname(p) == target for p in inputs):
        raise UsageError(f"{dst} holds the input; write the shards into another folder")
    if not folder and target in inputs:
        raise UsageError(f"output {dst} is one of the input files; choose another -o path")


def _split(units: list[_Unit], limit: int, size: Callable[[_Unit], int]) -> list[list[_Unit]]:
    """Shards of at most ``limit`` bytes, filled in order (``huggingface_hub.split_state_dict_into_shards``'
    rule); a storage larger than the limit gets a shard of its own; a storage is never split."""
    shards: list[list[_Unit]] = [[]]
    used = 0
    for u in units:
        n = size(u)
        if shards[-1] and used + n > limit:
            shards.append([])
            used = 0
        shards[-1].append(u)
        used += n
    return shards


def _archive_name(path: str) -> str:
    stem = os.path.splitext(os.path.basename(path))[0]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "archive"


def _write_outputs(src: _Source, dst: str, fmt_out: str, shard_bytes: int | None, cast: str | None,
                   location: Callable[[str], str], rename_path: Any, verify: bool,
                   progress: Callable[[int, int], None] | None, res: ConvertResult) -> None:
    if fmt_out == "safetensors":
        _check_safetensors_dtypes(src.tensors, cast, src.path)
    units = _units(src.tensors, cast)

    def unit_size(u: _Unit) -> int:
        if fmt_out == "safetensors":
            return u.stored_bytes()
        return u.storage.numel * DTYPE_SIZES[u.dtype]

    total = sum(unit_size(u) for u in units)
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    files = _Files()
    try:
        if shard_bytes is None:
            plan = [(dst, units)]
        else:
            if os.path.exists(dst) and not os.path.isdir(dst):
                raise UsageError(f"{dst} is a file; with --max-shard-size, -o names a folder for the shards")
            os.makedirs(dst, exist_ok=True)
            shards = _split(units, shard_bytes, unit_size)
            stem, ext = _SHARD_NAMES[fmt_out]
            if len(shards) == 1:
                plan = [(os.path.join(dst, stem + ext), shards[0])]
            else:
                plan = [(os.path.join(dst, f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}"), s)
                        for i, s in enumerate(shards)]
        weight_map: dict[str, str] = {}
        for path, us in plan:
            tensors = sorted((t for u in us for t in u.members), key=lambda t: t.index)
            if fmt_out == "safetensors":
                meta = dict(src.metadata) if src.metadata else None

                def write(out: Any, us: list[_Unit] = us, meta: Any = meta) -> _Written:
                    return _write_safetensors(out, us, meta, files, cast, tick, res, need_crc=verify)

                w = _emit(path, write, _verify_safetensors if verify else None)
                names = [t.name for u in us for t in u.stored]
            else:
                def write(out: Any, tensors: list[_Tensor] = tensors, path: str = path) -> _Written:
                    state = src.sd_state if shard_bytes is None else None
                    return _write_torch(out, tensors, files, cast, location, _archive_name(path), state, rename_path,
                                        tick)

                def check(w: _Written, p: str) -> None:
                    _verify_torch(w, p, cast, location)

                w = _emit(path, write, check if verify else None)
                names = [t.name for t in tensors]
            res.files.append(path)
            res.bytes_written += w.nbytes
            weight_map.update((n, os.path.basename(path)) for n in names)
        res.shards = len(plan)
        if shard_bytes is not None:
            _finish_folder(dst, fmt_out, plan, weight_map, sum(unit_size(u) for u in units), res)
    finally:
        files.close()
    res.tensors = len(src.tensors)
    res.stored = sum(len(u.stored) for u in units) if fmt_out == "safetensors" else len(src.tensors)
    if fmt_out == "safetensors":  # torch output copies whole storages
        res.trimmed_bytes = sum(u.storage.nbytes - _union_elements(u.members) * DTYPE_SIZES[u.storage.dtype]
                                for u in units)
    for t in src.tensors:
        out = _out_dtype(t.dtype, cast)
        if out != t.dtype:
            k = f"{t.dtype}->{out}"
            res.cast[k] = res.cast.get(k, 0) + 1
    if verify:
        res.verified = True


def _finish_folder(dst: str, fmt_out: str, plan: list[tuple[str, list[_Unit]]], weight_map: dict[str, str],
                   total: int, res: ConvertResult) -> None:
    """Write the index (several shards) and remove shards of an earlier run that the new set does not use."""
    stem, ext = _SHARD_NAMES[fmt_out]
    index = os.path.join(dst, f"{stem}{ext}.index.json")
    keep = {os.path.basename(p) for p, _u in plan}
    if len(plan) > 1:
        doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with atomic_output(index) as f:
            f.write((json.dumps(doc, indent=2) + "\n").encode("utf-8"))
        res.files.append(index)
        keep.add(os.path.basename(index))
    pattern = re.compile(rf"^{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(ext)}(\.index\.json)?$")
    stale = [n for n in os.listdir(dst) if pattern.match(n) and n not in keep]
    for n in stale:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(dst, n))
    if stale:
        res.notes.append(f"removed {len(stale)} file(s) of an earlier shard set in {dst}: {', '.join(sorted(stale)[:3])}")


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str | None = None,
    key: str | None = None,
    to: str | None = None,
    unwrap: bool = False,
    strip_prefixes: str | Sequence[str] = (),
    max_shard_size: int | str | None = None,
    dtype: str | None = None,
    verify: bool = True,
    trust: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Convert checkpoint ``src`` to ``dst`` in one pass.

    ``src`` is a torch.save file (zip or legacy), a safetensors file, a sharded set (its ``*.index.json``, or the
    folder holding it) or a DCP folder. ``format`` is ``"torch"``, ``"safetensors"`` or ``"dcp"``; by default it
    follows ``dst``'s suffix (``.safetensors``; ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt``), and is safetensors
    with ``max_shard_size``.

    * ``key`` selects the state_dict (dotted path such as ``"model_state_dict"``); by default it is found, and the
      other entries of the file are reported in ``left_out``, not carried.
    * ``to`` sets the location tag of every storage of a torch output (``"cpu"``, ``"cuda:0"``); by default torch
      inputs keep theirs and other inputs get ``cpu``.
    * ``unwrap`` / ``strip_prefixes`` rename the keys as ``ckptool unwrap`` / ``strip-prefix`` do.
    * ``max_shard_size`` (bytes, or ``"5GB"``, ``"2GiB"``) makes ``dst`` a folder of shards plus an index
      (``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``).
    * ``dtype`` (``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"``) casts floating tensors.
    * ``verify`` re-opens the output and compares every tensor with the source (see the module docstring).
    * ``trust`` allows globals outside the weights-only allowlist when a step loads with torch (DCP).
    * ``progress(done_bytes, total_bytes)`` is called as tensor data is written.

    Returns a :class:`ConvertResult`. The output is written atomically; ``src`` is never modified.

    Raises:
        UsageError: bad option values or combinations (``to`` for safetensors, ``key`` for a safetensors input,
            an output suffix that names no format, ``dst`` equal to ``src``), a missing output folder or shard.
        UnsupportedError: plain pickles and TorchScript archives; dtypes safetensors cannot hold (complex128,
            quantized tensors); no state_dict found.
        NotACheckpointError / CorruptCheckpointError: unreadable or damaged input.
        UnsafeCheckpointError: a DCP folder (or a torch file converted to DCP) needs globals outside the allowlist
            and ``trust`` is False.
        PrefixNotFoundError / KeyCollisionError: as :func:`ckptool.prefixes.strip_prefix`.
        VerificationError: the output does not read back as the source (it is not kept).
    """
    src_p, dst_p = os.fspath(src), os.fspath(dst)
    if isinstance(strip_prefixes, str):
        strip_prefixes = [strip_prefixes]
    shard_bytes = parse_size(max_shard_size) if max_shard_size is not None else None
    fmt_out = _output_format(dst_p, format, shard_bytes is not None)
    if dtype is not None and dtype not in CAST_TO:
        raise UsageError(f"--dtype {dtype!r}: choose one of {', '.join(CAST_TO)}")
    if to is not None and fmt_out != "torch":
        raise UsageError(f"--to sets torch location tags; {fmt_out} output carries none (load it with the device you "
                         "want instead)")
    if shard_bytes is not None and fmt_out == "dcp":
        raise UsageError("--max-shard-size does not apply to DCP output (DCP writes one file per rank)")
    if os.path.abspath(src_p) == os.path.abspath(dst_p):
        raise UsageError(f"output {dst_p} is the input; choose another -o path")
    renames: dict[str, Any] = {"unwrap": unwrap, "strip_prefixes": list(strip_prefixes)}
    if is_checkpoint_set(src_p):
        kind, set_path = _set_kind(src_p)
        if kind == "file":
            return convert(set_path, dst_p, format=format, key=key, to=to, unwrap=unwrap,
                           strip_prefixes=strip_prefixes, max_shard_size=shard_bytes, dtype=dtype, verify=verify,
                           trust=trust, progress=progress)
        if kind == "dcp":
            if fmt_out == "dcp":
                raise UsageError(f"{src_p} is already a DCP checkpoint; convert it to torch or safetensors")
            return _from_dcp(src_p, dst_p, fmt_out=fmt_out, trust=trust, kwargs=dict(
                key=key, to=to, max_shard_size=shard_bytes, dtype=dtype, verify=verify, progress=progress, **renames))
        if key is not None:
            raise UsageError(f"{src_p} is a sharded set: it holds one flat mapping of tensors, so --key does not apply")
        if fmt_out == "dcp":
            return _to_dcp(set_path, dst_p, key=None, trust=trust, verify=verify, renames=renames, cast=dtype,
                           fmt_in="sharded")
        source = _index_source(set_path)
    else:
        fmt_in = formats.detect_format(src_p)
        if fmt_in == formats.PICKLE:
            raise UnsupportedError(f"{src_p} is a plain pickle without torch storages, not a torch.save checkpoint")
        if fmt_out == "dcp":
            if fmt_in == formats.TORCHSCRIPT:
                _torch_source(src_p, fmt_in, key)  # raises the TorchScript message
            return _to_dcp(src_p, dst_p, key=key, trust=trust, verify=verify,
                           renames=renames if unwrap or strip_prefixes else {}, cast=dtype, fmt_in=fmt_in)
        if fmt_in == formats.SAFETENSORS:
            if key is not None:
                raise UsageError(f"{src_p} is safetensors: it holds one flat mapping of tensors, so --key does not "
                                 "apply")
            source = _safetensors_source(src_p)
        else:
            source = _torch_source(src_p, fmt_in, key)
    _refuse_overwriting_input(source, dst_p, shard_bytes is not None)
    res = ConvertResult(src_p, dst_p, source.format, fmt_out, key=source.key, left_out=list(source.left_out),
                        skipped=list(source.skipped), notes=list(source.notes))
    if not source.tensors:
        raise UnsupportedError(f"{src_p}: the selected state_dict holds no tensors; nothing to convert")
    res.renamed, plan = _apply_renames(source, unwrap, strip_prefixes)
    res.notes += source.notes[len(res.notes):]
    if to is not None:
        from ckptool.ops.remap import parse_device

        target = parse_device(to)
        location: Callable[[str], str] = lambda _loc: target
    else:
        location = lambda loc: loc
    if fmt_out == "safetensors" and source.sd_state is not None:
        res.notes.append("the state_dict's _metadata (module versions for load_state_dict) was not carried: "
                         "safetensors holds tensors only")
    _write_outputs(source, dst_p, fmt_out, shard_bytes, dtype, location, plan.rename_path if plan else None, verify,
                   progress, res)
    return res


# ================================================================================================ inspect
def inspect_set(path: str | os.PathLike[str]) -> Any:
    """Describe a sharded set (``*.index.json`` or the folder holding one) or a DCP folder as one checkpoint,
    without torch and without reading tensor data. Returns a :class:`ckptool.inspect.CheckpointInfo` with format
    ``sharded-safetensors`` / ``sharded-torch`` / ``dcp``.

    For a sharded set every shard is inspected and its tensors listed (storage keys prefixed by the shard file);
    ``metadata`` holds the index's ``metadata`` and shard count. For DCP the tensors come from ``.metadata``
    (names, dtypes, shapes; sizes = elements * element size; DCP records no device, so ``cpu`` is shown, where
    ``dcp_to_torch_save`` puts them); non-tensor entries are listed under ``metadata["non_tensor_entries"]``, and
    ``globals`` says which globals of ``.metadata`` ckptool accepts without ``--trust`` (:data:`DCP_GLOBALS` and the
    weights-only allowlist).

    Raises:
        UsageError: a folder that is neither; a missing shard.
        CorruptCheckpointError / NotACheckpointError: a damaged index, shard or ``.metadata``.
    """
    from ckptool.ops.inspect import (
        CheckpointInfo,
        GlobalInfo,
        StateDictInfo,
        TensorInfo,
        inspect,
    )
    from ckptool.model.keys import is_flat_param_key, shared_prefixes, suggest_command

    p = os.fspath(path)
    kind, set_path = _set_kind(p)
    if kind == "file":
        return inspect(set_path)

    def sd_info(sd_path: str, keys: list[str]) -> Any:
        pre = shared_prefixes(keys)
        return StateDictInfo(sd_path, len(keys), pre, suggest_command(pre), any(is_flat_param_key(k) for k in keys))

    if kind == "index":
        try:
            with open(set_path, encoding="utf-8") as f:
                doc = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{set_path} is not valid JSON ({e}); re-download it") from e
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict):
            raise CorruptCheckpointError(f"{set_path} has no weight_map; it is not a sharded checkpoint index")
        folder = os.path.dirname(os.path.abspath(set_path))
        tensors: list[Any] = []
        devices: dict[str, int] = {}
        storage_bytes: dict[str, int] = {}
        globs: dict[str, Any] = {}
        size = os.path.getsize(set_path)
        storages = 0
        fmts = set()
        for shard in dict.fromkeys(str(v) for v in wm.values()):
            sp = os.path.join(folder, shard)
            if not os.path.isfile(sp):
                raise UsageError(f"{set_path} lists shard {shard} but {sp} does not exist; download every shard")
            info = inspect(sp)
            fmts.add("safetensors" if info.format == formats.SAFETENSORS else "torch")
            size += info.size
            storages += info.storages
            for t in info.tensors:
                t.storage_key = f"{shard}:{t.storage_key}"
                tensors.append(t)
            for d, n in info.devices.items():
                devices[d] = devices.get(d, 0) + n
            for d, n in info.storage_bytes.items():
                storage_bytes[d] = storage_bytes.get(d, 0) + n
            for g in info.globals:
                globs.setdefault(g.name, g)
        meta = {str(k): json.dumps(v) if not isinstance(v, str) else v
                for k, v in (doc.get("metadata") or {}).items()} if isinstance(doc.get("metadata"), dict) else {}
        meta["shards"] = str(len(dict.fromkeys(wm.values())))
        fmt = "sharded-" + (fmts.pop() if len(fmts) == 1 else "mixed")
        return CheckpointInfo(set_path, fmt, "state_dict", size, tensors, devices, storage_bytes,
                              [sd_info("", [t.key for t in tensors])], list(globs.values()), storages=storages,
                              metadata=meta)
    root, names = read_dcp_metadata(set_path)
    entries = _dcp_entries(root)
    planner = _state(root).get("planner_data")
    tensors = []
    groups: dict[str, list[str]] = {}
    for fqn, dt, shape in entries:
        if dt is None:
            continue
        nb = _numel(shape or ()) * DTYPE_SIZES.get(dt, 1)
        tensors.append(TensorInfo(fqn, list(shape or ()), dt, "cpu", nb, list(_contiguous_stride(shape or ())), 0,
                                  fqn))
        comps = planner.get(fqn) if isinstance(planner, dict) else None
        if isinstance(comps, tuple) and comps:
            parent, leaf = ".".join(map(str, comps[:-1])), str(comps[-1])
        else:
            parent, leaf = "", fqn
        if not re.search(r"(^|\.)state\.\d+$", parent):  # an optimizer's per-parameter state is no state_dict
            groups.setdefault(parent, []).append(leaf)
    non_tensor = [fqn for fqn, dt, _s in entries if dt is None]
    size = sum(os.path.getsize(os.path.join(set_path, n)) for n in os.listdir(set_path)
               if os.path.isfile(os.path.join(set_path, n)))
    meta = {"non_tensor_entries": ", ".join(non_tensor)} if non_tensor else {}
    version = _state(root).get("version")
    if isinstance(version, str):
        meta["dcp_version"] = version
    sds = [sd_info(g, keys) for g, keys in groups.items()]
    kind_name = "state_dict" if len(groups) == 1 and not non_tensor else "training_checkpoint"
    nbytes = sum(t.nbytes for t in tensors)
    return CheckpointInfo(set_path, "dcp", kind_name, size, tensors, {"cpu": len(tensors)} if tensors else {},
                          {"cpu": nbytes} if tensors else {}, sds,
                          [GlobalInfo(n, _dcp_allowed(n)) for n in dict.fromkeys(names)], storages=len(tensors),
                          metadata=meta or None)
