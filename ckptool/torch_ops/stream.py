"""Stream a checkpoint's tensor bytes straight from the file into a model's own memory.

:func:`~ckptool.torch_ops.load.load_into`, :func:`~ckptool.torch_ops.verify.verify` and
:func:`~ckptool.torch_ops.training.load_training_state` open a file through a :class:`FileSpans`:

* a torch zip file is loaded with ``torch.load(path, mmap=True, map_location="cpu")`` (torch maps the whole file
  ``MAP_PRIVATE`` and every storage is a slice of that mapping: nothing is read yet);
* a safetensors file is mapped with :mod:`mmap` (``ACCESS_COPY``) and every tensor gets its own storage, a slice
  of that mapping over its ``data_offsets`` range (header: :func:`~ckptool.formats.safetensors.read_header`).

The mapping's address range and the file offset it starts at are taken from ``/proc/self/maps`` (the line whose
inode is the open file's), so the file offset of any mapped tensor is ``data_ptr() - start + offset``. Instead of
touching the mapped pages (which would count as resident memory a second time), :meth:`FileSpans.read_into`
``preadv``-s each tensor's bytes into the model's parameter or buffer; on a CUDA device the bytes go through a
bounded pinned staging buffer (two buffers of at most :data:`CHUNK` bytes, so device memory never holds more than
the model). Where the location cannot be proven (no ``/proc/self/maps``, a view that is not contiguous, a dtype
cast), the mapped tensor itself is handed to ``load_state_dict``, which copies it as torch would.

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckptool.errors import CorruptCheckpointError
from ckptool.formats.dtypes import ST_NAMES, contiguous_stride, numel
from ckptool.torch_ops.cast import torch_dtype
from ckptool.torch_ops.devices import MoveMemo, map_tensors, move_tensor
from ckptool.torch_ops.trusted import GUARDED

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ckptool.readers.structures import SafetensorsHeader

__all__ = ["CHUNK", "FileSpans"]

#: bytes per ``preadv`` call and size of each pinned staging buffer (64 MiB)
CHUNK = 64 << 20


def _plain(t: torch.Tensor) -> bool:
    """A strided, non-quantized ``Tensor`` or ``Parameter`` (not a subclass): one whose bytes are its storage's."""
    import torch

    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_quantized


