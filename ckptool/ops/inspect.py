"""``ckptool.inspect``: what a checkpoint holds, read without torch and without reading tensor bytes.

For torch zip / legacy / TorchScript files the pickle is read with :mod:`ckptool.formats.unpickler` (nothing
imported or run); for safetensors only the JSON header is read (:mod:`ckptool.formats.safetensors`). A sharded set
(:mod:`ckptool.formats.sharded`: an ``*.index.json`` or the folder holding one) is described as one checkpoint
from its shards, a DCP folder from its ``.metadata`` (:mod:`ckptool.formats.dcp`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ckptool._gc import gc_paused
from ckptool.errors import CorruptCheckpointError
from ckptool.formats import detect as formats
from ckptool.formats.dcp import read_dcp_metadata
from ckptool.formats.dtypes import (
    DTYPE_SIZES,
    contiguous_stride,
    numel,
    safetensors_dtype,
    storage_element,
    tensor_dtype,
)
from ckptool.formats.nodes import StorageRef, TensorNode, qualified_name
from ckptool.formats.safetensors import read_header
from ckptool.formats.sharded import is_checkpoint_set, read_index, set_kind
from ckptool.formats.torchfile import Checkpoint, read_checkpoint, read_pickle_file
from ckptool.model.allowlist import ALLOWED, DANGEROUS, UNKNOWN, classify_global, is_allowed
from ckptool.model.graph import (
    StateDictRef,
    find_state_dicts,
    is_module,
    is_state_dict,
    iter_tensors,
    mapping_items,
    too_deep,
)
from ckptool.model.keys import is_flat_param_key, shared_prefixes, suggest_command
from ckptool.ops.dcp_safety import is_dcp_allowed


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
    ``unknown``, see :func:`ckptool.model.allowlist.classify_global`; filled in from ``name`` when not given) and
    ``reason`` says why."""

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


def tensor_infos(root: Any) -> list[TensorInfo]:
    """A :class:`TensorInfo` for every tensor reachable from ``root`` (see :func:`ckptool.model.graph.iter_tensors`)."""
    out = []
    dtype_cache: dict[int, str] = {}
    ref: StorageRef | None
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
        nbytes = numel(shape) * DTYPE_SIZES.get(dtype, 1)
        out.append(TensorInfo(key, shape, dtype, ref.location if ref else "meta", nbytes, stride, offset,
                              ref.key if ref else None, rg))
    return out


def _state_dict_info(path: str, keys: list[str]) -> StateDictInfo:
    prefixes = shared_prefixes(keys)
    return StateDictInfo(path, len(keys), prefixes, suggest_command(prefixes), any(is_flat_param_key(k) for k in keys))


def _kind(root: Any, sds: list[StateDictRef]) -> str:
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
    :func:`inspect_set`), kind (``state_dict``, ``training_checkpoint``, ``full_model``,
    ``torchscript``, ``tensors``), every tensor (shared storages included), tensor counts per location tag, the
    state_dicts found with their wrapper prefixes, and the globals the pickle names with their
    ``weights_only=True`` status.

    Raises:
        UsageError: missing path, or a folder that is neither a DCP checkpoint nor holds one ``*.index.json``.
        NotACheckpointError: empty file, unknown bytes or another file type.
        CorruptCheckpointError: truncated, damaged or hostile file (see
            :func:`ckptool.formats.torchfile.read_checkpoint`), or a pickle nested deeper than ckptool can walk.
        UnsupportedError: tuple nesting too deep to read safely.
    """
    path = os.fspath(path)
    if is_checkpoint_set(path):  # sharded sets and DCP folders
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
    """Build the :class:`CheckpointInfo` of an already-read :class:`~ckptool.formats.torchfile.Checkpoint`."""
    tensors = tensor_infos(ck.root)
    for name, extra in ck.extra_roots.items():
        tensors += [TensorInfo(**{**asdict(t), "key": f"{name}.{t.key}"}) for t in tensor_infos(extra)]
    sds = find_state_dicts(ck.root)
    sd_infos = [_state_dict_info(sd.path, sd.keys()) for sd in sds]
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


def _inspect_safetensors(path: str) -> CheckpointInfo:
    header = read_header(path)
    meta = header.metadata
    tensors = []
    for name, e in header.entries.items():
        begin, end = e["data_offsets"]
        shape = e["shape"]
        tensors.append(TensorInfo(name, shape, safetensors_dtype(e["dtype"]), "cpu", end - begin,
                                  list(contiguous_stride(shape)), 0, name))
    sds = [_state_dict_info("", [t.key for t in tensors])]
    return CheckpointInfo(
        path, formats.SAFETENSORS, "tensors", os.path.getsize(path), tensors,
        {"cpu": len(tensors)} if tensors else {}, {"cpu": sum(t.nbytes for t in tensors)}, sds, [],
        storages=len(tensors), metadata=meta if isinstance(meta, dict) else None,
    )


@gc_paused
def inspect_set(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe a sharded set (``*.index.json`` or the folder holding one) or a DCP folder as one checkpoint,
    without torch and without reading tensor data. Returns a :class:`CheckpointInfo` with format
    ``sharded-safetensors`` / ``sharded-torch`` (``sharded-mixed``) / ``dcp``; a model folder holding only
    ``model.safetensors`` or ``pytorch_model.bin`` is that file's :func:`inspect`.

    For a sharded set every shard is inspected and its tensors listed (storage keys prefixed by the shard file);
    ``metadata`` holds the index's ``metadata`` (values that are not strings as JSON) and the shard count. For DCP
    the tensors come from ``.metadata`` (names, dtypes, shapes; sizes = elements * element size; DCP records no
    device, so ``cpu`` is shown, where ``dcp_to_torch_save`` puts them); non-tensor entries are listed under
    ``metadata["non_tensor_entries"]``, and ``globals`` says which globals of ``.metadata`` ckptool accepts without
    ``--trust`` (:func:`ckptool.ops.dcp_safety.is_dcp_allowed`).

    Raises:
        UsageError: a folder that is none of these; a missing shard.
        CorruptCheckpointError / NotACheckpointError: a damaged index, shard or ``.metadata``.
    """
    kind, set_path = set_kind(os.fspath(path))
    if kind == "file":
        return inspect(set_path)
    if kind == "index":
        return _inspect_index(set_path)
    return _inspect_dcp(set_path)


