"""Reading ``ckptool convert``'s output back with torch and comparing it with what was meant to be written.

Each check returns None when the output matches, else a one-line description of the first difference; the caller
turns it into its error (``ckptool.ops.convert.VerificationError``).
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ckptool.model.graph import join
from ckptool.torch_ops.cast import tensor_buffer

if TYPE_CHECKING:
    import torch

_CHUNK = 8 << 20


class ExpectedTensor(NamedTuple):
    """A tensor of a torch output as it must read back: key, dtype name, shape, stride and storage offset (elements),
    ``requires_grad``, and ``storage``, a number shared by exactly the tensors that share one storage."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool
    storage: int


def torch_file_difference(path: str, expected: Sequence[ExpectedTensor], records: Mapping[str, int]) -> str | None:
    """Compare the torch zip file at ``path`` with ``expected`` and ``records`` (record name such as ``data/0`` ->
    CRC-32 expected from the source).

    The file is opened with ``torch.load(mmap=True, weights_only=True)``: every tensor's key (in order), dtype,
    shape, stride, storage offset, ``requires_grad`` and storage sharing are compared; then every storage record is
    read through ``zipfile`` (which checks its CRC-32) and its CRC-32 compared with ``records``.
    """
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except MemoryError:
        raise
    except Exception as e:
        return f"torch.load(weights_only=True) refused it ({type(e).__name__}: {e})"
    if not isinstance(obj, dict) or list(obj) != [t.name for t in expected]:
        return "the state_dict keys differ"
    owner: dict[int, int] = {}
    for t in expected:
        v = obj[t.name]
        want = (f"torch.{t.dtype}", t.shape, t.stride, t.offset, t.requires_grad)
        got = (str(v.dtype), tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.requires_grad)
        if got != want:
            return f"{t.name!r} reads back as {got}, expected {want}"
        st = v.untyped_storage()
        if st.nbytes() and owner.setdefault(st.data_ptr(), t.storage) != t.storage:
            return f"{t.name!r} shares a storage it should not"
    by_storage: dict[int, int] = {}
    for t in expected:
        st = obj[t.name].untyped_storage()
        if st.nbytes() and by_storage.setdefault(t.storage, st.data_ptr()) != st.data_ptr():
            return f"{t.name!r} no longer shares its storage"
    del obj
    try:
        with zipfile.ZipFile(path) as z:
            infos = {i.filename.split("/", 1)[-1]: i for i in z.infolist()}
            for name, crc in records.items():
                info = infos.get(name)
                if info is None or crc != info.CRC:
                    return f"record {name} is missing or its CRC-32 differs from the source's"
                with z.open(info) as fh:
                    while fh.read(_CHUNK):
                        pass
    except zipfile.BadZipFile as e:
        return f"a record fails its CRC-32 check ({e})"
    return None


def array_crc(a: Any) -> int:
    """CRC-32 of the bytes of a NumPy array or a torch tensor (what ``safetensors.safe_open`` returns), in
    row-major order."""
    if hasattr(a, "untyped_storage"):
        return zlib.crc32(tensor_buffer(a))
    import numpy as np

    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)


# ONE-HOME: a second walker over loaded objects beside ckptool.model.objects.iter_object_tensors, which enters a
# container reached twice only once: comparing a state with what DCP gives back (every path its own container)
# needs every path of both. An option there to enter shared containers again would let this one go.
def flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in nested dicts / lists / tuples, by dotted path (``"optim.state.0.momentum_buffer"``)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    stack: list[tuple[str, Any]] = [(prefix, obj)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, torch.Tensor):
            out[path] = v
        elif isinstance(v, dict):
            stack.extend(reversed([(join(path, k), x) for k, x in v.items()]))
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed([(join(path, i), x) for i, x in enumerate(v)]))
    return out


def same_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> str | None:
    """None when both maps hold the same names with equal dtype, shape and bytes; else the first difference."""
    if list(a) != list(b) and set(a) != set(b):
        return f"tensor names differ ({', '.join(sorted(set(a) ^ set(b))[:3])})"
    for k, x in a.items():
        y = b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{k!r} is {y.dtype} {list(y.shape)}, expected {x.dtype} {list(x.shape)}"
        if zlib.crc32(tensor_buffer(x.detach().cpu())) != zlib.crc32(tensor_buffer(y.detach().cpu())):
            return f"{k!r} has different bytes"
    return None
