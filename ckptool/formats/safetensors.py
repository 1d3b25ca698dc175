"""The safetensors container: reading and writing its header, never its tensor data.

Layout (safetensors format description): an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded with spaces to a
multiple of 8, then the data block; ``data_offsets`` are byte offsets into the data block.

safetensors holds no aliasing, so tied weights and other views of one storage are recorded in ``__metadata__``
two ways (both written by ``ckptool convert``, both read back by :meth:`SafetensorsHeader.aliases` and
:func:`decode_shared`): ``__metadata__[alias] = kept name`` for a tensor that is exactly another stored one (the
convention of ``safetensors.torch.save_model``), and the full layout of every shared storage under
:data:`SHARED_KEY` (:class:`SharedGroup`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats.dtypes import ST_CODES, ST_NAMES, element_size, numel
from ckptool.formats.strided import shape_problem, view_problem
from ckptool.formats.tensors import span

#: the safetensors library's own limit on the header size (bytes)
MAX_HEADER = 100 << 20
METADATA_KEY = "__metadata__"
#: ``__metadata__`` key holding the layout of shared storages (JSON, see :func:`encode_shared`)
SHARED_KEY = "ckptool.shared"


@dataclass
class SafetensorsHeader:
    """A parsed header: ``entries`` maps each tensor name to its ``{"dtype", "shape", "data_offsets"}`` entry (file
    order), ``metadata`` is ``__metadata__`` (``None`` when absent), ``data_start`` the byte offset of the data block
    in the file (``8 + N``) and ``data_size`` its length in bytes."""

    entries: dict[str, dict[str, Any]]
    metadata: dict[str, Any] | None
    data_start: int
    data_size: int

    def aliases(self) -> dict[str, str]:
        """``alias -> kept name`` recorded the way ``safetensors.torch.save_model`` records a dropped duplicate
        (:func:`library_aliases` of this header's metadata and tensor names)."""
        return library_aliases(self.metadata, self.entries)


def library_aliases(metadata: Mapping[str, object] | None, stored: Container[str]) -> dict[str, str]:
    """``alias -> kept name`` as ``safetensors.torch.save_model`` records a dropped duplicate: every ``__metadata__``
    item whose key names no ``stored`` tensor and whose value names a stored one (a tensor identical to the kept
    one, same shape and dtype)."""
    return {k: v for k, v in (metadata or {}).items()
            if k != SHARED_KEY and k not in stored and isinstance(v, str) and v in stored}


def read_header(path: str, *, strict_metadata: bool = False) -> SafetensorsHeader:
    """Parse the JSON header of the safetensors file at ``path`` (no tensor data is read).

    Each entry must have an int list ``shape``, a str ``dtype`` and ``data_offsets`` ``[begin, end]`` with
    ``begin <= end <= data size``. With ``strict_metadata`` a ``__metadata__`` that is not a mapping of strings
    is refused (the format requires one); without it such a value is dropped (``metadata`` is ``None``).

    Raises:
        CorruptCheckpointError: the header length runs past the file or over :data:`MAX_HEADER`, the JSON is
            invalid or not an object, an entry is malformed or points past the data, or (``strict_metadata``)
            ``__metadata__`` is not a mapping of strings.
        OSError: the file cannot be read.
    """
    size = source.file_size(path)
    with source.open_binary(path) as f:  # a URL: two range reads, the length and the header
        n = _read_length(f, path, size)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CorruptCheckpointError(
            f"{path}: safetensors header is not valid JSON ({type(e).__name__}: {str(e)[:200]}); re-download it"
        ) from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not a JSON object; the file is damaged")
    data_size = size - 8 - n
    meta = header.pop(METADATA_KEY, None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        if strict_metadata:
            raise CorruptCheckpointError(
                f"{path}: safetensors __metadata__ is not a mapping of strings; the file is damaged")
        meta = None
    for name, entry in header.items():
        if not _entry_ok(entry, data_size):
            raise CorruptCheckpointError(f"{path}: safetensors entry {name!r} is malformed or points past the data")
        problem = _size_problem(entry)
        if problem is not None:
            raise CorruptCheckpointError(f"{path}: safetensors entry {name!r} does not fit its data: {problem}; "
                                         "safetensors refuses it too. The file is damaged or was crafted: "
                                         "re-download it")
    return SafetensorsHeader(header, meta, 8 + n, data_size)


def _read_length(f: BinaryIO, path: str, size: int) -> int:
    head = f.read(8)
    if len(head) < 8:
        raise CorruptCheckpointError(f"{path}: safetensors file shorter than its 8-byte header length")
    n: int = struct.unpack("<Q", head)[0]
    if n > MAX_HEADER or n + 8 > size:
        raise CorruptCheckpointError(
            f"{path}: safetensors header length {n} is larger than the file allows; the file is truncated "
            "or damaged, re-download it")
    return n


def _entry_ok(entry: Any, data_size: int) -> bool:
    if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list) and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2):
        return False
    numbers = entry["data_offsets"] + entry["shape"]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in numbers):
        return False
    begin, end = entry["data_offsets"]
    return bool(begin <= end <= data_size)


