"""Verifying ``convert``'s output: re-opened by the format's own reader and compared with what was read.

safetensors: ``safetensors.safe_open`` (its NumPy framework when NumPy holds every dtype, so torch is not needed)
checks names, dtypes, shapes, CRC-32 and ``__metadata__``, then ckptool reads the file back and compares every
tensor (aliases included) and the storage sharing. torch: ``torch.load(mmap=True, weights_only=True)`` plus the
zip records' CRC-32 (:func:`ckptool.torch_ops.convert_verify.torch_file_difference`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptool.errors import CkptError
from ckptool.formats.dtypes import contiguous_stride
from ckptool.ops.convert.read_safetensors import safetensors_source
from ckptool.ops.convert.source import Tensor, out_dtype
from ckptool.ops.convert.write import Written
from ckptool.torch_ops.convert_verify import ExpectedTensor, array_crc, torch_file_difference


class VerificationError(CkptError):
    """The written output does not read back as the source: a name, shape, dtype, sharing or checksum differs.
    Nothing is left at the destination (or the output written there is removed)."""


def verify_fail(path: str, what: str) -> VerificationError:
    """The :class:`VerificationError` for output ``path`` differing in ``what``."""
    return VerificationError(f"verification of {path} failed: {what}; the output was not kept. Check the disk and "
                             "retry; if it fails again, report it with the source file's `ckptool inspect --json`")


#: dtypes NumPy holds: files of only these are verified through safetensors' NumPy framework, without torch
_NUMPY_DTYPES = frozenset({"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "uint16",
                           "uint32", "uint64", "bool", "complex64"})


def _safe_open(path: str, framework: str) -> Any:
    from safetensors import safe_open

    try:  # pread: each tensor read into its own buffer, so memory stays bounded by one tensor
        return safe_open(path, framework=framework, backend="pread")
    except TypeError:  # safetensors < 0.7 has no backend choice
        return safe_open(path, framework=framework)


def _safe_open_difference(w: Written, path: str) -> str | None:
    numpy = all(e[1] in _NUMPY_DTYPES for e in w.expect)
    with _safe_open(path, "numpy" if numpy else "pt") as f:
        names = set(f.keys())
        want = {e[0] for e in w.expect}
        if names != want:
            return f"tensor names differ ({', '.join(sorted(names ^ want)[:3])})"
        if (f.metadata() or None) != (w.metadata or None):
            return "__metadata__ differs"
        for name, dtype, shape, crc in w.expect:
            t = f.get_tensor(name)
            if str(t.dtype).removeprefix("torch.") != dtype or tuple(t.shape) != tuple(shape):
                return f"{name!r} reads back as {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}"
            if crc is not None and array_crc(t) != crc:
                return f"{name!r} reads back with different bytes (CRC-32)"
            del t
    return None


def verify_safetensors(w: Written, path: str) -> None:
    """Re-open ``path`` with ``safetensors.safe_open`` and compare every stored tensor's name, dtype, shape and
    CRC-32 with ``w.expect``, and the ``__metadata__``; then read it back with ckptool and compare every tensor
    (aliases included) and the storage sharing with ``w``.

    Raises:
        VerificationError: any difference.
    """
    try:
        diff = _safe_open_difference(w, path)
    except (MemoryError, ImportError):
        raise
    except Exception as e:  # the safetensors library refused the file
        raise verify_fail(path, f"safetensors.safe_open refused it ({type(e).__name__}: {e})") from e
    if diff is not None:
        raise verify_fail(path, diff)
    back = safetensors_source(path)
    unit_of = {id(t): u for u in w.units for t in u.members}

    def expected(t: Tensor) -> tuple[str, str, tuple[int, ...], tuple[int, ...], int]:
        u = unit_of[id(t)]
        if len(u.members) > 1:
            return (t.name, u.dtype, t.shape, t.stride, (t.offset - u.lo) if t.numel else 0)
        return (t.name, u.dtype, t.shape, contiguous_stride(t.shape), 0)

    got = [(t.name, t.dtype, t.shape, t.stride, t.offset) for t in back.tensors]
    exp = [expected(t) for t in w.tensors]
    if got != exp:
        g, x = next(((g, x) for g, x in zip(got, exp) if g != x), (got[len(exp):], exp[len(got):]))
        raise verify_fail(path, f"reading it back with ckptool gives {g}, expected {x}")
    by_name = {t.name: t for t in back.tensors}
    for u in w.units:
        if len({id(by_name[t.name].storage) for t in u.members}) != 1:
            raise verify_fail(path, f"{u.members[0].name!r} and the tensors sharing its storage no longer share one")


def torch_verifier(cast: str | None) -> Callable[[Written, str], None]:
    """A check for :func:`ckptool.ops.convert.write.emit` of a torch output written with ``cast``: it opens the file
    with ``torch.load(mmap=True, weights_only=True)`` and compares every tensor's name, dtype, shape, stride,
    storage offset, requires_grad and storage sharing, and every storage record's CRC-32, with what was written.

    The check raises :class:`VerificationError` on any difference.
    """
    def check(w: Written, path: str) -> None:
        storage_ids: dict[int, int] = {}
        expected = [ExpectedTensor(t.name, out_dtype(t.dtype, cast), t.shape, t.stride, t.offset, t.requires_grad,
                                   storage_ids.setdefault(id(t.storage), len(storage_ids))) for t in w.tensors]
        diff = torch_file_difference(path, expected, w.records)
        if diff is not None:
            raise verify_fail(path, diff)

    return check
