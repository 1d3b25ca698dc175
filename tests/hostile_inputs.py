"""Tiny hostile checkpoints for the bounded-by-the-input tests (issue 36): each a few KiB whose structure declares
far more than it holds, or that is cut short. :func:`make_case` writes one into a folder and returns its path.

* ``stride0.pt``: ``torch.save`` of ``torch.zeros(1).expand(2**20, 2**20)`` (torch.save stores the 4-byte storage
  and the stride-0 view: 4 TiB once made dense);
* ``dcp_stride0``: a DCP folder whose record is ``zeros(1).expand(2**30)`` under a ``.metadata`` declaring 2^30
  elements (4 GiB);
* ``dcp_declared``: a DCP folder whose ``.metadata`` declares ``[2**20, 2**20]`` over a 4-element record;
* ``dcp_offset``: a DCP folder whose ``.metadata`` puts the record a GB past the end of its ``.distcp`` file;
* ``truncated.pth``: a legacy (``_use_new_zipfile_serialization=False``) file cut at half its length;
* ``truncated.pt``: a torch zip cut at half its length (no end of central directory).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from dcp_craft import craft

CASES = ("stride0.pt", "dcp_stride0", "dcp_declared", "dcp_offset", "truncated.pth", "truncated.pt")


def _edit_metadata(folder: Path, edit: Any) -> Path:
    """Rewrite ``folder/.metadata`` through ``edit(metadata)`` (pickled back as torch's writer pickles it)."""
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own test file
    edit(meta)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return folder


def _declare(meta: Any, size: tuple[int, ...]) -> None:
    """Tensor ``w`` declared ``size``, in one chunk at the origin (its record keyed there)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md = meta.state_dict_metadata["w"]
    old = MetadataIndex("w", torch.Size([0] * len(md.size)))
    md.size = torch.Size(size)
    md.chunks = [ChunkStorageMetadata(torch.Size([0] * len(size)), torch.Size(size))]
    meta.storage_data[MetadataIndex("w", torch.Size([0] * len(size)))] = meta.storage_data.pop(old)


def _past_end(meta: Any) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    key = MetadataIndex("w", torch.Size([0]))
    info = meta.storage_data[key]
    meta.storage_data[key] = type(info)(info.relative_path, 10**9, info.length)


def dcp_expanded(path: Path, n: int) -> Path:
    """A DCP folder at ``path`` whose tensor ``w`` is declared ``[n]`` over a record holding
    ``torch.ones(1).expand(n)`` (its 4-byte storage and a stride-0 view). Returns ``path``."""
    rec = io.BytesIO()
    torch.save(torch.ones(1).expand(n), rec)
    craft(path, {"w": (torch.zeros(4), [((0,), (4,), 0)])}, records={("w", (0,)): rec.getvalue()})
    return _edit_metadata(path, lambda m: _declare(m, (n,)))


def make_case(name: str, folder: Path) -> Path:
    """Write hostile case ``name`` (one of :data:`CASES`) into ``folder``; returns its path."""
    path = folder / name
    if name == "stride0.pt":
        torch.save({"w": torch.zeros(1).expand(2**20, 2**20)}, path)
    elif name == "dcp_stride0":
        dcp_expanded(path, 2**30)
    elif name == "dcp_declared":
        craft(path, {"w": (torch.zeros(4), [((0,), (4,), 0)])})
        _edit_metadata(path, lambda m: _declare(m, (2**20, 2**20)))
    elif name == "dcp_offset":
        craft(path, {"w": (torch.zeros(4), [((0,), (4,), 0)])})
        _edit_metadata(path, _past_end)
    elif name in ("truncated.pth", "truncated.pt"):
        buf = io.BytesIO()
        torch.save({"w": torch.arange(100_000.0)}, buf, _use_new_zipfile_serialization=name.endswith(".pt"))
        data = buf.getvalue()
        path.write_bytes(data[:len(data) // 2])
    else:
        raise ValueError(name)
    return path
