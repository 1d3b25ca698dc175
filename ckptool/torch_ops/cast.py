"""Storage bytes as torch tensors, for ``ckptool convert``: views over raw buffers, dtype casts, byte buffers.

Only a storage that needs torch (a ``--dtype`` cast, a non-contiguous view stored contiguous, a safetensors
sharing group assembled from its pieces) is materialised, one storage at a time; everything else is copied as bytes
without torch. Storages and tensors are the readers layer's (:class:`~ckptool.formats.tensors.Storage`,
:class:`~ckptool.formats.tensors.Tensor`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptool.errors import UnsupportedError
from ckptool.formats.tensors import Storage, Tensor
from ckptool.readers.structures import read_segments

if TYPE_CHECKING:
    import torch


def torch_dtype(name: str) -> torch.dtype:
    """``torch.<name>``.

    Raises:
        UnsupportedError: the installed torch has no such dtype.
    """
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UnsupportedError(f"dtype {name!r} is not available in this torch ({torch.__version__})")
    return dt


def from_bytes(buf: bytearray, dtype: str) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` over ``buf`` (no copy; ``len(buf)`` is a multiple of the element size)."""
    import torch

    if not buf:
        return torch.empty(0, dtype=torch_dtype(dtype))
    return torch.frombuffer(buf, dtype=torch.uint8).view(torch_dtype(dtype))


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """The bytes of tensor ``t`` (on the CPU) in row-major order, without a copy when ``t`` is contiguous: a
    buffer for ``write`` and ``zlib.crc32`` (``len()`` is the byte count)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data


class FlatCache:
    """Materialises storages as 1-D tensors of their output dtype, keeping only the last one (memory stays bounded
    by the largest storage): a cache of torch buffers over :class:`~ckptool.formats.tensors.Storage`, not a
    model of its own.

    ``read(path, offset, nbytes)`` returns the bytes of a file range; ``out_dtype(dtype)`` names the dtype a
    storage of ``dtype`` is written as (a cast, or ``dtype`` itself).
    """

    def __init__(self, read: Callable[[str, int, int], bytearray], out_dtype: Callable[[str], str]) -> None:
        self.read, self.out_dtype = read, out_dtype
        self._key: int | None = None
        self._flat: torch.Tensor | None = None

    def flat(self, st: Storage) -> torch.Tensor:
        """The storage ``st`` as a 1-D tensor of its output dtype."""
        if self._key == id(st) and self._flat is not None:
            return self._flat
        self._flat = None  # release the previous storage before reading the next
        import torch

        if st.segments is not None:  # gathered from several files (a DeepSpeed ZeRO parameter)
            flat = from_bytes(read_segments(st.segments, self.read), st.dtype)
        elif st.pieces is None:
            flat = from_bytes(self.read(st.path, st.offset, st.nbytes), st.dtype)
        else:
            flat = torch.empty(st.numel, dtype=torch_dtype(st.dtype))
            for p in st.pieces:
                data = from_bytes(self.read(st.path, p.file_offset, p.nbytes), st.dtype)
                flat.as_strided(p.shape, p.stride, p.offset).copy_(data.reshape(p.shape))
        out = self.out_dtype(st.dtype)
        if out != st.dtype:
            flat = flat.to(torch_dtype(out))
        self._key, self._flat = id(st), flat
        return flat

    def view(self, t: Tensor) -> torch.Tensor:
        """The tensor ``t`` (its view of the materialised storage, output dtype)."""
        return self.flat(t.storage).as_strided(t.shape, t.stride, t.offset)
