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

import itertools
import json
import math
import re
import struct
from collections import Counter
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats.dtypes import ST_BITS, ST_NAMES, element_size
from ckptool.formats.strided import view_problem
from ckptool.formats.tensors import span

#: the safetensors library's own limit on the header size (bytes; ``MAX_HEADER_SIZE`` in its ``tensor.rs``)
MAX_HEADER = 100_000_000
#: serde_json's nesting limit, which the library's header parser keeps: a header nested this deep is refused
MAX_DEPTH = 128
_U64 = (1 << 64) - 1
_FIELDS = ("dtype", "shape", "data_offsets")
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


def read_header(path: str) -> SafetensorsHeader:
    """Parse the JSON header of the safetensors file at ``path`` (no tensor data is read), accepting exactly the
    headers ``safetensors.safe_open`` accepts (``SafeTensors::read_metadata`` and ``Metadata::validate`` in the
    library's ``tensor.rs``, 0.8; ``tests/test_safetensors_parity.py`` holds the two together):

    * the length ``N`` at most :data:`MAX_HEADER`, ``8 + N`` within the file; the header UTF-8, one JSON object
      as serde_json reads it (no ``NaN``, no number out of range, no lone surrogate, nested less than
      :data:`MAX_DEPTH` deep; a repeated key keeps its last value, a repeated field of an entry or a repeated
      ``__metadata__`` is refused);
    * ``__metadata__`` absent, null or a mapping of strings;
    * every other item an entry ``{"dtype", "shape", "data_offsets"}`` (or serde's array form ``[dtype, shape,
      data_offsets]``) with a dtype code of the format (:data:`~ckptool.formats.dtypes.ST_BITS`), a shape of
      64-bit sizes and two 64-bit offsets;
    * sorted by their offsets, the entries tile the data block from its first byte to the end of the file, with
      no gap and no overlap, each as long as its shape and dtype need (a whole number of bytes, counted without
      64-bit overflow).

    Raises:
        CorruptCheckpointError: the header breaks one of these rules (the message says which, and where).
        OSError: the file cannot be read.
    """
    size = source.file_size(path)
    with source.open_binary(path) as f:  # a URL: two range reads, the length and the header
        n = _read_length(f, path, size)
        raw = f.read(n)
    header = _parse_json(raw, path)
    data_size = size - 8 - n
    meta = header.pop(METADATA_KEY, None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for _, v in _every_item(meta))):
        raise _refused(path, "its __metadata__ is not a mapping of strings")
    entries: dict[str, dict[str, Any]] = {}
    for name, value in _every_item(header):  # a replaced value must be an entry too
        entry = _tensor_entry(value) if name != METADATA_KEY else {}
        if isinstance(entry, str):
            raise _refused(path, f"entry {name!r} {entry}")
        if name in header:
            entries[name] = entry  # the last value of a repeated name wins
    problem = _layout_problem(entries, data_size)
    if problem is not None:
        raise _refused(path, problem)
    return SafetensorsHeader(entries, dict(meta) if meta is not None else None, 8 + n, data_size)


def _refused(path: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: safetensors header refused: {why}; safetensors.safe_open refuses it too. "
                                  "The file is damaged or was crafted: re-download it")


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