def _view(ptr: int, n: int) -> memoryview:
    """A writable memoryview of ``n`` bytes of this process's memory at address ``ptr``."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


def _pread_into(fd: int, ptr: int, n: int, offset: int) -> None:
    """Fill ``n`` bytes at address ``ptr`` from file ``fd`` at ``offset`` (``os.preadv``, :data:`CHUNK` at a time).

    Raises:
        CorruptCheckpointError: the file ended early (it was truncated while being read).
    """
    done = 0
    while done < n:
        step = min(CHUNK, n - done)
        got = os.preadv(fd, [_view(ptr + done, step)], offset + done)
        if got <= 0:
            raise CorruptCheckpointError(f"the checkpoint ended {n - done} bytes early while being read; was it "
                                         "truncated meanwhile?")
        done += got


class FileSpans:
    """The files one load has memory-mapped, and where each mapped byte lives in them.

    Use as a context manager (the file descriptors are closed at exit; the mappings live as long as their
    tensors). :meth:`available` says whether this platform lets the locations be proven (Linux).
    """

    def __init__(self) -> None:
        #: sorted (start address, end address, file offset of start, fd)
        self._spans: list[tuple[int, int, int, int]] = []
        self._fds: list[int] = []
        self._staging: list[Any] = []
        self._events: list[Any] = []

    @staticmethod
    def available() -> bool:
        """True on Linux, where ``/proc/self/maps`` tells which file and offset a mapped address is."""
        return sys.platform.startswith("linux") and os.path.exists("/proc/self/maps")

    def __enter__(self) -> FileSpans:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the files (mapped tensors stay valid: the mappings hold the files themselves)."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._spans.clear()
        self._staging.clear()
        self._events.clear()

    # -------------------------------------------------------------------------------------------- opening files
    def _open(self, path: str) -> int:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._fds.append(fd)
        return fd

    def _add(self, start: int, end: int, offset: int, fd: int) -> None:
        bisect.insort(self._spans, (start, end, offset, fd))

    def _add_proc_maps(self, fd: int) -> None:
        """Record every mapping of ``fd``'s file (same inode and device) listed in ``/proc/self/maps``."""
        st = os.fstat(fd)
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6 or int(parts[4]) != st.st_ino:
                    continue
                major, _, minor = parts[3].partition(":")
                if os.makedev(int(major, 16), int(minor, 16)) != st.st_dev:
                    continue
                lo, _, hi = parts[0].partition("-")
                self._add(int(lo, 16), int(hi, 16), int(parts[2], 16), fd)

    def torch_load(self, path: str, *, trust: bool) -> Any:
        """``torch.load(path, mmap=True, map_location="cpu", weights_only=not trust)`` with the mapping recorded.

        The file is opened first, so the mapping found is the one of the file this load read (a file replaced
        meanwhile has another inode). torch's own exceptions propagate (the caller words them).
        """
        import torch

        fd = self._open(path)
        extra = {"pickle_module": GUARDED} if trust else {}  # with trust, gadgets are still refused
        obj = torch.load(path, mmap=True, map_location="cpu", weights_only=not trust, **extra)
        self._add_proc_maps(fd)
        return obj

    def safetensors_load(self, path: str, header: SafetensorsHeader) -> dict[str, torch.Tensor]:
        """Every tensor of the safetensors file at ``path`` (parsed ``header``) as a view of one ``ACCESS_COPY``
        mapping of the file (nothing read yet), in header order.

        Raises:
            CorruptCheckpointError: an entry's byte range does not hold ``numel * element size`` bytes.
            UnsupportedError: a dtype this torch does not have.
        """
        import torch

        fd = self._open(path)
        size = os.fstat(fd).st_size
        out: dict[str, torch.Tensor] = {}
        whole = None
        if size:
            whole = torch.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_COPY), dtype=torch.uint8)
            self._add(whole.data_ptr(), whole.data_ptr() + size, 0, fd)
        for name, e in header.entries.items():
            dtype = torch_dtype(ST_NAMES.get(e["dtype"], e["dtype"].lower()))
            shape = tuple(e["shape"])
            begin, end = (header.data_start + x for x in e["data_offsets"])
            if end - begin != numel(shape) * dtype.itemsize:
                raise CorruptCheckpointError(
                    f"{path}: safetensors entry {name!r} has {end - begin} bytes for shape {list(shape)} of "
                    f"{e['dtype']}; the file is damaged, re-download it")
            if whole is None or begin == end:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            # its own storage (as safetensors.torch.load_file gives), a slice of the mapping; unaligned: a copy
            storage = whole.untyped_storage()[begin:end]
            if begin % dtype.itemsize:
                storage = storage.clone()
            out[name] = torch.empty(0, dtype=dtype).set_(storage, 0, shape, contiguous_stride(shape))
        return out

    # -------------------------------------------------------------------------------------------- locating bytes
    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """``(fd, file offset)`` of the bytes of ``t`` when ``t`` is a contiguous plain CPU tensor lying wholly in
        a recorded mapping, else None."""
        if not self._spans or t.device.type != "cpu" or not _plain(t) or not t.is_contiguous():
            return None
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        i = bisect.bisect_right(self._spans, (ptr, float("inf"))) - 1
        if i < 0 or n == 0:
            return None
        start, end, offset, fd = self._spans[i]
        return (fd, ptr - start + offset) if start <= ptr and ptr + n <= end else None

    def _staging_buffers(self, n: int) -> list[Any]:
        import torch

        size = min(CHUNK, n)
        if not self._staging or self._staging[0].numel() < size:
            self._staging = [torch.empty(size, dtype=torch.uint8).pin_memory() for _ in range(2)]
            self._events = [None, None]
        return self._staging

    def _file_bytes(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int] | None:
        """``(fd, file offset, bytes)`` of ``src`` when ``dst`` can take them as they are (same dtype and shape,
        a plain tensor on the CPU or a CUDA device) and :meth:`locate` finds them, else None."""
        if dst.dtype != src.dtype or tuple(dst.shape) != tuple(src.shape) or not _plain(dst):
            return None
        if dst.device.type not in ("cpu", "cuda"):
            return None
        where = self.locate(src)
        return None if where is None else (*where, src.numel() * src.element_size())

    def read_into(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Copy ``src``'s bytes from the file into ``dst`` (same dtype and shape, contiguous, on the CPU or a
        CUDA device) without touching ``src``'s mapped pages. Returns False, copying nothing, when that cannot be
        done (then ``dst.copy_(src)`` is the way)."""
        span = self._file_bytes(dst, src)  # checks dst is plain first (a sparse tensor has no is_contiguous)
        if span is None or not dst.is_contiguous():
            return False
        fd, offset, n = span
        if dst.device.type == "cpu":
            _pread_into(fd, dst.data_ptr(), n, offset)
            return True
        self._to_device(fd, offset, n, dst)
        return True

    def _to_device(self, fd: int, offset: int, n: int, dst: torch.Tensor) -> None:
        """File bytes ``[offset, offset + n)`` into the CUDA tensor ``dst`` through two pinned buffers in turn
        (a buffer is refilled only once its previous copy has finished)."""
        import torch

        with torch.cuda.device(dst.device):  # the events are recorded on the stream that runs the copies
            self._staged_copies(fd, offset, n, dst)

    def _staged_copies(self, fd: int, offset: int, n: int, dst: torch.Tensor) -> None:
        import torch

        flat = dst.detach().reshape(-1).view(torch.uint8)
        bufs = self._staging_buffers(n)
        size = bufs[0].numel()
        for k, pos in enumerate(range(0, n, size)):
            step = min(size, n - pos)
            slot = k % 2
            ev = self._events[slot]
            if ev is not None:
                ev.synchronize()
            _pread_into(fd, bufs[slot].data_ptr(), step, offset + pos)
            flat[pos:pos + step].copy_(bufs[slot][:step], non_blocking=True)
            ev = self._events[slot] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record()
        for ev in self._events:
            if ev is not None:
                ev.synchronize()

    def same_bits(self, dst: torch.Tensor, src: torch.Tensor) -> bool | None:
        """Whether ``dst`` holds exactly ``src``'s bytes (same dtype and shape), read from the file
        :data:`CHUNK` at a time; None when ``src``'s bytes cannot be located (compare the tensors instead)."""
        import torch

        span = self._file_bytes(dst, src)
        if span is None:
            return None
        fd, offset, n = span
        flat = dst.detach().contiguous().reshape(-1).view(torch.uint8)
        buf = torch.empty(min(CHUNK, n), dtype=torch.uint8)
        for pos in range(0, n, buf.numel()):
            step = min(buf.numel(), n - pos)
            _pread_into(fd, buf.data_ptr(), step, offset + pos)
            if not torch.equal(flat[pos:pos + step].cpu(), buf[:step]):
                return False
        return True

    # -------------------------------------------------------------------------------------------- materialising
    def materialize(self, obj: Any, device: torch.device, skip: Mapping[str, Any] | None = None) -> Any:
        """``obj`` rebuilt (:func:`~ckptool.torch_ops.devices.map_tensors`: sharing kept) with every mapped
        tensor given its own memory on ``device``, read from the file by storage (each storage once, views kept
        as views); other tensors are moved as :func:`~ckptool.torch_ops.devices.move_tensor` does. ``skip`` (the
        state_dict already streamed into the model) is kept as it is. After this nothing in the result depends on
        the file (which may then be overwritten)."""
        import torch

        memo = MoveMemo()
        storages: dict[int, torch.UntypedStorage] = {}

        def own(t: torch.Tensor) -> torch.Tensor:
            if not _plain(t) or t.device.type != "cpu":
                return move_tensor(t, device, memo)
            st = t.untyped_storage()
            nbytes = st.nbytes()
            whole = torch.empty(0, dtype=torch.uint8).set_(st)
            where = self.locate(whole) if nbytes else None
            if where is None:
                return move_tensor(t, device, memo) if device.type != "cpu" else t
            new = storages.get(st.data_ptr())
            if new is None:
                target = torch.empty(nbytes, dtype=torch.uint8, device=device)
                if device.type == "cpu":
                    _pread_into(where[0], target.data_ptr(), nbytes, where[1])
                else:
                    self._to_device(where[0], where[1], nbytes, target)
                new = storages[st.data_ptr()] = target.untyped_storage()
            with torch.no_grad():
                out = torch.empty(0, dtype=t.dtype, device=device).set_(new, t.storage_offset(), t.size(), t.stride())
            if isinstance(t, torch.nn.Parameter):
                return torch.nn.Parameter(out, requires_grad=t.requires_grad)
            return out.requires_grad_(t.requires_grad) if t.is_leaf else out

        return map_tensors(obj, own, memo, special=(lambda o: o if o is skip else None) if skip is not None else None)
