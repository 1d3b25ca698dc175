"""Reading safetensors files and sharded sets for ``convert``: byte ranges from the headers, sharing restored.

A safetensors file written by ckptool records the storages its tensors shared under ``__metadata__``
(:data:`~ckptool.ops.convert.source.SHARED_KEY`); those groups become one storage again, with every member (the
aliases included) a view of it. A sharded set is read through its ``*.index.json``, shard by shard.
"""

from __future__ import annotations

import json

from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats import detect as formats
from ckptool.formats.dtypes import ST_NAMES, ST_READ_ONLY, contiguous_stride, element_size, numel
from ckptool.formats.safetensors import read_header
from ckptool.formats.sharded import read_index
from ckptool.ops.convert.read_torch import torch_source
from ckptool.ops.convert.source import SHARED_KEY, Piece, Source, Storage, Tensor, is_contiguous, span


def safetensors_source(path: str) -> Source:
    """Read a safetensors file as a :class:`Source`: one storage per stored tensor, and for the sharing groups
    recorded under :data:`SHARED_KEY` one storage per group with every member (aliases included) a view of it.

    Raises:
        UnsupportedError: a dtype code ckptool cannot convert (``F4``...).
        CorruptCheckpointError: a malformed header, an entry whose byte size does not match its shape, or an
            inconsistent sharing record.
    """
    header = read_header(path, strict_metadata=True)
    meta = header.metadata
    src = Source(path, formats.SAFETENSORS, [], key=None, metadata=meta)
    by_name: dict[str, Tensor] = {}
    for i, (name, e) in enumerate(header.entries.items()):
        code = e["dtype"]
        dtype = ST_NAMES.get(code) if code not in ST_READ_ONLY else None
        if dtype is None:
            raise UnsupportedError(f"{path}: tensor {name!r} has safetensors dtype {code!r}, which ckptool "
                                   "cannot convert")
        shape = tuple(e["shape"])
        b, end = e["data_offsets"]
        need = numel(shape) * element_size(dtype)
        if end - b != need:
            raise CorruptCheckpointError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) needs {need} bytes but its "
                                         f"data_offsets span {end - b}; the file is damaged")
        st = Storage(path, header.data_start + b, end - b, dtype, "cpu")
        t = Tensor(name, name, dtype, shape, contiguous_stride(shape), 0, st, False, i)
        by_name[name] = t
        src.tensors.append(t)
    raw = (meta or {}).get(SHARED_KEY)
    members = _restore_groups(src, by_name, raw, path) if raw is not None else set()
    if meta:  # carried to safetensors output, less what ckptool writes anew there
        src.metadata = {k: v for k, v in meta.items() if k != SHARED_KEY and k not in members}
    return src


def _restore_groups(src: Source, by_name: dict[str, Tensor], raw: str, path: str) -> set[str]:
    """Rebuild the storages recorded under :data:`SHARED_KEY` (see :func:`ckptool.ops.convert.plan.shared_metadata`),
    in place; returns the names of every group member."""
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
    aliases: list[tuple[int, Tensor]] = []
    names: set[str] = set()
    for g in groups:
        try:
            dtype, n, members = g["dtype"], int(g["numel"]), g["tensors"]
            esize = element_size(dtype)
            parsed = {name: (int(m[0]), int(m[1]), tuple(int(x) for x in m[2]), tuple(int(x) for x in m[3]))
                      for name, m in members.items()}
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise bad(f"{type(e).__name__}: {e}") from None
        names.update(parsed)
        pieces = []
        for name, (_idx, off, shape, stride) in parsed.items():
            lo, hi = span(off, shape, stride)
            if lo < 0 or hi > n or len(shape) != len(stride):
                raise bad(f"{name!r} runs past its storage")
            t = by_name.get(name)
            if t is not None:
                if t.dtype != dtype or t.shape != shape:
                    raise bad(f"{name!r} is stored as {t.dtype} {list(t.shape)}")
                pieces.append(Piece(t.storage.offset, t.storage.nbytes, off, shape, stride))
        if not pieces:
            raise bad("a group without a stored tensor")
        p0 = pieces[0]
        if len(pieces) == 1 and p0.offset == 0 and p0.nbytes == n * esize and is_contiguous(p0.shape, p0.stride):
            storage = Storage(path, p0.file_offset, p0.nbytes, dtype, "cpu")  # the common case: one stored tensor
        else:
            storage = Storage(path, -1, n * esize, dtype, "cpu", pieces=pieces)
        for name, (idx, off, shape, stride) in parsed.items():
            t = by_name.get(name)
            if t is None:
                t = Tensor(name, name, dtype, shape, stride, off, storage)
                aliases.append((idx, t))
            else:
                t.shape, t.stride, t.offset, t.storage = shape, stride, off, storage
    for idx, t in sorted(aliases, key=lambda a: a[0]):  # back at their places in the state_dict order
        src.tensors.insert(min(max(idx, 0), len(src.tensors)), t)
    for i, t in enumerate(src.tensors):
        t.index = i
    return names


def index_source(index_path: str) -> Source:
    """Read a sharded set through its ``*.index.json``: every shard's tensors, shard by shard in ``weight_map`` order.

    Raises:
        CorruptCheckpointError: the index is not JSON or has no ``weight_map``; a shard lacks a tensor the index
            assigns to it; a tensor appears in two shards.
        UsageError: a shard file is missing.
        (and what reading each shard raises)
    """
    index = read_index(index_path)
    src = Source(index_path, "sharded", [])
    kinds = set()
    seen: dict[str, str] = {}
    for shard in index.shards:
        p = index.shard_path(shard)
        fmt = formats.detect_format(p)
        sub = safetensors_source(p) if fmt == formats.SAFETENSORS else torch_source(p, fmt, None)
        kinds.add("safetensors" if fmt == formats.SAFETENSORS else "torch")
        names = {t.name for t in sub.tensors}
        missing = [n for n, s in index.weight_map.items() if s == shard and n not in names]
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
