"""DCP folders for the tests: written by torch's own ``dcp.save`` (:func:`save_dcp`, storages optionally tagged for
a GPU), read back by torch's ``dcp_to_torch_save`` (:func:`dcp_back`), or laid out by hand as ``FileSystemWriter``
lays them out (:func:`craft`) for the chunkings, records or entries torch's writer does not make in one process."""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from tagging import location_tags
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

#: the chunks of one tensor entry: ``[(offsets, sizes, rank)]``
Chunks = list[tuple[tuple[int, ...], tuple[int, ...], int]]


def craft(folder: Path, tensors: dict[str, tuple[Any, Chunks]], *,
          records: dict[tuple[str, tuple[int, ...]], bytes] | None = None, values: dict[str, bytes] | None = None,
          planner: dict[str, tuple[Any, ...]] | None = None) -> Path:
    """Write the DCP folder ``folder``: each tensor ``fqn -> (whole tensor, chunks)`` saved as one ``torch.save``
    record per chunk in ``__<rank>_0.distcp`` (``records`` replaces the bytes of a chunk's record, keyed
    ``(fqn, offsets)``), each non-tensor entry ``fqn -> record bytes`` of ``values`` in ``__0_0.distcp``;
    ``planner`` is ``planner_data``. Returns ``folder``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    folder.mkdir()
    files: dict[str, bytearray] = {}
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}

    def put(rank: int, data: bytes) -> tuple[str, int]:
        name = f"__{rank}_0.distcp"
        f = files.setdefault(name, bytearray())
        f += data
        return name, len(f) - len(data)

    for fqn, (whole, chunks) in tensors.items():
        listed = []
        for offsets, sizes, rank in chunks:
            buf = io.BytesIO()
            torch.save(whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone(), buf)
            data = (records or {}).get((fqn, offsets), buf.getvalue())
            name, at = put(rank, data)
            storage[MetadataIndex(fqn, torch.Size(offsets))] = _StorageInfo(name, at, len(data))
            listed.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=whole.dtype), whole.size(), listed)
    for fqn, data in (values or {}).items():
        name, at = put(0, data)
        storage[MetadataIndex(fqn)] = _StorageInfo(name, at, len(data))
        sdm[fqn] = BytesStorageMetadata()
    for name, data in files.items():
        (folder / name).write_bytes(bytes(data))
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(Metadata(sdm, planner_data=planner, storage_data=storage), fh)
    return folder


def save_dcp(state: dict[str, Any], folder: Path, cuda: tuple[torch.Tensor, ...] = (), **writer: Any) -> Path:
    """``dcp.save(state)`` into ``folder`` in this process through a ``FileSystemWriter(folder, **writer)`` (several
    data files, another serialization); the storages of ``cuda`` are tagged ``cuda:0``, as a GPU machine writes
    them. Returns ``folder``."""
    ptrs = {t.untyped_storage().data_ptr() for t in cuda}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with location_tags(lambda storage, real: "cuda:0" if storage.data_ptr() in ptrs else real):
            dcp.save(state, storage_writer=FileSystemWriter(str(folder), **writer), no_dist=True)
    return folder


def dcp_back(folder: Path) -> Any:
    """The folder as torch's ``dcp_to_torch_save`` writes it, loaded (``weights_only=False``: our own test data)."""
    out = folder.parent / f"{folder.name}.back.pt"
    dcp_to_torch_save(folder, out)
    try:
        return torch.load(out, weights_only=False)
    finally:
        out.unlink()
