"""How ``ckptool inspect`` counts bytes: each storage once, however many tensors (tied weights, views) use it.

:func:`byte_totals` makes the rows of the per-location-tag / dtype table (:class:`~ckptool.ops.inspect.entry.ByteTotal`)
from the tensors and every storage of the file; :func:`storage_rows` gives a pickle's storages as such rows
(:class:`~ckptool.formats.nodes.StorageRef`: location tag, dtype and bytes from the storage class), and
:func:`storage_totals` the common case of a torch file without a row per storage.
"""

from __future__ import annotations

from collections import Counter
from itertools import repeat
from operator import itemgetter, mul
from typing import cast

from ckptool.errors import CkptError
from ckptool.formats.dtypes import storage_element
from ckptool.formats.nodes import GlobalMeta, StorageRef
from ckptool.ops.inspect.info import ByteTotal, TensorInfo

__all__ = ["byte_totals", "device_bytes", "merge_totals", "one_storage_each", "storage_row", "storage_rows",
           "storage_totals"]


def storage_row(ref: StorageRef) -> tuple[str, str, int]:
    """``(location tag, dtype, bytes)`` of a storage (an unknown storage class: its numel, as bytes)."""
    try:
        dtype, size = storage_element(ref)  # once: this runs for every storage (50,000 in a big state_dict)
        return ref.location, dtype, ref.numel * size
    except CkptError:
        return ref.location, "unknown", ref.numel


def _one_storage_class(refs: dict[str, StorageRef]) -> StorageRef | None:
    """The first of ``refs`` when they all name one storage class placeholder (the common case), else None."""
    types = [ref.storage_type for ref in refs.values()]
    # == of a placeholder (a class) is identity
    if types and isinstance(types[0], GlobalMeta) and types.count(types[0]) == len(types):
        return next(iter(refs.values()))
    return None


def storage_rows(refs: dict[str, StorageRef]) -> dict[str, tuple[str, str, int]]:
    """:func:`storage_row` of each storage, by key: the element of a storage class looked up once."""
    first = _one_storage_class(refs)
    if first is None:  # several storage classes: one storage at a time
        return {key: storage_row(ref) for key, ref in refs.items()}
    locations = [ref.location for ref in refs.values()]
    numels = [ref.numel for ref in refs.values()]
    try:
        dtype, size = storage_element(first)
    except CkptError:
        return dict(zip(refs, zip(locations, repeat("unknown"), numels)))
    return dict(zip(refs, zip(locations, repeat(dtype), map(mul, numels, repeat(size)))))


def storage_totals(tensors: list[TensorInfo], refs: dict[str, StorageRef]) -> list[ByteTotal]:
    """:func:`byte_totals` of ``tensors`` and the storages ``refs`` (:func:`storage_rows`), without a row per
    storage in the common case: one storage class, every storage used, one location tag and dtype for all tensors
    (the bytes are then the storages' elements times the element size)."""
    first = _one_storage_class(refs)
    if first is not None and tensors:
        devices, dtypes = [t.device for t in tensors], [t.dtype for t in tensors]
        if devices.count(devices[0]) == len(devices) and dtypes.count(dtypes[0]) == len(dtypes) and len(
                refs.keys() & [t.storage_key for t in tensors]) == len(refs):
            try:
                size = storage_element(first)[1]
            except CkptError:
                size = 1  # an unknown storage class: its numel, as bytes (storage_row)
            return [ByteTotal(devices[0], dtypes[0], len(tensors), len(refs),
                              sum([ref.numel for ref in refs.values()]) * size)]
    return byte_totals(tensors, storage_rows(refs))


def byte_totals(tensors: list[TensorInfo], storages: dict[str, tuple[str, str, int]]) -> list[ByteTotal]:
    """One :class:`ByteTotal` per (location tag, dtype), sorted, from ``tensors`` and ``storages`` (storage key ->
    ``(location tag, dtype, bytes)`` of every storage in the file): each storage's bytes are counted once, under the
    first tensor that uses it; storages no tensor uses under their own tag and dtype."""
    devices, dtypes = [t.device for t in tensors], [t.dtype for t in tensors]
    keys = [t.storage_key for t in tensors]
    # the storages tensors use, in order of first use (a tensor without storage, key None, uses none)
    used = cast(list[str], list(filter(storages.__contains__, dict.fromkeys(keys))))
    if None in storages:
        used = [key for key in used if key is not None]
    rows: dict[tuple[str, str], ByteTotal]
    if tensors and devices.count(devices[0]) == len(devices) and dtypes.count(dtypes[0]) == len(dtypes):
        # one location tag and dtype (the common case; == groups as the dict below does): no lookup per storage
        r = ByteTotal(devices[0], dtypes[0], len(tensors), len(used),
                      sum(map(itemgetter(2), map(storages.__getitem__, used))))
        rows = {(r.device, r.dtype): r}
    else:
        groups = list(zip(devices, dtypes))
        rows = {g: ByteTotal(g[0], g[1], n) for g, n in Counter(groups).items()}
        first = dict(zip(reversed(keys), reversed(groups)))  # storage key -> (location tag, dtype) of its first user
        for key in used:
            r = rows[first[key]]
            r.storages += 1
            r.bytes += storages[key][2]
    if len(used) < len(storages):  # storages no tensor uses
        counted = set(used)
        for key, (device, dtype, nbytes) in storages.items():
            if key not in counted:
                r = rows.get((device, dtype))  # type: ignore[assignment]
                if r is None:
                    r = rows[device, dtype] = ByteTotal(device, dtype)
                r.storages += 1
                r.bytes += nbytes
    return [rows[k] for k in sorted(rows)]


def merge_totals(groups: list[list[ByteTotal]]) -> list[ByteTotal]:
    """The rows of several disjoint sets of storages (the shards of a set) added up per (location tag, dtype)."""
    rows: dict[tuple[str, str], ByteTotal] = {}
    for group in groups:
        for r in group:
            acc = rows.setdefault((r.device, r.dtype), ByteTotal(r.device, r.dtype))
            acc.tensors += r.tensors
            acc.storages += r.storages
            acc.bytes += r.bytes
    return [rows[k] for k in sorted(rows)]


def device_bytes(totals: list[ByteTotal]) -> dict[str, int]:
    """Location tag -> storage bytes, from :func:`byte_totals` rows."""
    out: dict[str, int] = {}
    for r in totals:
        out[r.device] = out.get(r.device, 0) + r.bytes
    return out


def one_storage_each(tensors: list[TensorInfo]) -> list[ByteTotal]:
    """:func:`byte_totals` for formats where every tensor has its own data (safetensors, DCP)."""
    return byte_totals(tensors, {t.storage_key or t.key: (t.device, t.dtype, t.nbytes) for t in tensors})