def _inspect_index(path: str) -> CheckpointInfo:
    index = read_index(path)
    tensors: list[TensorInfo] = []
    devices: dict[str, int] = {}
    storage_bytes: dict[str, int] = {}
    globs: dict[str, GlobalInfo] = {}
    size = os.path.getsize(path)
    storages = 0
    fmts = set()
    for shard in index.shards:
        info = inspect(index.shard_path(shard))
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
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (index.metadata or {}).items()}
    meta["shards"] = str(len(index.shards))
    fmt = "sharded-" + (fmts.pop() if len(fmts) == 1 else "mixed")
    return CheckpointInfo(path, fmt, "state_dict", size, tensors, devices, storage_bytes,
                          [_state_dict_info("", [t.key for t in tensors])], list(globs.values()), storages=storages,
                          metadata=meta)


_OPTIMIZER_STATE_RE = re.compile(r"(^|\.)state\.\d+$")  # an optimizer's per-parameter state: no state_dict


def _inspect_dcp(folder: str) -> CheckpointInfo:
    meta = read_dcp_metadata(folder)
    tensors = []
    groups: dict[str, list[str]] = {}
    for fqn, dt, shape in meta.entries:
        if dt is None:
            continue
        dims = shape or ()
        tensors.append(TensorInfo(fqn, list(dims), dt, "cpu", numel(dims) * DTYPE_SIZES.get(dt, 1),
                                  list(contiguous_stride(dims)), 0, fqn))
        comps = meta.planner_data.get(fqn) if meta.planner_data is not None else None
        if isinstance(comps, tuple) and comps:
            parent, leaf = ".".join(map(str, comps[:-1])), str(comps[-1])
        else:
            parent, leaf = "", fqn
        if not _OPTIMIZER_STATE_RE.search(parent):
            groups.setdefault(parent, []).append(leaf)
    non_tensor = [e.fqn for e in meta.entries if e.dtype is None]
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
               if os.path.isfile(os.path.join(folder, n)))
    extra = {"non_tensor_entries": ", ".join(non_tensor)} if non_tensor else {}
    if meta.version is not None:
        extra["dcp_version"] = meta.version
    kind = "state_dict" if len(groups) == 1 and not non_tensor else "training_checkpoint"
    nbytes = sum(t.nbytes for t in tensors)
    return CheckpointInfo(folder, "dcp", kind, size, tensors, {"cpu": len(tensors)} if tensors else {},
                          {"cpu": nbytes} if tensors else {}, [_state_dict_info(g, keys) for g, keys in groups.items()],
                          [GlobalInfo(n, is_dcp_allowed(n)) for n in dict.fromkeys(meta.globals)],
                          storages=len(tensors), metadata=extra or None)