#: the safetensors codes whose element size is whole bytes (those ckptool converts)
ST_CODES_TO_NAMES = {v: k for k, v in ST_CODES.items()}


def _size_problem(entry: dict[str, Any]) -> str | None:
    """Why a well-formed entry's shape does not match its data (the check safetensors' ``Metadata::validate`` does:
    the element count, without overflow, times the element size equals ``end - begin``), or None. Codes ckptool
    only describes (:data:`ST_READ_ONLY`, sub-byte elements) and unknown codes are left to the readers that need
    them."""
    problem = shape_problem(entry["shape"])
    if problem is not None:
        return problem
    dtype = ST_CODES_TO_NAMES.get(entry["dtype"])
    if dtype is None:
        return None
    begin, end = entry["data_offsets"]
    need = numel(entry["shape"]) * element_size(dtype)
    if need != end - begin:
        return f"shape {entry['shape']} of {entry['dtype']} is {need} bytes but data_offsets hold {end - begin}"
    return None


def encode_header(entries: dict[str, dict[str, Any]], metadata: dict[str, str] | None = None, *,
                  data_start: tuple[int, int] = (0, 8)) -> bytes:
    """The bytes that start a safetensors file: the 8-byte length then the compact JSON header (``__metadata__``
    first when given), padded with spaces to a multiple of 8 as the safetensors writer does.

    ``data_start`` ``(target, modulus)`` pads further (spaces, which JSON ignores) so that the data starts at an
    offset congruent with ``target`` modulo ``modulus`` (a multiple of 8, ``target`` too): a rewrite on a
    filesystem with reflinks puts it at the input's data offset modulo the block size, so that the data can be
    cloned (:func:`ckptool._fileio.copy_range`)."""
    header: dict[str, Any] = {METADATA_KEY: metadata} if metadata is not None else {}
    header.update(entries)
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    target, modulus = data_start
    raw += b" " * ((target - 8 - len(raw)) % modulus)
    return struct.pack("<Q", len(raw)) + raw


# ------------------------------------------------------------------------------------------------ shared storages
@dataclass(frozen=True)
class SharedView:
    """One tensor of a :class:`SharedGroup`: ``index`` its position in the state_dict, ``offset`` / ``shape`` /
    ``stride`` its view in elements of the group's storage (as ``Tensor.as_strided`` takes them)."""

    index: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def span(self) -> tuple[int, int]:
        """``[lo, hi)``: the storage elements the view reaches (``lo == hi`` when it is empty)."""
        return span(self.offset, self.shape, self.stride)


@dataclass
class SharedGroup:
    """One storage that several tensors shared: ``dtype`` (torch dtype name), ``numel`` elements (trimmed to what
    its tensors reach) and ``tensors`` name -> :class:`SharedView`. Members present in the file are stored
    contiguous copies of their view; the others are aliases."""

    dtype: str
    numel: int
    tensors: dict[str, SharedView]


def encode_shared(groups: list[SharedGroup]) -> str | None:
    """The :data:`SHARED_KEY` value for ``groups`` (None when there are none): compact JSON ``{"version": 1,
    "groups": [{"dtype": "float32", "numel": N, "tensors": {name: [index, offset, shape, stride]}}]}``."""
    if not groups:
        return None
    doc = {"version": 1, "groups": [
        {"dtype": g.dtype, "numel": g.numel,
         "tensors": {n: [v.index, v.offset, list(v.shape), list(v.stride)] for n, v in g.tensors.items()}}
        for g in groups]}
    return json.dumps(doc, separators=(",", ":"))


