"""Writing ``convert``'s output files: safetensors (header and data block) and torch zip checkpoints.

Memory stays bounded by the largest storage: bytes that need no change are copied from the source by range
(``os.copy_file_range`` where the kernel offers it); only a storage that is cast, assembled from pieces or stored
contiguous from a strided view is materialised with torch (:class:`ckptool.torch_ops.cast.FlatCache`).
Every file is written atomically (:func:`ckptool._fileio.atomic_output`).
"""

from __future__ import annotations

import contextlib
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TypeVar

from ckptool._commit import unmark_committed
from ckptool._fileio import WriteBehind, atomic_output, copy_range, copy_range_crc, write_behind_for
from ckptool.formats.dtypes import DTYPE_SIZES, ST_CODES
from ckptool.formats.nodes import StorageRef
from ckptool.formats.tensors import Storage, Tensor, is_contiguous
from ckptool.model.casts import CastCount, refuse_overflow
from ckptool.model.graph import mapping_items, ordered_dict_node
from ckptool.model.keys import rename_metadata_items
from ckptool.model.tensor_nodes import storage_ref, view_node
from ckptool.ops.convert.evidence import SourceEvidence
from ckptool.ops.convert.plan import Unit, shared_metadata
from ckptool.ops.convert.report import ConvertResult
from ckptool.ops.convert.source import out_dtype
from ckptool.readers.data import FileRanges, read_range
from ckptool.readers.structures import SHARED_KEY, ConcatenatedFile, gather
from ckptool.torch_ops.cast import FlatCache, tensor_buffer
from ckptool.writers.encoders import TorchZipWriter, dumps, encode_header

#: dtype name -> legacy storage class ``torch.save`` names with ``_rebuild_tensor_v2`` (torch/storage.py); other
#: dtypes are written as ``_rebuild_tensor_v3`` over an ``UntypedStorage``, as torch does for uint16, float8...

#: bytes written at a time when a strided view is gathered into contiguous order
_GATHER_CHUNK = 8 << 20

W = TypeVar("W")


class Files(FileRanges):
    """Source files opened by path, read by range (closed by :meth:`close`), every range read recorded in
    :attr:`evidence` (:class:`~ckptool.readers.data.FileRanges` plus the record)."""

    def __init__(self) -> None:
        super().__init__()
        #: every source range read into an output, for verification against independent evidence
        self.evidence = SourceEvidence()
        #: id(storage) -> (storage, what its cast did to its values), for the cast report (``convert --dtype``)
        self.cast_counts: dict[int, tuple[Storage, CastCount]] = {}

    def read(self, path: str, offset: int, n: int) -> bytearray:
        """``n`` bytes at ``offset`` of ``path``, recorded as evidence.

        Raises:
            CorruptCheckpointError: the file ends first.
        """
        buf = super().read(path, offset, n)
        self.evidence.saw(path, offset, n, zlib.crc32(buf))
        return buf

    def storage(self, st: Storage) -> tuple[BinaryIO, int]:
        """The file to read ``st``'s bytes from and their offset in it (a :class:`ConcatenatedFile` over
        ``st.segments``, offset 0, for a storage gathered from several files)."""
        if st.segments is None:
            return self.get(st.path), st.offset
        return ConcatenatedFile(st.segments, self.read), 0  # type: ignore[return-value]  # seek/read/readinto suffice

    def storage_bytes(self, st: Storage, offset: int, n: int) -> bytes | bytearray:
        """``n`` bytes at byte ``offset`` of storage ``st`` (through its segments when it has them: gathered from
        several files, or byte-swapped): :func:`ckptool.readers.data.read_range` over :meth:`read`.

        Raises:
            CorruptCheckpointError: the file ends first.
        """
        return read_range(st, offset, n, self.read)  # every range through self.read: recorded as evidence

    def cache(self, cast: str | None) -> FlatCache:
        """A :class:`FlatCache` reading from these files, casting floating storages to ``cast`` and recording what
        each cast did in :attr:`cast_counts`."""
        return FlatCache(self.read, lambda dtype: out_dtype(dtype, cast), self._counted)

    def _counted(self, st: Storage, count: CastCount) -> None:
        self.cast_counts[id(st)] = (st, count)  # by storage: a storage cast twice is counted once

    def refuse_overflow(self, tensors: list[Tensor], where: str) -> None:
        """Raise when a storage of ``tensors`` was cast with values made ``inf`` / NaN (named by its first tensor):
        :func:`ckptool.model.casts.refuse_overflow`."""
        counts: dict[int, tuple[str, CastCount]] = {}
        for t in tensors:
            got = self.cast_counts.get(id(t.storage))
            if got is not None:
                counts.setdefault(id(t.storage), (t.name, got[1]))
        refuse_overflow(dict(counts.values()), where)


