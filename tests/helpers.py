"""Helpers shared by the tests: a CUDA skip marker, deep tensor comparison, storage-sharing groups, and a
read-only scan of the persistent ids in a torch checkpoint.

None of this imports ``ckptool``: it is the independent reference the package is checked against.
"""

from __future__ import annotations

import io
import math
import pickletools
import zipfile
from collections.abc import Iterator
from os import PathLike
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

__all__ = [
    "StorageRef",
    "assert_same_tensors",
    "location_tags",
    "main_pickle_bytes",
    "requires_cuda",
    "storage_groups",
    "storage_refs",
]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---------------------------------------------------------------------------------------------------------
# comparing loaded objects


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as raw bytes (uint8, 1-D, in logical order): bit-exact, NaN-safe, any dtype."""
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)


def _assert_tensor(a: torch.Tensor, b: torch.Tensor, path: str, check_device: bool) -> None:
    """One tensor pair: type, dtype, shape, strides, offset, requires_grad, device, and the bits."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.stride() == b.stride(), f"{path}: stride {a.stride()} != {b.stride()}"
    assert a.storage_offset() == b.storage_offset(), f"{path}: offset {a.storage_offset()} != {b.storage_offset()}"
    assert a.requires_grad == b.requires_grad, f"{path}: requires_grad {a.requires_grad} != {b.requires_grad}"
    if check_device:
        assert a.device == b.device, f"{path}: device {a.device} != {b.device}"
    assert torch.equal(_tensor_bytes(a), _tensor_bytes(b)), f"{path}: values differ"


def _module_parts(m: nn.Module) -> dict[str, Any]:
    """The parts of a module compared by :func:`assert_same_tensors`."""
    return {"training": m.training, "_parameters": m._parameters, "_buffers": m._buffers, "_modules": m._modules,
            "_non_persistent_buffers_set": m._non_persistent_buffers_set}