def decode_shared(raw: str, path: str, entries: dict[str, dict[str, Any]]) -> list[SharedGroup]:
    """Parse and check the :data:`SHARED_KEY` value ``raw`` of the file at ``path`` whose tensor entries are
    ``entries``: every view lies inside its group's storage, every group has a stored member, and a stored member
    has the dtype and shape its group and view record.

    Raises:
        CorruptCheckpointError: not the JSON :func:`encode_shared` writes, an unknown version or dtype, or
            a record inconsistent with the stored tensors.
    """
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: the {SHARED_KEY} metadata is inconsistent ({why}); the file was "
                                      "edited or damaged. Remove that metadata entry to read the stored tensors alone")

    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(doc.get("groups"), list):
            raise bad("unknown version")
        groups = []
        for g in doc["groups"]:
            dtype, n = str(g["dtype"]), int(g["numel"])
            element_size(dtype)
            views = {str(name): SharedView(int(m[0]), int(m[1]), tuple(int(x) for x in m[2]),
                                           tuple(int(x) for x in m[3])) for name, m in g["tensors"].items()}
            groups.append(SharedGroup(dtype, n, views))
    except CorruptCheckpointError:  # bad(...) raised above: a ValueError too, already worded
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, UnsupportedError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None
    for grp in groups:
        why = _group_problem(grp, entries)
        if why is not None:
            raise bad(why)
    return groups


def _group_problem(grp: SharedGroup, entries: dict[str, dict[str, Any]]) -> str | None:
    """Why a decoded sharing group disagrees with the file's stored tensors ``entries`` (a view past its storage,
    a stored member of another dtype or shape, no stored member at all), or None."""
    for name, v in grp.tensors.items():
        size = element_size(grp.dtype)
        problem = view_problem(v.shape, v.stride, v.offset, size, grp.numel * size)
        lo, hi = v.span
        if problem is not None or min(v.stride, default=0) < 0 or lo < 0 or hi > grp.numel:
            return f"{name!r} runs past its storage ({problem or 'a negative stride'})"
        entry = entries.get(name)
        if entry is not None and (tuple(entry["shape"]) != v.shape or ST_NAMES.get(entry["dtype"]) != grp.dtype):
            return f"{name!r} is stored as {ST_NAMES.get(entry['dtype'], entry['dtype'])} {entry['shape']}"
    if not any(name in entries for name in grp.tensors):
        return "a group without a stored tensor"
    return None


def recorded_names(header: SafetensorsHeader, path: str) -> list[str]:
    """The tensor names the header of the file at ``path`` records without storing them: the aliases of
    :meth:`SafetensorsHeader.aliases` and the other members of its :data:`SHARED_KEY` groups, in record order.

    Raises:
        CorruptCheckpointError: an inconsistent :data:`SHARED_KEY` record (:func:`decode_shared`).
    """
    names = dict.fromkeys(header.aliases())
    raw = (header.metadata or {}).get(SHARED_KEY)
    for g in decode_shared(raw, path, header.entries) if raw is not None else []:
        names.update((n, None) for n in g.tensors if n not in header.entries)
    return list(names)


def rename_metadata(header: SafetensorsHeader, path: str, mapping: Mapping[str, str]) -> dict[str, Any] | None:
    """``header``'s ``__metadata__`` with every tensor name it records renamed by ``mapping`` (old -> new; names
    it lacks are kept): the aliases ``{alias: kept name}`` and the members of the :data:`SHARED_KEY` groups. Other
    items are kept as they are. None when the header has no metadata.

    Raises:
        CorruptCheckpointError: an inconsistent :data:`SHARED_KEY` record (:func:`decode_shared`).
    """
    if header.metadata is None:
        return None
    aliases = header.aliases()
    out: dict[str, Any] = {}
    for k, v in header.metadata.items():
        if k == SHARED_KEY:
            groups = decode_shared(v, path, header.entries)
            for g in groups:
                g.tensors = {mapping.get(n, n): view for n, view in g.tensors.items()}
            out[k] = encode_shared(groups)
        elif k in aliases:
            out[mapping.get(k, k)] = mapping.get(v, v)
        else:
            out[k] = v
    return out