@dataclass
class Written:
    """What one output file holds, for verification: ``expect`` = ``[(name, dtype, shape, crc or None)]`` of the
    stored tensors, ``metadata`` the ``__metadata__`` written, ``tensors`` every output tensor (aliases included)."""

    expect: list[tuple[str, str, tuple[int, ...], int | None]]
    metadata: dict[str, str] | None
    tensors: list[Tensor]
    units: list[Unit]
    nbytes: int = 0
    records: dict[str, int] = field(default_factory=dict)  # torch output: record name -> CRC-32
    entries: dict[str, Any] = field(default_factory=dict)  # torch output: the plain entries beside the tensors


def write_safetensors(out: BinaryIO, plan: list[Unit], base_meta: dict[str, str] | None, files: Files,
                      cast: str | None, progress: Callable[[int], None] | None, res: ConvertResult,
                      need_crc: bool = True, allow_overflow: bool = False) -> Written:
    """Write the units of ``plan`` as one safetensors file into the open binary file ``out``.

    Header keys follow state_dict order; data is laid out by element size (largest first), so every tensor starts
    on a multiple of its element size, as the safetensors writer does. Tensor bytes that need no change are copied
    by the kernel when their CRC-32 is known from the source zip (a tensor filling its storage record) or
    ``need_crc`` is False; otherwise they pass through an 8 MiB buffer that computes it.

    Raises:
        UnsupportedError: the ``cast`` made ``inf`` or NaN from finite values, unless ``allow_overflow`` (after the
            data is written, so every such tensor is named; the file is not kept).
    """
    members = sorted((t for u in plan for t in u.members), key=lambda t: t.index)
    meta = _safetensors_metadata(plan, {id(t): i for i, t in enumerate(members)}, base_meta)
    stored = [(u, t) for u in plan for t in u.stored]
    layout = sorted(stored, key=lambda ut: (-DTYPE_SIZES[ut[0].dtype], ut[0].first, ut[1].index))
    offsets: dict[int, tuple[int, int]] = {}
    pos = 0
    for u, t in layout:
        n = t.numel * DTYPE_SIZES[u.dtype]
        offsets[id(t)] = (pos, pos + n)
        pos += n
    entries = {t.name: {"dtype": ST_CODES[u.dtype], "shape": list(t.shape), "data_offsets": list(offsets[id(t)])}
               for u, t in sorted(stored, key=lambda ut: ut[1].index)}
    head = encode_header(entries, meta or None)
    out.write(head)
    out.flush()
    behind = write_behind_for(out)  # one for the whole data block: tensors smaller than its window add up
    cache = files.cache(cast)
    crcs: dict[int, int | None] = {}
    for u, t in layout:
        crcs[id(t)] = _write_safetensors_data(out, u, t, files, cache, need_crc, behind, res)
        if behind is not None:  # bytes written through Python (gathered, cast): their write-back starts too
            out.flush()
            behind.written(out.tell())
        if progress:
            progress(t.numel * DTYPE_SIZES[u.dtype])
    if not allow_overflow:
        files.refuse_overflow(members, res.src)
    w = Written([], meta or None, members, plan, nbytes=len(head) + pos)
    for u, t in stored:
        w.expect.append((t.name, u.dtype, t.shape, crcs[id(t)]))
    for u in plan:
        for t in u.members:
            k = u.aliases.get(id(t))
            if k is not None:
                res.aliases[t.name] = k.name
    return w


