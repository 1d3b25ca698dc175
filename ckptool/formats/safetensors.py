"""The safetensors container: reading and writing its header, never its tensor data.

Layout (safetensors format description): an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded with spaces to a
multiple of 8, then the data block; ``data_offsets`` are byte offsets into the data block.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckptool.errors import CorruptCheckpointError

#: the safetensors library's own limit on the header size (bytes)
MAX_HEADER = 100 << 20
METADATA_KEY = "__metadata__"


@dataclass
class SafetensorsHeader:
    """A parsed header: ``entries`` maps each tensor name to its ``{"dtype", "shape", "data_offsets"}`` entry (file
    order), ``metadata`` is ``__metadata__`` (``None`` when absent), ``data_start`` the byte offset of the data block
    in the file (``8 + N``) and ``data_size`` its length in bytes."""

    entries: dict[str, dict[str, Any]]
    metadata: dict[str, Any] | None
    data_start: int
    data_size: int


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
    size = os.path.getsize(path)
    with open(path, "rb") as f:
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


def encode_header(entries: dict[str, dict[str, Any]], metadata: dict[str, str] | None = None) -> bytes:
    """The bytes that start a safetensors file: the 8-byte length then the compact JSON header (``__metadata__``
    first when given), padded with spaces to a multiple of 8 as the safetensors writer does."""
    header: dict[str, Any] = {METADATA_KEY: metadata} if metadata is not None else {}
    header.update(entries)
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw
