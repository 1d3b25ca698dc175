"""Reading ``ckptool convert``'s output back with torch, NumPy or the safetensors library, and comparing it with
what was meant to be written.

Each check returns None when the output matches, else a one-line description of the first difference; the caller
turns it into its error (``ckptool.ops.convert.VerificationError``). Where neither torch nor NumPy is installed
(``pip install ckptool`` without the ``torch`` extra), :mod:`ckptool.ops.convert.verify` checks with ckptool's own
readers instead; :func:`is_installed` and :func:`safetensors_framework` say which check runs.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckptool.formats.dtypes import ST_NAMES, element_size, numel
from ckptool.formats.tensors import Tensor
from ckptool.model.graph import join
from ckptool.torch_ops.cast import tensor_buffer

if TYPE_CHECKING:
    import torch

#: dtypes NumPy holds: files of only these are verified through safetensors' NumPy framework, without torch
NUMPY_DTYPES = frozenset({"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "uint16",
                          "uint32", "uint64", "bool", "complex64"})


def is_installed(module: str) -> bool:
    """True when ``module`` (``"torch"``, ``"numpy"``) imports; it is imported (and stays in ``sys.modules``)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def safetensors_framework(dtypes: Collection[str]) -> str | None:
    """The ``safetensors.safe_open`` framework that can read tensors of ``dtypes`` here: ``"numpy"`` when NumPy is
    installed and holds every one (torch is not imported), else ``"pt"`` when torch is installed, else None
    (neither, or no safetensors library: it comes with the ``torch`` extra; the file is then checked with
    ckptool's own reader)."""
    if not is_installed("safetensors"):
        return None
    if all(d in NUMPY_DTYPES for d in dtypes) and is_installed("numpy"):
        return "numpy"
    return "pt" if is_installed("torch") else None


def _safe_open(path: str, framework: str) -> Any:
    from safetensors import safe_open

    try:  # pread: each tensor read into its own buffer, so memory stays bounded by one tensor
        return safe_open(path, framework=framework, backend="pread")
    except TypeError:  # safetensors < 0.7 has no backend choice
        return safe_open(path, framework=framework)


def safe_open_difference(path: str, expect: Sequence[tuple[str, str, tuple[int, ...], int | None]],
                         metadata: Mapping[str, str] | None, framework: str) -> str | None:
    """Open the safetensors file at ``path`` with ``safetensors.safe_open(framework=framework)`` (``"numpy"`` or
    ``"pt"``, see :func:`safetensors_framework`) and compare its tensor names, each tensor's dtype name, shape and
    CRC-32 (``expect``: ``[(name, dtype, shape, crc or None)]``) and its ``__metadata__`` with ``metadata``.

    Raises:
        Exception: whatever ``safe_open`` raises for a file it refuses (the caller reports it).
    """
    with _safe_open(path, framework) as f:
        names = set(f.keys())
        want = {e[0] for e in expect}
        if names != want:
            return f"tensor names differ ({', '.join(sorted(names ^ want)[:3])})"
        if (f.metadata() or None) != (metadata or None):
            return "__metadata__ differs"
        for name, dtype, shape, crc in expect:
            diff = _tensor_difference(f, name, dtype, tuple(shape), crc)
            if diff is not None:
                return diff
    return None


#: a tensor of more bytes is not read by :func:`safe_open_difference` (only its dtype and shape, from the header):
#: ``safe_open`` reads a whole tensor (a slice too) into memory, so the check's peak would be the largest tensor; its
#: bytes are checked in bounded pieces by the caller (:func:`ckptool.ops.convert.verify.header_difference`)
WHOLE_BYTES = 8 << 20


