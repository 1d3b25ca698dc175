"""Reading a ``torch.distributed.checkpoint`` (DCP) folder's tensors without torch: a
:class:`~ckptool.formats.tensors.Source` whose storages point at the tensor bytes inside the ``.distcp`` files.

``.metadata`` (:func:`ckptool.formats.dcp.read_dcp_metadata`, ckptool's restricted unpickler) lists each tensor
entry with its dtype, size and ``chunks`` (``ChunkStorageMetadata``: offsets and sizes in the whole tensor, one per
rank that held a piece), and ``storage_data`` maps each chunk (``MetadataIndex(fqn, offsets)``) to a
``_StorageInfo``: ``length`` bytes at ``offset`` of a ``.distcp`` file. DCP's ``FileSystemWriter`` writes each
chunk there as a ``torch.save`` record (a small torch zip holding the chunk as one tensor), which
``FileSystemReader`` reads back with ``torch.load(weights_only=True)`` and copies into place
(torch/distributed/checkpoint/filesystem.py ``_write_item`` / ``read_data``). Here each record's zip directory and
``data.pkl`` are read as a node graph (nothing imported or run; every global it names must be on torch's
``weights_only`` allowlist, and the graph must be one plain tensor matching ``.metadata``), and the tensor becomes
a :class:`~ckptool.formats.tensors.Tensor` over the record's data bytes:

* a tensor stored whole (one chunk) is the record's own view (strides and storage offset as saved);
* a tensor in several chunks is gathered from the records' bytes (``segments``, :mod:`ckptool.formats.segments`):
  a chunk of whole rows (sharded along the first dimension, as FSDP does) is one contiguous run of the whole
  tensor, a chunk that splits a later dimension (Megatron's row-parallel weights, split along dimension 1) one run
  per index of the dimensions before it (one per row of a 2-D weight), the runs of all chunks put in row-major
  order.

Non-tensor entries (``BytesStorageMetadata``: pickles DCP loads with ``torch.load(weights_only=False)``) are never
read: they are listed in ``skipped`` (:data:`NON_TENSOR`). Which entries are read follows ``convert``: the nesting
``planner_data`` records (``{"model": {...}, "optim": {...}}``, as ``dcp_to_torch_save`` rebuilds it) is searched
for the state_dict (:func:`ckptool.readers.read_torch.select_state_dict`), or ``key`` selects one, ``""`` the
whole folder (every tensor by its fully qualified name).

The record helpers (:class:`RecordSlice`, :func:`open_record`, :func:`torch_save_record`) are shared with
``convert``'s copy of a DCP folder into one torch file (:mod:`ckptool.ops.convert.dcp`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, BinaryIO

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError
from ckptool.formats.dcp import DcpEntry, DcpMetadata, read_dcp_metadata
from ckptool.formats.dtypes import DTYPE_SIZES, contiguous_stride, element_size, numel, storage_nbytes, tensor_dtype
from ckptool.formats.nodes import (
    REBUILD_TENSOR_V2,
    REBUILD_TENSOR_V3,
    PickledObject,
    ReduceNode,
    TensorNode,
    qualified_name,
)
from ckptool.formats.tensors import Segment, Source, Storage, Tensor, is_contiguous, span
from ckptool.formats.torchfile import read_byteorder
from ckptool.formats.unpickler import load_structure
from ckptool.formats.zipdir import ZipEntry, data_offset, read_directory, read_member
from ckptool.model.allowlist import ALLOWED, classify_global
from ckptool.model.graph import join
from ckptool.model.tensor_nodes import tensor_node
from ckptool.readers.budget import ExpandBudget
from ckptool.readers.read_torch import describe, select_state_dict
from ckptool.readers.reader import Reader

if TYPE_CHECKING:
    from ckptool.readers import Opened

__all__ = [
    "FORMAT",
    "NON_TENSOR",
    "OpaqueEntry",
    "RecordSlice",
    "check_metadata_globals",
    "check_records",
    "chunk_infos",
    "dcp_source",
    "dcp_tree",
    "entry_chunks",
    "entry_dtype",
    "node_state",
    "open_record",
    "read_chunk",
    "size_ints",
    "torch_save_record",
]

FORMAT = "dcp"
#: what ``skipped`` says of a non-tensor entry (``"<name>: " + NON_TENSOR``)
NON_TENSOR = "non-tensor entry of the DCP folder (a pickle, not read)"
_CONVERT = ("`ckptool convert {folder} -o model.pt` reads it with torch's own DCP reader (once ckptool's safety check "
            "passes), then run the command on that file")
_ZIP_HEAD = b"PK\x03\x04"


# ------------------------------------------------------------------------------------------------ records
class RecordSlice:
    """``length`` bytes at ``offset`` of the open file ``f``, as a seekable file of their own (a DCP record)."""

    def __init__(self, f: BinaryIO, offset: int, length: int) -> None:
        self.f, self.start, self.size, self.pos = f, offset, length, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, min(self.size, pos if whence == 0 else self.pos + pos if whence == 1 else self.size + pos))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n < 0 else min(n, self.size - self.pos)
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data


def node_state(node: Any) -> Any:
    """The BUILD state of a pickled object node (``.metadata``'s records are dataclasses: a dict), else None."""
    return node.state if isinstance(node, PickledObject) else None


def size_ints(node: Any) -> tuple[int, ...] | None:
    """A ``torch.Size`` node (``torch.Size((3, 4))``) or a plain tuple as ints, else None."""
    v = node.args[0] if isinstance(node, ReduceNode) and node.args else node
    return tuple(v) if isinstance(v, (tuple, list)) and all(type(x) is int for x in v) else None


def open_record(files: dict[str, BinaryIO], folder: str, info: Any) -> tuple[BinaryIO, RecordSlice] | None:
    """The open ``.distcp`` file (opened once into ``files``, closed by the caller) and the slice of one storage
    record ``info`` (a ``_StorageInfo`` node); None when the record is transformed (``transform_descriptors``), or
    malformed, or names a file outside ``folder``."""
    sst = node_state(info)
    if type(sst) is not dict or sst.get("transform_descriptors"):
        return None
    rel, off, length = sst.get("relative_path"), sst.get("offset"), sst.get("length")
    if not isinstance(rel, str) or type(off) is not int or type(length) is not int or os.path.isabs(rel) \
            or os.path.normpath(rel).startswith(".."):
        return None
    if rel not in files:
        files[rel] = source.open_regular(os.path.join(folder, rel), "a file .metadata names")  # closed by the caller
    f = files[rel]
    return f, RecordSlice(f, off, length)


def torch_save_record(blob: RecordSlice, what: str,
                      globals_out: list[str] | None = None) -> tuple[Any, dict[str, Any], list[Any]]:
    """``(root node, storages, directory)`` of the ``torch.save`` zip in ``blob``, its ``data.pkl`` read with the
    restricted unpickler (nothing imported or run); the qualified names of the globals it names are appended to
    ``globals_out`` when given.

    Raises:
        CorruptCheckpointError: not a ``torch.save`` zip, or damaged.
    """
    entries = read_directory(blob, blob.size, what)  # type: ignore[arg-type]
    pkl = next((e for e in entries if e.name.endswith("/data.pkl") or e.name == "data.pkl"), None)
    if pkl is None:
        raise CorruptCheckpointError(f"{what} is not a torch.save record")
    storages: dict[str, Any] = {}
    root, up = load_structure(read_member(blob, pkl, what), what, storages=storages)  # type: ignore[arg-type]
    if globals_out is not None:
        globals_out += [qualified_name(m, n) for m, n in up.globals_seen]
    return root, storages, entries


def record_byteorder(blob: RecordSlice, entries: list[ZipEntry], what: str) -> str:
    """The byte order of the ``torch.save`` record in ``blob`` (its zip directory ``entries``): what its
    ``byteorder`` record holds (:func:`ckptool.formats.torchfile.read_byteorder`), ``"little"`` without one.

    Raises:
        CorruptCheckpointError: a ``byteorder`` record holding neither ``little`` nor ``big``.
    """
    order = next((x for x in entries if x.name.endswith("/byteorder")), None)
    return "little" if order is None else read_byteorder(blob, order, what)


# ------------------------------------------------------------------------------------------------ the tree
class OpaqueEntry:
    """A non-tensor entry of a DCP folder in :func:`dcp_tree` (its pickle is not read)."""

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn

    def __repr__(self) -> str:
        return f"<{NON_TENSOR}: {self.fqn}>"


def _path(meta: DcpMetadata, fqn: str) -> tuple[str, ...]:
    """Where ``planner_data`` puts ``fqn`` in the nested state (its components as strings), else ``(fqn,)``."""
    p = (meta.planner_data or {}).get(fqn)
    if isinstance(p, (tuple, list)) and p and all(type(c) in (str, int) for c in p):
        return tuple(map(str, p))
    return (fqn,)


def dcp_tree(meta: DcpMetadata) -> dict[str, Any]:
    """The nested state of a DCP folder as a node graph, as ``dcp_to_torch_save`` rebuilds it from
    ``planner_data``: a dict per level, a contiguous tensor node per tensor entry (no record read), a
    :class:`OpaqueEntry` per non-tensor entry. What :func:`~ckptool.readers.read_torch.select_state_dict`
    searches, so that a DCP folder's state_dict is chosen as in a torch file.

    Raises:
        CorruptCheckpointError: ``planner_data`` puts an entry inside another entry.
        UnsupportedError: a tensor entry of a dtype ckptool does not know.
    """
    root: dict[str, Any] = {}
    for i, e in enumerate(meta.entries):
        path = _path(meta, e.fqn)
        where = root
        for c in path[:-1]:
            nxt = where.setdefault(c, {})
            if not isinstance(nxt, dict):
                raise CorruptCheckpointError(f"{meta.folder}: .metadata's planner_data puts {e.fqn!r} inside another "
                                             "entry; the folder is damaged")
            where = nxt
        if path[-1] in where:
            raise CorruptCheckpointError(f"{meta.folder}: .metadata's planner_data puts two entries at "
                                         f"{'.'.join(path)!r}; the folder is damaged")
        if e.dtype is None:
            where[path[-1]] = OpaqueEntry(e.fqn)
        else:
            shape = e.shape or ()
            where[path[-1]] = tensor_node(str(i), entry_dtype(meta, e), shape, contiguous_stride(shape))
    return root


def entry_dtype(meta: DcpMetadata, e: DcpEntry) -> str:
    """The dtype name of tensor entry ``e`` as ``.metadata`` gives it.

    Raises:
        UnsupportedError: a dtype ckptool cannot read (with the convert route).
    """
    if e.dtype not in DTYPE_SIZES:
        raise UnsupportedError(f"{meta.folder}: tensor {e.fqn!r} has dtype {e.dtype}, which ckptool cannot read; "
                               + _CONVERT.format(folder=meta.folder))
    return e.dtype


def _left_out(tree: dict[str, Any], keys: list[str]) -> list[str]:
    """``"name: description"`` of every entry beside the one each key of ``keys`` follows, level by level."""
    out: list[str] = []
    node, prefix = tree, ""
    for k in keys:
        for name, v in node.items():
            if name != k:
                out.append(f"{join(prefix, name)}: {NON_TENSOR if isinstance(v, OpaqueEntry) else describe(v)}")
        node, prefix = node[k], join(prefix, k)
    return out


# ------------------------------------------------------------------------------------------------ the source
def check_metadata_globals(meta: DcpMetadata, also: frozenset[str] = frozenset()) -> None:
    """Refuse a ``.metadata`` naming a global that ``ckptool scan`` does not allow there (DCP's own record classes
    and paths: :func:`ckptool.model.allowlist.classify_global` with ``dcp_metadata=True``) nor ``also`` names (the
    records a layout built on DCP adds: Megatron-Core's cached save plans), as ``convert`` does before torch reads
    the folder; nothing of it is run here either way."""
    bad = sorted({g for g in meta.globals if g not in also and classify_global(g, dcp_metadata=True)[0] != ALLOWED})
    if bad:
        raise UnsafeCheckpointError(
            f"{meta.folder}: .metadata names {', '.join(bad[:5])}{' and more' if len(bad) > 5 else ''}, which "
            "torch.distributed.checkpoint never writes there; ckptool reads no tensor of it. `ckptool scan "
            f"{meta.folder}` says more", bad)


def chunk_infos(meta: DcpMetadata) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """``(fqn, chunk offsets) -> _StorageInfo node`` from ``storage_data`` (as DCP looks records up: by
    ``MetadataIndex`` equality, which ignores its ``index``)."""
    st = node_state(meta.root)
    data = st.get("storage_data") if type(st) is dict else None
    if type(data) is not dict:
        raise CorruptCheckpointError(f"{meta.folder}: .metadata has no storage_data dict; the folder is damaged")
    out: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for idx, info in data.items():
        ist = node_state(idx)
        if type(ist) is dict and type(ist.get("fqn")) is str:
            out[(ist["fqn"], size_ints(ist.get("offset")))] = info
    return out


def entry_chunks(meta: DcpMetadata, e: DcpEntry) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of each chunk of tensor entry ``e``, checked to lie inside the tensor.

    Raises:
        CorruptCheckpointError: a malformed chunk, or one outside the tensor.
    """
    st = node_state(meta.root)
    md = node_state(st["state_dict_metadata"].get(e.fqn))
    listed = md.get("chunks") if type(md) is dict else None
    shape = e.shape or ()
    out = []
    for c in listed if isinstance(listed, list) else [None]:
        cst = node_state(c)
        offsets = size_ints(cst.get("offsets")) if type(cst) is dict else None
        sizes = size_ints(cst.get("sizes")) if type(cst) is dict else None
        if (offsets is None or sizes is None or len(offsets) != len(shape) or len(sizes) != len(shape)
                or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape))):
            raise CorruptCheckpointError(f"{meta.folder}: tensor {e.fqn!r} {list(shape)} has a malformed chunk "
                                         f"(offsets {offsets}, sizes {sizes}) in .metadata; the folder is damaged")
        out.append((offsets, sizes))
    return out


def record_in_file(files: dict[str, BinaryIO], meta: DcpMetadata, info: Any, what: str) -> RecordSlice:
    """The record the ``_StorageInfo`` node ``info`` names (:func:`open_record`), checked to lie inside its
    ``.distcp`` file; ``what`` names it in the errors.

    Raises:
        UnsupportedError: a record DCP transformed (with the convert route).
        CorruptCheckpointError: a file that cannot be read, a malformed record or one naming a file outside the
            folder, one past the end of its file.
    """
    folder = meta.folder
    try:
        found = open_record(files, folder, info)
    except OSError as ex:
        raise CorruptCheckpointError(f"{what} is in {os.path.basename(str(ex.filename))}, which cannot be read "
                                     f"({ex.strerror}); the folder is incomplete") from None
    if found is None:
        sst = node_state(info)
        if type(sst) is dict and sst.get("transform_descriptors"):
            raise UnsupportedError(f"{what} is transformed by DCP ({sst.get('transform_descriptors')!r}); ckptool "
                                   "does not undo that: " + _CONVERT.format(folder=folder))
        raise CorruptCheckpointError(f"{what} is malformed or names a file outside the folder; the folder is "
                                     "damaged or was crafted")
    f, blob = found
    size = f.seek(0, os.SEEK_END)  # any reader (a test's faulty one too), not only a file with a descriptor
    if blob.start < 0 or blob.size < 0 or blob.start + blob.size > size:
        raise CorruptCheckpointError(f"{what} runs past the end of its file ({blob.start} + {blob.size} > {size} "
                                     "bytes); the folder is truncated or damaged")
    return blob


def read_chunk(files: dict[str, BinaryIO], meta: DcpMetadata, e: DcpEntry, dtype: str, sizes: tuple[int, ...],
                info: Any) -> Tensor:
    """Read the ``torch.save`` record ``info`` of one chunk (``sizes``) of tensor ``e`` as a node graph and check
    it holds one plain tensor of ``dtype`` and that shape, naming only allowlisted globals. Returns the chunk as a
    :class:`Tensor` (named ``e.fqn``) over its record's data bytes: a :class:`Storage` with the record's CRC-32
    when it holds exactly those bytes, or, when the record is big-endian, one byte-swapped :class:`Segment`.

    Raises:
        UnsupportedError: a record DCP transformed, or that is no torch zip (a folder saved in safetensors
            serialization), or a compressed one.
        UnsafeCheckpointError: the record names a global outside torch's weights_only allowlist.
        CorruptCheckpointError: anything else that does not match ``.metadata``.
    """
    folder = meta.folder
    what = f"{folder}: the record of {e.fqn!r}"
    blob = record_in_file(files, meta, info, what)
    if blob.read(4) != _ZIP_HEAD:
        raise UnsupportedError(f"{what} is not a torch.save record (a folder saved in DCP's safetensors "
                               "serialization?); ckptool reads torch.save records only: "
                               + _CONVERT.format(folder=folder))
    names: list[str] = []
    node, storages, entries = torch_save_record(blob, what, names)
    bad = sorted({g for g in names if classify_global(g)[0] != ALLOWED})
    if bad:
        raise UnsafeCheckpointError(f"{what} names {', '.join(bad[:5])}, outside torch.load(weights_only=True)'s "
                                    f"allowlist: not a tensor record DCP writes; `ckptool scan {folder}` says more",
                                    bad)
    if (not isinstance(node, TensorNode) or (node.func.module, node.func.name) not in (
            REBUILD_TENSOR_V2, REBUILD_TENSOR_V3) or node.storage is None or len(storages) != 1):
        raise CorruptCheckpointError(f"{what} is not one plain tensor; the folder is damaged or was crafted")
    ref = node.storage
    if tensor_dtype(node) != dtype or node.shape != sizes:
        raise CorruptCheckpointError(f"{what} holds a {tensor_dtype(node)} tensor {list(node.shape)} where .metadata "
                                     f"says {dtype} {list(sizes)}; the folder is damaged")
    rec = next((x for x in entries if x.name.endswith(f"/data/{ref.key}")), None)
    if rec is None:
        raise CorruptCheckpointError(f"{what} has no data/{ref.key} member; the folder is damaged")
    return _chunk_bytes(blob, entries, rec, node, storage_nbytes(ref), dtype, what, e.fqn)


def check_records(meta: DcpMetadata, max_expand: float | None, doing: str) -> None:
    """Check every tensor chunk of the folder before torch reads any: its record read as a node graph
    (:func:`read_chunk`: inside its ``.distcp`` file, one plain tensor of the dtype and chunk size ``.metadata``
    gives, naming only allowlisted globals), the chunks of each tensor holding at least its declared elements, and
    the dense bytes of the records' views within ``max_expand`` times their storages' bytes
    (:class:`~ckptool.readers.budget.ExpandBudget`; ``doing`` says what the command would do): a ``.metadata``
    cannot make torch allocate what the records do not hold (``torch.empty`` of a declared size, a stride-0 view
    made dense).

    Raises:
        UnsupportedError: over the budget (naming ``--max-expand``); a record DCP transformed, or not a torch zip.
        UnsafeCheckpointError / CorruptCheckpointError: as :func:`read_chunk`; a chunk without a record, chunks
            holding fewer elements than their tensor.
    """
    infos = chunk_infos(meta)
    budget = ExpandBudget(max_expand, meta.folder, doing)
    files: dict[str, BinaryIO] = {}
    try:
        for e in meta.entries:
            if e.dtype is None:
                continue
            dtype, shape, covered = entry_dtype(meta, e), e.shape or (), 0
            for offsets, sizes in entry_chunks(meta, e):
                info = infos.get((e.fqn, offsets))
                if info is None:
                    raise CorruptCheckpointError(f"{meta.folder}: the chunk of {e.fqn!r} at offsets {list(offsets)} "
                                                 "has no record in .metadata's storage_data; the folder is damaged")
                budget.add([read_chunk(files, meta, e, dtype, sizes, info)])
                covered += numel(sizes)
            if covered < numel(shape):
                raise CorruptCheckpointError(f"{meta.folder}: the chunks of {e.fqn!r} {list(shape)} do not cover it "
                                             f"once (they hold {covered} of its {numel(shape)} elements); the folder "
                                             "is damaged")
    finally:
        for fh in files.values():
            fh.close()
    budget.check()


def _chunk_bytes(blob: RecordSlice, entries: list[ZipEntry], rec: ZipEntry, node: TensorNode, nbytes: int,
                 dtype: str, what: str, fqn: str) -> Tensor:
    """Where the data of the record ``rec`` lies in the ``.distcp`` file, checked to hold the view ``node``."""
    if rec.method != 0:
        raise UnsupportedError(f"{what}: member {rec.name} is compressed, which torch.save never writes; ckptool "
                               "does not inflate records")
    start = data_offset(blob, rec, what)  # type: ignore[arg-type]
    if rec.file_size < nbytes or start + nbytes > blob.size or nbytes % element_size(dtype):
        raise CorruptCheckpointError(f"{what}: its storage of {nbytes} bytes does not fit member {rec.name} "
                                     f"({rec.file_size} bytes); the folder is damaged")
    stride = tuple(node.stride)
    lo, hi = span(node.storage_offset, node.shape, stride)
    if len(stride) != len(node.shape) or any(s < 0 for s in stride) or lo < 0 or hi > nbytes // element_size(dtype):
        raise CorruptCheckpointError(f"{what}: its view (offset {node.storage_offset}, stride {list(stride)}) runs "
                                     "past its storage; the folder is damaged")
    swap = element_size(dtype) if record_byteorder(blob, entries, what) == "big" else 0
    path, offset = str(blob.f.name), blob.start + start
    crc = rec.crc if rec.file_size == nbytes and not swap else None
    st = Storage(path, offset, nbytes, dtype, "cpu", crc, segments=[Segment(path, offset, nbytes, swap=swap)]
                 if swap else None)
    return Tensor(fqn, fqn, dtype, tuple(node.shape), stride, node.storage_offset, st)


def _runs(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> tuple[list[int], int]:
    """``(starts, length)``: the chunk's elements as runs of ``length`` elements contiguous in the whole tensor
    (row-major), each run's first element's index in it, in the chunk's own row-major order. A chunk of whole rows
    (FSDP's dimension-0 shards) is one run; a chunk that splits a later dimension (tensor parallelism's
    row-parallel weights, split along dimension 1) is one run per index of the dimensions before the last one it
    splits."""
    j = max((i for i, (s, n) in enumerate(zip(sizes, shape)) if s != n), default=-1)
    if j < 0:
        return [0], numel(shape)
    strides = contiguous_stride(shape)
    length = sizes[j] * strides[j]
    starts = [sum(o * st for o, st in zip(offsets, strides))]
    for d in range(j):  # every index of the outer dimensions, row-major: the chunk's own order
        starts = [s + k * strides[d] for s in starts for k in range(sizes[d])]
    return starts, length


def _tensor(files: dict[str, BinaryIO], meta: DcpMetadata, infos: dict[Any, Any], e: DcpEntry, name: str,
            index: int) -> Tensor:
    """Tensor entry ``e`` as a :class:`Tensor` named ``name``: the record's view when it is stored whole, else its
    chunks gathered in row-major order (see the module docstring)."""
    dtype, shape = entry_dtype(meta, e), e.shape or ()
    es = element_size(dtype)
    chunks = entry_chunks(meta, e)

    def record(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Tensor:
        info = infos.get((e.fqn, offsets))
        if info is None:
            raise CorruptCheckpointError(f"{meta.folder}: the chunk of {e.fqn!r} at offsets {list(offsets)} has no "
                                         "record in .metadata's storage_data; the folder is damaged")
        return read_chunk(files, meta, e, dtype, sizes, info)

    if len(chunks) == 1 and chunks[0] == ((0,) * len(shape), shape):
        c = record(*chunks[0])
        return Tensor(name, e.fqn, dtype, shape, c.stride, c.offset, c.storage, False, index)
    runs: list[tuple[int, int, Segment]] = []
    for offsets, sizes in chunks:
        n = numel(sizes)
        if not n:
            continue
        c = record(offsets, sizes)
        if not is_contiguous(sizes, c.stride):
            raise UnsupportedError(f"{meta.folder}: the chunk of {e.fqn!r} at offsets {list(offsets)} is saved as a "
                                   "non-contiguous view; ckptool gathers contiguous chunks only: "
                                   + _CONVERT.format(folder=meta.folder))
        swap = c.storage.segments[0].swap if c.storage.segments else 0
        base = c.storage.offset + c.offset * es
        starts, length = _runs(offsets, sizes, shape)
        runs += [(start, length, Segment(c.storage.path, base + i * length * es, length * es, swap=swap))
                 for i, start in enumerate(starts)]
    runs.sort(key=lambda r: r[0])
    pos = 0
    for start, n, _seg in runs:
        if start != pos:
            break
        pos += n
    if pos != numel(shape):
        raise CorruptCheckpointError(f"{meta.folder}: the chunks of {e.fqn!r} {list(shape)} do not cover it once "
                                     f"(a gap or an overlap at element {pos}); the folder is damaged")
    segs = [r[2] for r in runs]
    st = Storage(segs[0].path if segs else meta.folder, segs[0].offset if segs else 0, numel(shape) * es, dtype,
                 "cpu", segments=segs or None)
    return Tensor(name, e.fqn, dtype, shape, contiguous_stride(shape), 0, st, False, index)


def dcp_source(folder: str | os.PathLike[str], key: str | None = None, meta: DcpMetadata | None = None,
               also: frozenset[str] = frozenset()) -> Source:
    """The tensors of the DCP folder ``folder`` as a :class:`Source` (format ``"dcp"``): the state_dict
    ``convert`` converts from it (found in the ``planner_data`` nesting by
    :func:`~ckptool.readers.read_torch.select_state_dict`, named relative to it), or with ``key`` the mapping at
    that dotted path, ``""`` every tensor of the folder by its fully qualified name. Each storage is the byte range
    of the tensor's data in a ``.distcp`` file (or ``segments`` of several, for a tensor saved in row chunks); no
    tensor bytes are read. Non-tensor entries of the selection go to ``skipped``, the other entries to
    ``left_out``. ``meta``: the folder's ``.metadata`` already read (:meth:`ckptool.readers.Opened.dcp_metadata`);
    ``also``: globals ``.metadata`` may name besides DCP's own (:func:`check_metadata_globals`).

    Raises:
        UsageError / UnsupportedError: see :func:`~ckptool.readers.read_torch.select_state_dict`; chunks that are
            that are not contiguous views, transformed or compressed records, a folder not saved as ``torch.save``
            records.
        UnsafeCheckpointError: ``.metadata`` or a tensor record names a global outside what ``ckptool scan``
            allows there (nothing is run either way).
        CorruptCheckpointError: a damaged ``.metadata``, a record that does not match it or lies outside its file.
    """
    meta = meta if meta is not None else read_dcp_metadata(folder)
    check_metadata_globals(meta, also)
    tree = dcp_tree(meta)
    sd = select_state_dict(tree, key, meta.folder)
    keys = [str(link.key) for link in sd.trail]
    src = Source(meta.folder, FORMAT, [], key=sd.path, left_out=_left_out(tree, keys))
    infos = chunk_infos(meta)
    files: dict[str, BinaryIO] = {}
    try:
        for e in meta.entries:
            path = _path(meta, e.fqn)
            if list(path[:len(keys)]) != keys:
                continue
            name = ".".join(path[len(keys):]) if keys else e.fqn
            if e.dtype is None:
                src.skipped.append(f"{name}: {NON_TENSOR}")
            else:
                src.tensors.append(_tensor(files, meta, infos, e, name, len(src.tensors)))
    finally:
        for fh in files.values():
            fh.close()
    return src


class DcpReader(Reader):
    """A ``torch.distributed.checkpoint`` folder (the registry's ``reader``): its tensors in the nesting its
    ``planner_data`` records, non-tensor entries never unpickled."""

    def __init__(self, opened: Opened) -> None:
        super().__init__(opened)
        self._tree: dict[str, Any] | None = None
        self._meta: DcpMetadata | None = None

    def tensors(self, key: str | None, tag: str | None, exclude_frozen: bool) -> Source:
        """:func:`dcp_source` over its ``.metadata``, read once (:meth:`~ckptool.readers.Opened.dcp_metadata`)."""
        return dcp_source(self.opened.target, key, self.dcp_metadata())

    def dcp_metadata(self) -> DcpMetadata:
        """The folder's ``.metadata`` (:func:`ckptool.formats.dcp.read_dcp_metadata`, restricted unpickler), read
        once."""
        if self._meta is None:
            self._meta = read_dcp_metadata(self.opened.target)
        return self._meta

    def tree(self) -> dict[str, Any]:
        """The ``planner_data`` nesting (:func:`dcp_tree`), built once."""
        if self._tree is None:
            self._tree = dcp_tree(self.dcp_metadata())
        return self._tree
