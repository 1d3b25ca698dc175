"""Open a torch checkpoint's structure: the pickle as a node graph plus where each storage's bytes live.

Nothing here reads tensor bytes or imports torch. For the zip format (torch >= 1.6) the storage of key ``k`` is
the stored record ``<archive>/data/k``; for the legacy stream (``_use_new_zipfile_serialization=False``) it is
found by walking the stream after the pickles: for each key of the storage-key list, an 8-byte little-endian
element count then the raw bytes (torch/serialization.py ``_legacy_load``). TorchScript archives are read the
same way as torch zip files (their ``data.pkl`` and ``constants.pkl``).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from ckptool.formats import detect as formats
from ckptool.errors import CorruptCheckpointError, NotACheckpointError, UnsupportedError
from ckptool.formats.unpickler import GlobalMeta, StorageRef, load_pickle_at, load_structure
from ckptool.formats.zipdir import ZipEntry, data_offset, read_member

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001

#: storage class name -> (dtype name, element size in bytes), as torch/storage.py defines them
STORAGE_TYPES: dict[str, tuple[str, int]] = {
    "DoubleStorage": ("float64", 8), "FloatStorage": ("float32", 4), "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2), "LongStorage": ("int64", 8), "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2), "CharStorage": ("int8", 1), "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1), "ComplexFloatStorage": ("complex64", 8), "ComplexDoubleStorage": ("complex128", 16),
    "QInt8Storage": ("qint8", 1), "QUInt8Storage": ("quint8", 1), "QInt32Storage": ("qint32", 4),
    "QUInt4x2Storage": ("quint4x2", 1), "QUInt2x4Storage": ("quint2x4", 1), "UntypedStorage": ("uint8", 1),
}

#: dtype name -> element size in bytes, for the dtypes ``_rebuild_tensor_v3`` names (torch.<dtype>.itemsize)
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1, "complex32": 4, "complex64": 8,
    "complex128": 16, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1,
    "quint2x4": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    **{f"int{i}": 1 for i in range(1, 8)}, **{f"uint{i}": 1 for i in range(1, 8)},
}


def storage_element(ref: StorageRef) -> tuple[str, int]:
    """``(dtype name, element size)`` of a storage from its storage class (``torch.cuda.HalfStorage`` too).

    Raises:
        UnsupportedError: an unknown storage class.
    """
    name = ref.storage_type_name
    try:
        return STORAGE_TYPES[name]
    except KeyError:
        raise UnsupportedError(f"storage {ref.key!r} has unknown storage type {name!r}") from None


def storage_nbytes(ref: StorageRef) -> int:
    """Size in bytes of the storage's data: ``numel * element size`` (``numel`` is bytes for UntypedStorage)."""
    return ref.numel * storage_element(ref)[1]


@dataclass
class Record:
    """One record of the output or input archive: ``name`` relative to the archive folder (``data/0``,
    ``version``), its data's offset and size in bytes in the source file, and its CRC-32 when known."""

    name: str
    offset: int
    size: int
    crc: int | None = None
    zipinfo: ZipEntry | None = None


@dataclass
class Checkpoint:
    """The structure of one checkpoint file.

    ``root`` is the main pickle as a node graph; ``storages`` maps storage key -> :class:`StorageRef` in first-use
    order; ``records`` lists the file's records in file order (zip members, or for legacy files the storage
    data blocks named ``data/<key>``); ``globals`` lists ``(module, name)`` of every global the pickles name.
    """

    path: str
    format: str
    size: int
    root: Any = None
    protocol: int = 2
    storages: dict[str, StorageRef] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    globals: list[tuple[str, str]] = field(default_factory=list)
    archive_name: str = "archive"
    pickle_size: int = 0
    extra_roots: dict[str, Any] = field(default_factory=dict)

    def record(self, name: str) -> Record | None:
        """The record called ``name`` (``data/0``, ``constants.pkl``), or None."""
        for r in self.records:
            if r.name == name:
                return r
        return None