# ------------------------------------------------------------------------------------------------ the header's JSON
class _Object(dict[str, Any]):
    """A JSON object as serde_json gives it to the library: a repeated key keeps its last value; ``repeated``
    names the keys given more than once (a repeated field of a struct is refused there), and ``pairs`` holds
    every item in order, the replaced ones too (serde reads each value as its type before the map replaces it)."""

    repeated: frozenset[str] = frozenset()
    pairs: list[tuple[str, Any]] | None = None


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        obj.repeated = frozenset(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        obj.pairs = pairs
    return obj


def _repeated(obj: dict[str, Any]) -> frozenset[str]:
    return obj.repeated if isinstance(obj, _Object) else frozenset()


def _every_item(obj: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every ``(key, value)`` of ``obj`` as written, replaced values of a repeated key included."""
    return obj.pairs if isinstance(obj, _Object) and obj.pairs is not None else list(obj.items())


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _int(text: str) -> int | float:
    """An integer literal as serde_json reads it: a u64 / i64 where it fits, else (``-0`` too) an f64."""
    if len(text) > 21:  # past 64 bits whatever its digits (and never int() of thousands of digits)
        return _float(text)
    value = int(text)
    if value > _U64 or value < -(1 << 63) or (value == 0 and text.startswith("-")):
        return _float(text)
    return value


def _constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


#: a JSON string of a text that parsed (its escapes whole); the rest is the document's structure and numbers
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
#: outside strings, an integer literal serde_json reads as a float: ``-0``, or 21 digits and more (past 64 bits)
_FLOAT_INT = re.compile(r"-0(?![0-9.eE])|[0-9]{21}")
#: an escaped UTF-16 surrogate (``\\ud800``), lone unless paired
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_STEP = [1 if c in b"[{" else -1 for c in range(256)]


def _parse_json(raw: bytes, path: str) -> dict[str, Any]:
    """The header as serde_json reads it: Python's json, then what serde refuses besides (:func:`_serde_problem`).

    Plain ints and dicts for a header without repeated keys and without integers serde reads as floats (the
    common case, checked on the text outside strings); otherwise parsed again with hooks that keep both."""
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text, parse_float=_float, parse_constant=_constant)
        outside = _JSON_STRING.sub('""', text)
        if _FLOAT_INT.search(outside) or outside.count(":") != _pair_count(doc):
            doc = json.loads(text, object_pairs_hook=_object, parse_int=_int, parse_float=_float,
                             parse_constant=_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CorruptCheckpointError(
            f"{path}: safetensors header is not valid JSON ({type(e).__name__}: {str(e)[:200]}); re-download it"
        ) from e
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not a JSON object; the file is damaged")
    problem = _serde_problem(doc, text, outside)
    if problem is not None:
        raise CorruptCheckpointError(f"{path}: safetensors header is not valid JSON as safetensors reads it "
                                     f"({problem}); the file is damaged or was crafted: re-download it")
    return doc


def _pair_count(doc: Any) -> int:
    """The items of ``doc`` and of its values that are objects (-1 for a document that is not an object): equal to
    the colons outside strings when no key is repeated and no object is nested deeper."""
    if not isinstance(doc, dict):
        return -1
    return len(doc) + sum(len(v) for v in doc.values() if isinstance(v, dict))


def _serde_problem(doc: dict[str, Any], text: str, outside: str) -> str | None:
    """What serde_json (the library's parser) refuses in a document Python's json took (``text``; ``outside``:
    the text with its strings emptied): ``__metadata__`` given twice, nesting :data:`MAX_DEPTH` deep, a lone
    surrogate escape in a string or a key."""
    if METADATA_KEY in _repeated(doc):
        return f"{METADATA_KEY} is given twice"
    brackets = outside.encode("ascii", "ignore").translate(None, _NOT_BRACKETS)
    if max(itertools.accumulate(_DEPTH_STEP[c] for c in brackets), default=0) >= MAX_DEPTH:
        return f"it is nested {MAX_DEPTH} levels deep"
    if not _SURROGATE_ESCAPE.search(text):
        return None
    stack: list[Any] = [doc]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
                return f"the string {value[:40]!r} holds a lone surrogate"
        elif isinstance(value, dict):
            stack += [*value.keys(), *value.values()]
        elif isinstance(value, list):
            stack += value
    return None


def _is_u64(v: object) -> bool:
    return type(v) is int and 0 <= v <= _U64


def _entry_fields(value: Any) -> tuple[Any, Any, Any] | str:
    """``(dtype, shape, data_offsets)`` of an entry in either form serde reads the library's ``TensorInfo`` (an
    object whose other fields are ignored, or an array of the three), or why it is refused."""
    if isinstance(value, list):
        if len(value) != 3:
            return f"is an array of {len(value)} items, not a tensor entry"
        return value[0], value[1], value[2]
    if isinstance(value, dict):
        twice = [f for f in _FIELDS if f in _repeated(value)]
        missing = [f for f in _FIELDS if f not in value]
        if twice or missing:
            return f"gives {twice[0]!r} twice" if twice else f"has no {missing[0]!r}"
        return value["dtype"], value["shape"], value["data_offsets"]
    return f"is a {type(value).__name__}, not a tensor entry"


def _tensor_entry(value: Any) -> dict[str, Any] | str:
    """``value`` as the entry ``{"dtype", "shape", "data_offsets"}`` the way serde reads the library's
    ``TensorInfo`` (:func:`_entry_fields`; the dtype a code or ``{code: null}``), or why it is refused."""
    fields = _entry_fields(value)
    if isinstance(fields, str):
        return fields
    dtype, shape, offsets = fields
    if isinstance(dtype, dict) and len(dtype) == 1 and None in dtype.values():
        dtype = next(iter(dtype))
    if not isinstance(dtype, str) or dtype not in ST_BITS:
        return f"has dtype {dtype!r}, which the safetensors format does not define"
    if not (isinstance(shape, list) and all(_is_u64(v) for v in shape)):
        return f"has shape {shape!r}, not a list of sizes (integers from 0 to 2**64-1)"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_u64(v) for v in offsets)):
        return f"has data_offsets {offsets!r}, not two offsets (integers from 0 to 2**64-1)"
    if isinstance(value, dict) and value["dtype"] is dtype:
        return value if type(value) is dict else dict(value)
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _nbytes(shape: list[int], bits: int) -> int | str:
    """The bytes of ``shape`` elements of ``bits`` bits each, or why the library refuses them (its 64-bit
    ``checked_mul`` overflows, left to right, even where a later size is 0; a size that is not whole bytes)."""
    n = 1
    for v in shape:
        n *= v
        if n > _U64:
            return f"its element count overflows 64 bits (shape {shape})"
    if n * bits > _U64:
        return f"its size in bits overflows 64 bits (shape {shape})"
    if n * bits % 8:
        return f"{n} elements of {bits} bits do not end on a byte boundary"
    return n * bits // 8


def _layout_problem(entries: dict[str, dict[str, Any]], data_size: int) -> str | None:
    """Why the entries, sorted by their ``data_offsets``, do not tile the ``data_size``-byte data block exactly
    (``Metadata::validate`` and the end-of-file check of ``read_metadata``), or None."""
    start = 0
    for name, e in sorted(entries.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        begin, end = e["data_offsets"]
        if begin != start or end < begin:
            if begin == start:
                return f"entry {name!r} has data_offsets [{begin}, {end}] that end before they begin"
            how = "overlaps the previous tensor" if begin < start else "leaves a gap after the previous tensor"
            return (f"entry {name!r} has data_offsets [{begin}, {end}] but the previous tensor ends at byte {start} "
                    f"(it {how}; the tensors must tile the data block)")
        need = _nbytes(e["shape"], ST_BITS[e["dtype"]])
        if isinstance(need, str):
            return f"entry {name!r}: {need}"
        if need != end - begin:
            return (f"entry {name!r} does not fit its data: shape {e['shape']} of {e['dtype']} is {need} bytes but "
                    f"data_offsets hold {end - begin}")
        start = end
    if start != data_size:
        return f"the tensors end at byte {start} of the {data_size}-byte data block (the file must end with them)"
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