def _tensor_difference(f: Any, name: str, dtype: str, shape: tuple[int, ...], crc: int | None) -> str | None:
    """Compare tensor ``name`` of the open ``safe_open`` file ``f`` with ``dtype``, ``shape`` and ``crc`` (the CRC-32
    of its bytes, or None); a tensor over :data:`WHOLE_BYTES` only by its header's dtype and shape."""
    if numel(shape) * element_size(dtype) > WHOLE_BYTES:
        sl = f.get_slice(name)
        got_dtype, got_shape = ST_NAMES.get(sl.get_dtype()), tuple(sl.get_shape())
        if got_dtype != dtype or got_shape != shape:
            return f"{name!r} reads back as {got_dtype} {list(got_shape)}, expected {dtype} {list(shape)}"
        return None
    t = f.get_tensor(name)
    if str(t.dtype).removeprefix("torch.") != dtype or tuple(t.shape) != shape:
        return f"{name!r} reads back as {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}"
    if crc is not None and array_crc(t) != crc:
        return f"{name!r} reads back with different bytes (CRC-32)"
    return None


def storage_numbers(tensors: Sequence[Tensor]) -> list[int]:
    """For each of ``tensors``, a number shared by exactly the tensors that share its storage (storage identity,
    ``a.storage is b.storage``), counted from 0 in order of first use."""
    ids: dict[int, int] = {}
    return [ids.setdefault(id(t.storage), len(ids)) for t in tensors]


def _keys_difference(obj: object, names: list[str], entries: Mapping[str, object]) -> str | None:
    """What differs between the loaded ``obj`` and a dict of the tensors ``names`` followed by the plain
    ``entries`` (value for value); None when nothing does."""
    extra = {k: v for k, v in entries.items() if k not in set(names)}
    if not isinstance(obj, dict) or list(obj) != names + list(extra):
        return "the state_dict keys differ"
    if any(obj[k] != v for k, v in extra.items()):
        return "the plain entries differ from the source's"
    return None


def torch_load_difference(path: str, expected: Sequence[Tensor], dtype_of: Callable[[str], str] = str,
                          entries: Mapping[str, object] | None = None) -> str | None:
    """Open the torch zip file at ``path`` with ``torch.load(mmap=True, weights_only=True)`` and compare every
    tensor's key (in order), dtype (``dtype_of(t.dtype)``: the dtype written, after a cast), shape, stride, storage
    offset, ``requires_grad`` and storage sharing with the tensors meant to be written (``expected``), and the
    plain ``entries`` written after them (every other key of the dict, value for value). The storage
    records' CRC-32 are checked by the caller (:func:`ckptool.ops.convert.verify.records_difference`).
    """
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except MemoryError:
        raise
    except Exception as e:
        lines = str(e).strip().splitlines() or [""]  # torch's text runs on for lines; its reason is one of them
        why = next((ln.strip() for ln in lines if "WeightsUnpickler error" in ln), lines[0].strip())
        return f"torch.load(weights_only=True) refused it ({type(e).__name__}: {why[:300]})"
    diff = _keys_difference(obj, [t.name for t in expected], entries or {})
    if diff is not None:
        return diff
    numbers = storage_numbers(expected)
    owner: dict[int, int] = {}
    for t, n in zip(expected, numbers):
        v = obj[t.name]
        want = (f"torch.{dtype_of(t.dtype)}", t.shape, t.stride, t.offset, t.requires_grad)
        got = (str(v.dtype), tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.requires_grad)
        if got != want:
            return f"{t.name!r} reads back as {got}, expected {want}"
        st = v.untyped_storage()
        if st.nbytes() and owner.setdefault(st.data_ptr(), n) != n:
            return f"{t.name!r} shares a storage it should not"
    by_storage: dict[int, int] = {}
    for t, n in zip(expected, numbers):
        st = obj[t.name].untyped_storage()
        if st.nbytes() and by_storage.setdefault(n, st.data_ptr()) != st.data_ptr():
            return f"{t.name!r} no longer shares its storage"
    return None


def _bytes_of(a: Any) -> memoryview:
    """The bytes of a NumPy array or a torch tensor in row-major order (no copy when contiguous)."""
    if hasattr(a, "untyped_storage"):
        return tensor_buffer(a)
    import numpy as np

    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


def array_crc(a: Any) -> int:
    """CRC-32 of the bytes of a NumPy array or a torch tensor (what ``safetensors.safe_open`` returns), in
    row-major order."""
    return zlib.crc32(_bytes_of(a))


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