def read_checkpoint(path: str, fmt: str | None = None) -> Checkpoint:
    """Read the structure of a torch zip, legacy or TorchScript file.

    Hostile input is refused in bounded time and memory (see :mod:`ckptool.unpickler` and :mod:`ckptool.zipdir`):
    besides the pickle checks, every storage must have its record (``data/<key>``, ``constants/<key>`` for
    TorchScript constants, or the legacy data block) holding at least ``numel * element size`` bytes, and member
    names must be unique.

    Raises:
        UsageError / NotACheckpointError: see :func:`ckptool.formats.detect_format`.
        CorruptCheckpointError: truncated, damaged or hostile file (memo bombs, lengths past the end, zip bombs,
            storages larger than their records, duplicate members...).
        UnsupportedError: safetensors or plain pickles (no torch storages to read), big-endian legacy files, tuple
            nesting too deep to read safely.
    """
    fmt = fmt or formats.detect_format(path)
    if fmt in (formats.TORCH_ZIP, formats.TORCHSCRIPT):
        return _read_zip(path, fmt)
    if fmt == formats.TORCH_LEGACY:
        return _read_legacy(path)
    raise UnsupportedError(f"{path} is {fmt}, not a torch.save checkpoint")


def read_pickle_file(path: str) -> Checkpoint:
    """Read a plain pickle file (``pickle.dump``) as a structure without storages (its first pickle).

    Raises:
        UsageError / NotACheckpointError: a missing path, a directory or an empty file.
        CorruptCheckpointError: a truncated, malformed or hostile pickle.
        UnsupportedError: tuple nesting too deep to read safely.
    """
    size = formats.check_readable(path)
    with open(path, "rb") as f:
        data = f.read()
    root, up = load_structure(data, f"pickle in {path}")
    return Checkpoint(path, formats.PICKLE, size, root=root, protocol=data[1], globals=list(up.globals_seen),
                      pickle_size=len(data))


def _read_zip(path: str, fmt: str) -> Checkpoint:
    size = os.path.getsize(path)
    entries = formats.zip_entries(path)
    if not entries:
        raise NotACheckpointError(f"{path} is an empty zip archive, not a torch checkpoint")
    first = entries[0].name
    archive = first.split("/", 1)[0] if "/" in first else ""
    ck = Checkpoint(path, fmt, size, archive_name=archive or "archive")
    lead = archive + "/" if archive else ""
    n_lead = len(lead)
    by_name: dict[str, ZipEntry] = {}
    records = ck.records
    for e in entries:
        name = e.name[n_lead:] if e.name.startswith(lead) else e.name
        if e.header_offset + e.compress_size > size:
            raise CorruptCheckpointError(
                f"{path}: record {e.name!r} runs past the end of the file: truncated; re-download it")
        if name in by_name:
            raise CorruptCheckpointError(
                f"{path}: the zip holds two members named {e.name!r}; loaders may read either one, so ckptool "
                "refuses the file (run `ckptool scan` on it)")
        records.append(Record(name, -1, e.file_size, e.crc, e))
        by_name[name] = e
    if "data.pkl" not in by_name:
        raise NotACheckpointError(f"{path} is a zip archive without data.pkl, not a torch checkpoint")
    cache: dict[tuple[str, str], GlobalMeta] = {}
    seen: dict[tuple[str, str], None] = {}
    with open(path, "rb") as f:
        data = read_member(f, by_name["data.pkl"], path)
        ck.pickle_size = len(data)
        ck.protocol = data[1] if len(data) > 1 and data[0] == 0x80 else 2
        ck.root, up = load_structure(data, f"data.pkl in {path}", storages=ck.storages, global_cache=cache)
        seen.update(up.globals_seen)
        check_storage_records(path, ck.storages, by_name, "data/")
        if fmt == formats.TORCHSCRIPT and "constants.pkl" in by_name:
            const_storages: dict[str, StorageRef] = {}
            consts, up2 = load_structure(read_member(f, by_name["constants.pkl"], path), f"constants.pkl in {path}",
                                         storages=const_storages, global_cache=cache)
            ck.extra_roots["constants"] = consts
            seen.update(up2.globals_seen)
            check_storage_records(path, const_storages, by_name, "constants/")
    ck.globals = list(seen)
    return ck


def check_storage_records(path: str, storages: dict[str, StorageRef], by_name: dict[str, ZipEntry],
                          folder: str) -> None:
    """Check that every storage has its record ``<folder><key>`` and that the record holds at least the
    ``numel * element size`` bytes its persistent id declares (torch reads that many bytes from it).

    Raises:
        CorruptCheckpointError: a record is missing or shorter than its storage.
    """
    elsize: dict[int, int] = {}
    for key, ref in storages.items():
        e = by_name.get(folder + key)
        if e is None:
            raise CorruptCheckpointError(
                f"{path}: storage {key!r} has no record {folder}{key} in the archive; the file is damaged or "
                "incomplete, re-download it")
        st = id(ref.storage_type)
        n = elsize.get(st)
        if n is None:
            n = elsize[st] = STORAGE_TYPES.get(ref.storage_type_name, ("", 1))[1]
        if ref.numel * n > e.file_size:
            raise CorruptCheckpointError(
                f"{path}: storage {key!r} declares {ref.numel} elements ({ref.numel * n} bytes) but its record "
                f"holds {e.file_size} bytes; the file is damaged or hostile, re-download it")


