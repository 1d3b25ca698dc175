"""DCP folders laid out by hand, as ``torch.distributed.checkpoint``'s ``FileSystemWriter`` lays them out, for the
tests that need chunkings, records or entries torch's own writer does not make in one process
(``tests/test_dcp_reader.py``, ``tests/test_dcp_load.py``)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

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
