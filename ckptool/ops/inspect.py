"""``ckptool.inspect``: what a checkpoint file holds, read without torch and without reading tensor bytes.

For torch zip / legacy / TorchScript files the pickle is read with :mod:`ckptool.unpickler` (nothing imported or
run); for safetensors only the JSON header is read (format: 8-byte little-endian length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``, then the data).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ckptool.formats import detect as formats
from ckptool._gc import gc_paused
from ckptool.model.allowlist import is_allowed
from ckptool.formats.torchfile import DTYPE_SIZES, Checkpoint, read_checkpoint, read_pickle_file, storage_element
from ckptool.errors import CorruptCheckpointError
from ckptool.model.graph import find_state_dicts, is_module, is_state_dict, iter_tensors, mapping_items, too_deep
from ckptool.model.keys import is_flat_param_key, shared_prefixes, suggest_command
from ckptool.formats.unpickler import StorageRef, TensorNode, qualified_name

# safetensors dtype codes -> torch dtype names (safetensors format description)
_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64", "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
}
_MAX_ST_HEADER = 100 << 20  # the safetensors library's own limit on the header size
ALLOWED, DANGEROUS, UNKNOWN = "allowed", "dangerous", "unknown"  # the statuses of ckptool.scan.classify_global


def classify_global(name: str, *, torchscript: bool = False) -> tuple[str, str]:
    """:func:`ckptool.scan.classify_global`, importing the scanner only for globals outside the allowlist."""
    if is_allowed(name):
        return ALLOWED, "accepted by torch.load(weights_only=True)"
    from ckptool.ops.scan import classify_global as classify

    return classify(name, torchscript=torchscript)


@dataclass
class TensorInfo:
    """One tensor: dotted ``key``; ``shape`` / ``stride`` in elements; ``dtype`` torch name (``float32``);
    ``device`` the saved location tag; ``nbytes`` = numel * element size; ``storage_key`` the record it lives in
    (tensors that share a storage share the key); ``storage_offset`` in elements."""

    key: str
    shape: list[int]
    dtype: str
    device: str
    nbytes: int
    stride: list[int] = field(default_factory=list)
    storage_offset: int = 0
    storage_key: str | None = None
    requires_grad: bool = False


@dataclass
class StateDictInfo:
    """A state_dict in the file: dotted ``path`` (``""`` = top level), tensor count, shared wrapper ``prefixes``
    (``["module."]``), the ckptool command that removes them, and whether it holds FSDP flat parameters."""

    path: str
    tensors: int
    prefixes: list[str]
    fix: str | None = None
    flat_params: bool = False


@dataclass
class GlobalInfo:
    """A global the pickle would import (``module.qualname``), and whether ``torch.load(weights_only=True)``
    accepts it (``allowed``). ``status`` is how ``ckptool scan`` classifies it (``allowed``, ``dangerous`` or
    ``unknown``, see :func:`ckptool.scan.classify_global`; filled in from ``name`` when not given) and ``reason``
    says why."""

    name: str
    allowed: bool
    status: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.status:
            self.status, self.reason = classify_global(self.name)
            if self.allowed and self.status != ALLOWED:  # allowed by a caller's own list (DCP metadata)
                self.status, self.reason = ALLOWED, "allowed for this format"


@dataclass
class CheckpointInfo:
    """The result of :func:`inspect`; :meth:`to_dict` is what ``ckptool inspect --json`` prints.

    ``size`` is the file size in bytes; ``devices`` maps location tag -> tensor count; ``storage_bytes`` maps
    location tag -> bytes of distinct storages there; ``metadata`` holds safetensors ``__metadata__``.
    """

    path: str
    format: str
    kind: str
    size: int
    tensors: list[TensorInfo]
    devices: dict[str, int]
    storage_bytes: dict[str, int]
    state_dicts: list[StateDictInfo]
    globals: list[GlobalInfo]
    storages: int = 0
    metadata: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (``dataclasses.asdict`` without its deep copies: fast for 50,000 tensors)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["tensors"] = [t.__dict__.copy() for t in self.tensors]
        d["state_dicts"] = [sd.__dict__.copy() for sd in self.state_dicts]
        d["globals"] = [{"name": g.name, "allowed": g.allowed} for g in self.globals]
        d["security"] = {
            "verdict": self.verdict,
            "dangerous": [{"name": g.name, "reason": g.reason} for g in self.globals if g.status == DANGEROUS],
            "unknown": [g.name for g in self.globals if g.status == UNKNOWN],
        }
        return d

    @property
    def unsafe_globals(self) -> list[str]:
        return [g.name for g in self.globals if not g.allowed]

    @property
    def verdict(self) -> str:
        """``safe`` when every global is allowed (as ``ckptool scan`` classifies them), else ``unsafe``."""
        return "unsafe" if any(g.status != ALLOWED for g in self.globals) else "safe"

    @property
    def total_bytes(self) -> int:
        return sum(self.storage_bytes.values())


def tensor_dtype(t: TensorNode) -> str:
    """dtype name of a tensor node: the dtype global of ``_rebuild_tensor_v3``, else its storage class's."""
    g = t.dtype_global
    if g is not None:
        return g.name
    ref = t.storage
    return storage_element(ref)[0] if ref is not None else "unknown"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def tensor_infos(root: Any) -> list[TensorInfo]:
    """A :class:`TensorInfo` for every tensor reachable from ``root`` (see :func:`ckptool.graph.iter_tensors`)."""
    out = []
    dtype_cache: dict[int, str] = {}
    for key, t, rg in iter_tensors(root):
        a = t.args
        if t.func.node_type is TensorNode and t.func.name == "_rebuild_tensor_v2" and len(a) >= 4 and type(
                a[2]) is tuple and type(a[3]) is tuple and type(a[0]) is StorageRef:  # the common case, fast
            ref, offset, shape, stride = a[0], a[1], list(a[2]), list(a[3])
            dtype = dtype_cache.get(id(ref.storage_type))
            if dtype is None:
                dtype = dtype_cache[id(ref.storage_type)] = tensor_dtype(t)
        else:
            ref, offset, shape, stride = t.storage, t.storage_offset, list(t.shape), list(t.stride)
            dtype = tensor_dtype(t)
        n = 1
        for s in shape:
            n *= s
        out.append(TensorInfo(key, shape, dtype, ref.location if ref else "meta", n * DTYPE_SIZES.get(dtype, 1),
                              stride, offset, ref.key if ref else None, rg))
    return out