def resolve_zip_offsets(ck: Checkpoint, f: Any) -> None:
    """Fill ``Record.offset`` (start of the member's data) from each zip local header of the open binary file
    ``f`` (30 bytes + name + extra per member).

    Raises:
        CorruptCheckpointError: a local header is missing.
    """
    for rec in ck.records:
        if rec.zipinfo is not None and rec.offset < 0:
            rec.offset = data_offset(f, rec.zipinfo, ck.path)


def _read_legacy(path: str) -> Checkpoint:
    size = os.path.getsize(path)
    ck = Checkpoint(path, formats.TORCH_LEGACY, size, archive_name=os.path.splitext(os.path.basename(path))[0])
    with open(path, "rb") as f:
        try:
            buf: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # not mappable (a pipe, an odd filesystem): read it
            buf = f.read()
        try:
            _legacy_structure(path, ck, buf, size)
        finally:
            if isinstance(buf, mmap.mmap):
                buf.close()
    return ck


def _legacy_structure(path: str, ck: Checkpoint, buf: Any, size: int) -> None:
    """The five pickles of a legacy stream, then the storage blocks (torch/serialization.py ``_legacy_load``).
    Every global of every pickle counts: ``torch.load`` unpickles all of them."""
    seen: dict[tuple[str, str], None] = {}

    def load(pos: int, what: str, **kw: Any) -> tuple[Any, int]:
        root, up, end = load_pickle_at(buf, pos, f"{what} of {path}", **kw)
        seen.update(up.globals_seen)
        return root, end

    magic, pos = load(0, "magic number")
    if magic != LEGACY_MAGIC:
        raise NotACheckpointError(f"{path} is not a torch legacy checkpoint (bad magic number)")
    proto, pos = load(pos, "protocol version")
    if proto != LEGACY_PROTOCOL:
        raise UnsupportedError(f"{path}: unsupported legacy protocol version {proto!r}")
    sys_info, pos = load(pos, "sys_info")
    if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
        raise UnsupportedError(f"{path} was saved on a big-endian machine; load and re-save it there")
    start = pos
    ck.root, pos = load(pos, "main pickle", storages=ck.storages)
    ck.pickle_size = pos - start
    keys, pos = load(pos, "storage key list")
    ck.globals = list(seen)
    if not isinstance(keys, list) or not all(isinstance(k, (str, int)) for k in keys):
        raise CorruptCheckpointError(f"{path}: the storage key list is malformed; the file is damaged")
    if len({str(k) for k in keys}) != len(keys):
        raise CorruptCheckpointError(f"{path}: the storage key list names a storage twice; the file is damaged")
    for key in keys:
        key = str(key)
        ref = ck.storages.get(key)
        if ref is None:
            raise CorruptCheckpointError(f"{path}: storage {key!r} has data but no tensor uses it; damaged file")
        head = buf[pos:pos + 8]
        if len(head) != 8:
            raise CorruptCheckpointError(
                f"{path} is truncated: the data of storage {key!r} is missing; re-download or re-save it"
            )
        numel = struct.unpack("<q", head)[0]
        elsize = storage_element(ref)[1]
        if numel != ref.numel:
            raise CorruptCheckpointError(
                f"{path}: storage {key!r} declares {ref.numel} elements but its data holds {numel}; damaged file"
            )
        nbytes = numel * elsize
        if pos + 8 + nbytes > size:
            raise CorruptCheckpointError(
                f"{path} is truncated: storage {key!r} needs {nbytes} bytes at offset {pos + 8} but the file "
                f"ends at {size}; re-download or re-save it"
            )
        ck.records.append(Record("data/" + key, pos + 8, nbytes))
        pos += 8 + nbytes
    have = {str(k) for k in keys}
    missing = [k for k in ck.storages if k not in have]
    if missing:
        raise CorruptCheckpointError(f"{path}: no data for storages {missing[:5]}; the file is damaged")