def assert_same_tensors(a: Any, b: Any, *, check_device: bool = True, path: str = "") -> None:
    """Assert two loaded objects are the same, recursively.

    Dicts (keys in the same order, and a ``_metadata`` attribute if either has one), lists, tuples and
    ``nn.Module`` objects (type, parameters, buffers, submodules) are walked. Tensors must match in type
    (Parameter or not), dtype, shape, stride, storage offset, requires_grad, device (unless
    ``check_device=False``) and the bytes of every element, so NaNs and -0.0 compare by bit pattern. Other
    values compare with ``==`` (floats: NaN equals NaN).
    """
    where = path or "<root>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        _assert_tensor(a, b, where, check_device)
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, nn.Module):
        assert_same_tensors(_module_parts(a), _module_parts(b), check_device=check_device, path=path)
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same_tensors(a[k], b[k], check_device=check_device, path=f"{path}/{k}")
        meta_a, meta_b = getattr(a, "_metadata", None), getattr(b, "_metadata", None)
        if meta_a is not None or meta_b is not None:
            assert meta_a == meta_b, f"{where}: _metadata {meta_a} != {meta_b}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, check_device=check_device, path=f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), f"{where}: nan != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _walk_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in nested dicts / lists / tuples / modules.

    A top-level dict key is its own path (``'fc.weight'``); nesting joins with ``/``
    (``'optimizer_state_dict/state/0/exp_avg'``, ``'module/_parameters/weight'`` for a pickled module).
    """
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, nn.Module):
        for k, v in _module_parts(obj).items():
            yield from _walk_tensors(v, f"{path}/{k}" if path else k)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk_tensors(v, f"{path}/{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk_tensors(v, f"{path}/{i}" if path else str(i))


def storage_groups(obj: Any) -> set[frozenset[str]]:
    """Which tensors share a storage: a set of groups (each a frozenset of paths, 2 or more per group).

    Paths are as in :func:`_walk_tensors`. Storages are told apart by ``untyped_storage().data_ptr()``;
    zero-byte storages (data_ptr 0) are left out, they share nothing. Compare before and after a rewrite:
    ``storage_groups(loaded_before) == storage_groups(loaded_after)``.
    """
    by_ptr: dict[tuple[str, int], set[str]] = {}
    for path, t in _walk_tensors(obj):
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() == 0:
            continue
        by_ptr.setdefault((str(s.device), s.data_ptr()), set()).add(path)
    return {frozenset(paths) for paths in by_ptr.values() if len(paths) > 1}


# ---------------------------------------------------------------------------------------------------------
# reading persistent ids without unpickling


class StorageRef(NamedTuple):
    """One storage persistent id as written in the pickle.

    There is one per pickled tensor object: views of one storage repeat its key, but a tensor object that
    appears twice (tied weights) is pickled once and fetched from the memo the second time.
    """

    storage_type: str  # 'torch.FloatStorage', 'torch.UntypedStorage', ...
    key: str  # 'data/<key>' record (zip) or legacy storage key
    location: str  # 'cpu', 'cuda:0', ...
    numel: int  # elements (bytes for UntypedStorage)
    location_memoized: bool  # the location came from BINGET (memo) rather than a string opcode


_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def main_pickle_bytes(path: str | PathLike[str]) -> bytes:
    """The pickle that holds the object: ``*/data.pkl`` of a zip checkpoint, the 4th pickle of a legacy file."""
    with open(path, "rb") as f:
        head = f.read(len(_LEGACY_MAGIC))
    if head.startswith(b"PK"):
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            assert len(names) == 1, f"{path}: data.pkl records {names}"
            return zf.read(names[0])
    assert head == _LEGACY_MAGIC, f"{path}: neither zip nor legacy torch file"
    with open(path, "rb") as f:
        for _ in range(3):  # magic number, protocol version, sys_info
            for _op in pickletools.genops(f):
                pass
        start = f.tell()
        for _op in pickletools.genops(f):
            pass
        end = f.tell()
        f.seek(start)
        return f.read(end - start)


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_INT_OPS = {"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}


def storage_refs(path: str | PathLike[str]) -> list[StorageRef]:
    """Every storage persistent id in the checkpoint's main pickle, in order, found with ``pickletools.genops``.

    Nothing is unpickled or imported. The scan follows the flat tuple torch writes
    (``MARK 'storage' GLOBAL key location numel [view_metadata] TUPLE BINPERSID``), resolving memo gets of
    strings and globals; legacy ``('module', cls, file, source)`` ids are skipped.
    """
    memo: dict[int, tuple[Any, bool]] = {}
    last: tuple[Any, bool] | None = None  # the value the previous op pushed, if it is a simple one
    frame: list[tuple[Any, bool]] | None = None  # values since the last MARK
    finished: list[tuple[Any, bool]] | None = None  # the tuple just built, if it was a flat MARK ... TUPLE
    refs = []
    for op, arg, _pos in pickletools.genops(io.BytesIO(main_pickle_bytes(path))):
        name = op.name
        value: tuple[Any, bool] | None = None
        if name in _STRING_OPS or name in _INT_OPS:
            value = (arg, False)
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            value = (str(arg).replace(" ", ".") if name == "GLOBAL" else "<stack_global>", False)
        elif name == "NONE":
            value = (None, False)
        elif name in _GET_OPS:
            got = memo.get(arg)
            value = (got[0], True) if got is not None else ("<memo>", True)
        if name in _PUT_OPS or name == "MEMOIZE":
            if last is not None:
                memo[arg if name != "MEMOIZE" else len(memo)] = last
            continue  # a put leaves the stack as it was
        if name == "MARK":
            frame, finished = [], None
        elif name == "TUPLE" and frame is not None:
            finished, frame = frame, None
        elif name == "BINPERSID" and finished is not None:
            vals = [v for v, _ in finished]
            if len(vals) >= 5 and vals[0] == "storage":
                refs.append(StorageRef(str(vals[1]), str(vals[2]), str(vals[3]), int(vals[4]), finished[3][1]))
            finished = None
        elif frame is not None:
            if value is not None:
                frame.append(value)
            else:
                frame = None  # something nested: not a flat persistent-id tuple
        last = value
    return refs


def location_tags(path: str | PathLike[str]) -> list[str]:
    """The location tag of every storage persistent id, in pickle order (see :func:`storage_refs`)."""
    return [r.location for r in storage_refs(path)]
