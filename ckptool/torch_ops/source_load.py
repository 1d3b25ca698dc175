"""A readers-layer :class:`~ckptool.formats.tensors.Source` as torch tensors: the loader of the formats torch has no
safe loader for (torch.package archives, read without running their code, :mod:`ckptool.readers.read_package`),
and of DeepSpeed ZeRO folders (:mod:`ckptool.torch_ops.zero`).

One torch storage per :class:`~ckptool.formats.tensors.Storage`: its bytes are read straight into a
``torch.empty(nbytes, dtype=torch.uint8)`` buffer (:func:`ckptool.readers.data.read_storage`: ``readinto``, one
copy from file to tensor), viewed as the storage's dtype and moved to the device; every tensor is a view of it
(``as_strided(shape, stride, storage_offset)``), so tensors that share a storage in the checkpoint share one here,
as ``torch.load`` and ``PackageImporter.load_pickle`` give them. Nothing of the checkpoint is unpickled by torch.
A storage whose zip entry records a CRC-32 of exactly its bytes (``Storage.crc``) is checked against it as it is
read, so that ``verify`` holds a package's tensors to the writer's record, not only to this reader.

Importing this module does not import torch; :func:`load_source` imports it when called.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats.tensors import Source, Storage
from ckptool.model.graph import mapping_items
from ckptool.readers.data import FileRanges, read_storage
from ckptool.torch_ops.cast import torch_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["load_source", "source_metadata"]


def _load_storage(st: Storage, files: FileRanges, device: torch.device) -> torch.Tensor:
    """``st``'s bytes as a 1-D tensor of its dtype on ``device`` (read on the CPU, then moved)."""
    import torch

    buf = torch.empty(st.nbytes, dtype=torch.uint8)
    if st.nbytes:
        mv = buf.numpy().data  # the tensor's own memory
        read_storage(st, mv, files)  # readinto, no intermediate copy
        if st.crc is not None and st.pieces is None and st.segments is None:
            found = zlib.crc32(mv)  # the writer's record of the bytes: evidence independent of this reader
            if found != st.crc:
                raise CorruptCheckpointError(
                    f"{st.path}: the {st.nbytes} bytes at offset {st.offset} do not match the CRC-32 their zip "
                    f"entry records ({found:08x}, recorded {st.crc:08x}); the file is damaged, re-download it")
    dt = torch_dtype(st.dtype)
    try:
        flat = buf.view(dt)
    except RuntimeError as e:  # a dtype torch cannot view bytes as (quantized, bit-packed)
        raise UnsupportedError(f"{st.path}: a storage of {st.dtype} cannot be rebuilt from its bytes ({e})") from None
    return flat.to(device)


def source_metadata(src: Source) -> OrderedDict[str, dict[str, Any]] | None:
    """The ``_metadata`` of the selected ``OrderedDict`` state_dict (module path -> ``{"version": n}``, as
    ``nn.Module.state_dict`` records it and ``load_state_dict`` passes to each module's
    ``_load_from_state_dict``), from ``src.sd_state`` (its pickled BUILD state); None when there is none or it is
    not a mapping of mappings of plain values."""
    state = src.sd_state
    items = mapping_items(state.get("_metadata")) if isinstance(state, dict) else None
    if items is None:
        return None
    out: OrderedDict[str, dict[str, Any]] = OrderedDict()
    for path, entry in items:
        inner = mapping_items(entry)
        if not isinstance(path, str) or inner is None:
            return None
        if not all(isinstance(k, str) and type(v) in (int, bool, float, str, type(None)) for k, v in inner):
            return None
        out[path] = dict(inner)
    return out


def load_source(src: Source, device: torch.device | str = "cpu") -> OrderedDict[str, torch.Tensor]:
    """The tensors of ``src`` (every storage read once, in the order its tensors first use it), by name in
    state_dict order, each a view ``(shape, stride, offset)`` of one tensor per :class:`Storage` on ``device``, so
    that storage sharing (tied weights, views) survives; the ``OrderedDict`` carries the state_dict's
    ``_metadata`` (:func:`source_metadata`) when the source records one. Memory: the tensors on ``device``, plus
    one storage at a time on the CPU when ``device`` is another.

    Raises:
        CorruptCheckpointError: a file ends before a storage's bytes (:func:`ckptool.readers.data.read_storage`);
            bytes that do not match the CRC-32 their zip entry records.
        UnsupportedError: a dtype this torch lacks or cannot view bytes as.
        RemoteError: a URL's bytes could not be read.
    """
    import torch

    dev = torch.device(device)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    flats: dict[int, torch.Tensor] = {}
    with FileRanges() as files:
        for t in src.tensors:
            flat = flats.get(id(t.storage))
            if flat is None:
                flat = flats[id(t.storage)] = _load_storage(t.storage, files, dev)
            out[t.name] = flat.as_strided(t.shape, t.stride, t.offset)
    meta = source_metadata(src)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]  # as nn.Module.state_dict sets it
    return out