def _safetensors_metadata(plan: list[Unit], positions: dict[int, int],
                          base_meta: dict[str, str] | None) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors output: ``base_meta``, the shared-tensor record
    (:func:`~ckptool.ops.convert.plan.shared_metadata`; ``positions`` = output index by ``id(tensor)``), each
    dropped alias name -> kept name, and ``format: pt`` whenever anything else is there; {} for none."""
    meta: dict[str, str] = dict(base_meta or {})
    shared = shared_metadata(plan, positions)
    if shared is not None:
        meta[SHARED_KEY] = shared
    for u in plan:
        for t in u.members:
            k = u.aliases.get(id(t))
            if k is not None and (k.offset, k.shape, k.stride) == (t.offset, t.shape, t.stride):
                meta.setdefault(t.name, k.name)  # safetensors.torch.save_model's record of a dropped name
    if meta:
        meta.setdefault("format", "pt")  # transformers requires it whenever metadata is present
    return meta


def _write_safetensors_data(out: BinaryIO, u: Unit, t: Tensor, files: Files, cache: FlatCache, need_crc: bool,
                            behind: WriteBehind | None, res: ConvertResult) -> int | None:
    """Write the data of tensor ``t`` (of unit ``u``) at the position of ``out``: copied by range when it needs no
    change, gathered from a strided view without torch, else cast / assembled with torch (``cache``). Returns its
    CRC-32, or None where it was copied without one (``need_crc`` False and none known from the source)."""
    esize = DTYPE_SIZES[u.dtype]
    st = t.storage
    crc: int | None
    if u.dtype == t.dtype and st.pieces is None and st.scaled is None and is_contiguous(t.shape, t.stride):
        whole = t.offset == 0 and t.numel * esize == st.nbytes
        src, base = files.storage(st)
        if (whole and st.crc is not None) or not need_crc:  # the checksum is known, or not needed
            copy_range(src, out, base + t.offset * esize, t.numel * esize, behind=behind)
            crc = st.crc if whole else None
            if crc is not None:
                files.evidence.vouched(st.path)
        else:
            crc = copy_range_crc(src, out, base + t.offset * esize, t.numel * esize, behind=behind)
            if st.segments is None:  # (segments are recorded as Files.read reads them)
                files.evidence.saw(st.path, base + t.offset * esize, t.numel * esize, crc)
    elif u.dtype == t.dtype and st.pieces is None and st.scaled is None:  # a strided view, no cast: gather (no torch)
        lo, hi = t.span
        crc = 0
        for piece in gather(files.storage_bytes(st, lo * esize, (hi - lo) * esize), esize,
                            t.offset - lo, t.shape, t.stride, chunk=_GATHER_CHUNK):
            out.write(piece)
            crc = zlib.crc32(piece, crc)
        res.made_contiguous.append(t.name)
    else:
        buf = tensor_buffer(cache.view(t))
        out.write(buf)
        crc = zlib.crc32(buf)
        if not is_contiguous(t.shape, t.stride):
            res.made_contiguous.append(t.name)
    return crc


def _renamed_meta_state(state: dict[str, Any], rename_key: Callable[[str], str] | None) -> dict[str, Any]:
    """The selected OrderedDict's BUILD state (``{"_metadata": ...}``) with its module paths following the keys
    renamed by ``rename_key`` (:func:`ckptool.model.keys.rename_metadata_items`)."""
    items = mapping_items(state.get("_metadata"))
    if items is None or rename_key is None:
        return state
    return {**state, "_metadata": ordered_dict_node(rename_metadata_items(items, rename_key))}


def torch_pickle(tensors: list[Tensor], keys: dict[int, str], cast: str | None, location: Callable[[str], str],
                 sd_state: dict[str, Any] | None, rename_key: Callable[[str], str] | None,
                 entries: dict[str, Any] | None = None) -> bytes:
    """``data.pkl`` of an ``OrderedDict`` state_dict of ``tensors``, as ``torch.save`` writes it (protocol 2,
    ``_rebuild_tensor_v2`` over a typed storage class, ``_rebuild_tensor_v3`` over ``UntypedStorage`` for dtypes
    without one). Storages are named by ``keys[id(storage)]``. ``entries``: plain values (None, bool, int, float,
    str, lists and dicts of them) stored after the tensors, as items of the same dict
    (:attr:`ckptool.formats.tensors.Source.entries`)."""
    refs: dict[int, StorageRef] = {}
    items = []
    for t in tensors:
        st = t.storage
        dt = out_dtype(st.dtype, cast)
        ref = refs.get(id(st))
        if ref is None:
            ref = refs[id(st)] = storage_ref(keys[id(st)], dt, st.numel, location(st.location))
        items.append((t.name, view_node(ref, dt, t.offset, t.shape, t.stride, t.requires_grad)))
    items += [(k, v) for k, v in (entries or {}).items() if k not in {t.name for t in tensors}]
    root = ordered_dict_node(items)
    if type(sd_state) is dict:
        root.state = _renamed_meta_state(sd_state, rename_key)
        root.order = ["setitems", "build"]
    return dumps(root, protocol=2)


def write_torch(out: BinaryIO, tensors: list[Tensor], files: Files, cast: str | None, location: Callable[[str], str],
                archive: str, sd_state: dict[str, Any] | None, rename_key: Callable[[str], str] | None,
                progress: Callable[[int], None] | None, entries: dict[str, Any] | None = None,
                allow_overflow: bool = False, where: str = "") -> Written:
    """Write ``tensors`` as a torch zip checkpoint (an ``OrderedDict`` state_dict, with the plain ``entries`` after
    the tensors: :func:`torch_pickle`) into the open file ``out``.

    Storage records are copied from the source byte for byte (kernel copy when the source's CRC-32 is known);
    a storage that is cast or assembled from safetensors pieces is materialised, one at a time.

    Raises:
        UnsupportedError: the ``cast`` made ``inf`` or NaN from finite values, unless ``allow_overflow`` (after the
            data is written, so every such tensor is named; the file is not kept). ``where`` names the source.
    """
    storages: list[Storage] = []
    keys: dict[int, str] = {}
    for t in tensors:
        if id(t.storage) not in keys:
            keys[id(t.storage)] = str(len(storages))
            storages.append(t.storage)
    pkl = torch_pickle(tensors, keys, cast, location, sd_state, rename_key, entries)
    w = TorchZipWriter(out, archive)
    w.begin_torch_save(pkl)
    cache = files.cache(cast)
    written = Written([], None, list(tensors), [],
                      entries={k: v for k, v in (entries or {}).items() if k not in {t.name for t in tensors}})
    for st in storages:
        name = f"data/{keys[id(st)]}"
        if st.pieces is None and st.scaled is None and out_dtype(st.dtype, cast) == st.dtype:
            w.copy_record(name, *files.storage(st), st.nbytes, st.crc)
            if st.crc is not None:  # the record carries the source's CRC-32, which zipfile checks on the output
                files.evidence.vouched(st.path)
            elif st.segments is None:
                files.evidence.saw(st.path, st.offset, st.nbytes, w.entries[-1][1])
        else:
            buf = tensor_buffer(cache.flat(st))
            w.write_bytes(name, buf)  # type: ignore[arg-type]  # any buffer works: len() is its byte count
            del buf
        written.records[name] = w.entries[-1][1]
        if progress:
            progress(st.numel * DTYPE_SIZES[out_dtype(st.dtype, cast)])
    if not allow_overflow:
        files.refuse_overflow(tensors, where)
    w.end_torch_save()
    written.nbytes = w.pos
    return written


def archive_name(path: str) -> str:
    """The top folder name of the zip records of a torch file written to ``path`` (as ``torch.save`` derives it)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "archive"


def _fd_path(f: BinaryIO) -> str | None:
    """The path of the open file ``f`` (Linux ``/proc/self/fd``), or None where the platform does not say."""
    try:
        p = os.readlink(f"/proc/self/fd/{f.fileno()}")
    except (OSError, AttributeError, ValueError):
        return None
    return p if os.path.isfile(p) else None


def emit(path: str, write: Callable[[BinaryIO], W], check: Callable[[W, str], None] | None) -> W:
    """Write one output file atomically (:func:`ckptool._fileio.atomic_output`), checking it with ``check(result,
    path of the bytes)`` before it is renamed into place (or, where the temporary file cannot be named, right after,
    removing it on failure). Returns what ``write`` returned."""
    with atomic_output(path) as out:
        w = write(out)
        out.flush()
        tmp = _fd_path(out)
        if check is not None and tmp is not None:
            check(w, tmp)
            check = None
    if check is not None:
        try:
            check(w, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            unmark_committed(path)
            raise
    return w