def _kind(root: Any, sds: list) -> str:
    if sds and sds[0].obj is root and not sds[0].is_module:  # find_state_dicts already tested the root
        return "state_dict"
    if is_state_dict(root):
        return "state_dict"
    if is_module(root):
        return "full_model"
    if mapping_items(root) is not None and sds:
        return "training_checkpoint"
    return "tensors"


@gc_paused
def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` without importing torch or reading tensor data.

    Returns a :class:`CheckpointInfo`: format (``torch-zip``, ``torch-legacy``, ``torchscript``, ``safetensors``,
    ``pickle``; for an ``*.index.json`` or a folder ``sharded-safetensors``, ``sharded-torch`` or ``dcp``, see
    :func:`ckptool.convert.inspect_set`), kind (``state_dict``, ``training_checkpoint``, ``full_model``,
    ``torchscript``, ``tensors``), every tensor (shared storages included), tensor counts per location tag, the
    state_dicts found with their wrapper prefixes, and the globals the pickle names with their
    ``weights_only=True`` status.

    Raises:
        UsageError: missing path, or a folder that is neither a DCP checkpoint nor holds one ``*.index.json``.
        NotACheckpointError: empty file, unknown bytes or another file type.
        CorruptCheckpointError: truncated, damaged or hostile file (see :func:`ckptool.checkpoint.read_checkpoint`),
            or a pickle nested deeper than ckptool can walk.
        UnsupportedError: tuple nesting too deep to read safely.
    """
    path = os.fspath(path)
    if path.endswith(".index.json") or os.path.isdir(path):  # sharded sets and DCP folders
        from ckptool.ops.convert import inspect_set

        return inspect_set(path)
    fmt = formats.detect_format(path)
    if fmt == formats.SAFETENSORS:
        return _inspect_safetensors(path)
    try:
        ck = read_pickle_file(path) if fmt == formats.PICKLE else read_checkpoint(path, fmt)
        return describe(ck)
    except RecursionError as e:
        raise CorruptCheckpointError(f"{path}: {too_deep(e)}") from None


def describe(ck: Checkpoint) -> CheckpointInfo:
    """Build the :class:`CheckpointInfo` of an already-read :class:`~ckptool.checkpoint.Checkpoint`."""
    tensors = tensor_infos(ck.root)
    for name, extra in ck.extra_roots.items():
        tensors += [TensorInfo(**{**asdict(t), "key": f"{name}.{t.key}"}) for t in tensor_infos(extra)]
    sds = find_state_dicts(ck.root)
    sd_infos = []
    for sd in sds:
        keys = sd.keys()
        prefixes = shared_prefixes(keys)
        sd_infos.append(StateDictInfo(sd.path, len(keys), prefixes, suggest_command(prefixes),
                                      any(is_flat_param_key(k) for k in keys)))
    devices: dict[str, int] = {}
    for t in tensors:
        devices[t.device] = devices.get(t.device, 0) + 1
    storage_bytes: dict[str, int] = {}
    for ref in ck.storages.values():
        try:
            nb = ref.numel * storage_element(ref)[1]
        except Exception:  # unknown storage class: counted as bytes
            nb = ref.numel
        storage_bytes[ref.location] = storage_bytes.get(ref.location, 0) + nb
    kind = "torchscript" if ck.format == formats.TORCHSCRIPT else _kind(ck.root, sds)
    names = [qualified_name(m, n) for m, n in ck.globals]
    torchscript = ck.format == formats.TORCHSCRIPT and ck.record("constants.pkl") is not None
    globs = [GlobalInfo(n, is_allowed(n), *classify_global(n, torchscript=torchscript)) for n in dict.fromkeys(names)]
    return CheckpointInfo(ck.path, ck.format, kind, ck.size, tensors, devices, storage_bytes, sd_infos, globs,
                          storages=len(ck.storages))


def read_safetensors_header(path: str) -> dict[str, Any]:
    """Parse the JSON header of a safetensors file (no tensor data is read).

    Raises:
        CorruptCheckpointError: the header length or JSON is invalid, or an entry is malformed.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{path}: safetensors file shorter than its 8-byte header length")
        n = struct.unpack("<Q", head)[0]
        if n > _MAX_ST_HEADER or n + 8 > size:
            raise CorruptCheckpointError(
                f"{path}: safetensors header length {n} is larger than the file allows; the file is truncated "
                "or damaged, re-download it")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CorruptCheckpointError(
            f"{path}: safetensors header is not valid JSON ({type(e).__name__}: {str(e)[:200]}); re-download it"
        ) from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not a JSON object; the file is damaged")
    data_len = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(entry, dict) and isinstance(entry.get("shape"), list) and isinstance(entry.get("dtype"), str)
              and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
              and all(isinstance(x, int) and x >= 0 for x in entry["data_offsets"] + entry["shape"]))
        if not ok or entry["data_offsets"][1] > data_len or entry["data_offsets"][0] > entry["data_offsets"][1]:
            raise CorruptCheckpointError(f"{path}: safetensors entry {name!r} is malformed or points past the data")
    return header


def _inspect_safetensors(path: str) -> CheckpointInfo:
    header = read_safetensors_header(path)
    meta = header.pop("__metadata__", None)
    tensors = []
    for name, e in header.items():
        dtype = _ST_DTYPES.get(e["dtype"], e["dtype"].lower())
        begin, end = e["data_offsets"]
        shape = e["shape"]
        stride, acc = [], 1
        for s in reversed(shape):
            stride.insert(0, acc)
            acc *= s
        tensors.append(TensorInfo(name, shape, dtype, "cpu", end - begin, stride, 0, name))
    keys = [t.key for t in tensors]
    prefixes = shared_prefixes(keys)
    sds = [StateDictInfo("", len(keys), prefixes, suggest_command(prefixes), any(is_flat_param_key(k) for k in keys))]
    return CheckpointInfo(
        path, formats.SAFETENSORS, "tensors", os.path.getsize(path), tensors,
        {"cpu": len(tensors)} if tensors else {}, {"cpu": sum(t.nbytes for t in tensors)}, sds, [],
        storages=len(tensors), metadata=meta if isinstance(meta, dict) else None,
    )
