"""The arithmetic of ``ckptool merge-lora``, with torch: ``W' = W + scaling * (B @ A)`` on one weight at a time.

What PEFT's ``LoraLayer.merge`` computes (``peft/tuners/lora/layer.py``: ``Linear.get_delta_weight`` and
``Embedding.get_delta_weight``, then ``base_layer.weight.data += delta_weight``), on bytes read from the files,
operation for operation so that the result has PEFT's bits:

- the delta is ``B @ A`` (``A``: ``(r, in)``, ``B``: ``(out, r)``), transposed for ``fan_in_fan_out`` (GPT-2's
  ``Conv1D``) and for embeddings, times ``scaling`` (a Python float, as PEFT multiplies), computed in float32 when
  ``B`` is float16 / bfloat16 (PEFT's ``cast_to_fp32`` on the CPU) and then rounded to ``B``'s dtype, else in
  the factors' dtype (float32: PEFT's default ``autocast_adapter_dtype`` keeps adapters float32 whatever the base);
- it is added to ``W`` in the promoted dtype of the two (``W.float() + delta`` for a half ``W`` and a float32 delta)
  and rounded once to ``W``'s dtype, as torch's in-place ``W += delta`` does.

A float32 adapter on a half base is thus merged with one rounding; a half adapter (saved with
``autocast_adapter_dtype=False``) with two, the delta's and the sum's, as PEFT merges it.

The delta is computed a block of ``W``'s rows at a time (:data:`BLOCK_ELEMENTS` elements, at least
:data:`MIN_BLOCK_ROWS` rows): rows of ``B`` for a plain weight, columns of ``A`` for a transposed one, so that memory
stays at a few float32 blocks (the caller may pass ``W`` a block at a time, :func:`lora_blocks`). Each element of
``B @ A`` is one dot product of length ``r``,
which torch's CPU matrix product (MKL) sums in the same order for a block of 16 rows or more as for the whole
product, so the result has the whole product's bits (held by ``tests/test_merge_lora.py`` against PEFT and
against the whole product, with small blocks); a block of very few rows goes through another kernel and may not.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import TYPE_CHECKING, Any

from ckptool.errors import UnsupportedError
from ckptool.torch_ops.cast import torch_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["BLOCK_ELEMENTS", "MIN_BLOCK_ROWS", "add_lora_delta", "lora_blocks", "release_freed_memory", "tensor_of"]

#: elements of ``W`` merged at a time (4 MiB of float32)
BLOCK_ELEMENTS = 1 << 20
#: the fewest rows of ``W`` in a block: MKL computes a product of a few rows (1 to 7 seen) by another kernel
#: (matrix-vector), whose sums round differently from the whole product's
MIN_BLOCK_ROWS = 64


def _blocks(n: int, rows: int) -> list[tuple[int, int]]:
    """``[start, stop)`` blocks of ``rows`` rows over ``n``, the remainder folded into the last block (so that no
    block is shorter than ``rows`` unless ``n`` is)."""
    out = []
    i = 0
    while i < n:
        j = n if n - (i + rows) < rows else i + rows
        out.append((i, j))
        i = j
    return out


def lora_blocks(w_shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` row blocks :func:`add_lora_delta` merges a weight of ``w_shape`` in: about
    :data:`BLOCK_ELEMENTS` elements and at least :data:`MIN_BLOCK_ROWS` rows each, the remainder in the last."""
    return _blocks(w_shape[0], max(MIN_BLOCK_ROWS, BLOCK_ELEMENTS // max(1, math.prod(w_shape[1:]))))


def release_freed_memory(nbytes: int = 1 << 20) -> None:
    """Hand the C heap's free memory back to the system (glibc ``malloc_trim(0)``; nothing elsewhere) after a tensor
    of ``nbytes`` bytes was computed, when it is 1 MiB or more (a trim takes about 0.1 ms).

    Called after each tensor a merge computes: glibc raises its mmap threshold to the size of the last large block
    freed (up to 32 MiB), so the next tensors' buffers and torch's intermediates of that size come from the heap,
    and what they free stays in the process (60 MiB of the 1 GiB merge-lora benchmark's peak RSS, measured in
    issue 39). Trimming after each tensor keeps the peak at one tensor's working set, without changing malloc's
    settings for the rest of the process.
    """
    trim = _malloc_trim()
    if trim is not None and nbytes >= 1 << 20:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` (looked up in the process's own symbols), or None where the C library has none
    (musl, macOS) or the process has no such table (Windows)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):
        return None


def tensor_of(data: bytearray | bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``data`` (little-endian elements, row-major) as a tensor of ``dtype`` and ``shape``, sharing its memory
    when ``data`` is a ``bytearray``."""
    import torch

    buf = data if isinstance(data, bytearray) else bytearray(data)
    if not buf:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    return torch.frombuffer(buf, dtype=torch_dtype(dtype)).view(shape)


def add_lora_delta(w: bytearray, w_dtype: str, w_shape: tuple[int, ...], a: bytes | bytearray, a_dtype: str,
                   a_shape: tuple[int, ...], b: bytes | bytearray, b_dtype: str, b_shape: tuple[int, ...],
                   scaling: float, transpose: bool, rows: tuple[int, int] | None = None) -> None:
    """Add ``scaling * (B @ A)`` (transposed when ``transpose``) to the weight ``W`` held in ``w``, in place.

    ``w``: the row-major little-endian bytes of ``W`` (``w_dtype``: float16, bfloat16, float32 or float64;
    ``w_shape``: ``(out, in)``, or ``(in, out)`` when ``transpose``), or with ``rows`` ``(start, stop)`` those of
    these rows of ``W`` only (one of :func:`lora_blocks`: the caller streams ``W`` a block at a time); ``a`` /
    ``b``: those of ``A`` ``(r, in)`` and ``B`` ``(out, r)``. See the module docstring for the dtypes and the order
    of operations.

    Raises:
        UnsupportedError: a dtype that is not floating, or shapes that do not compose to ``W``'s; a merged value
            that is inf or NaN where ``W``'s was finite (an overflow of ``W``'s dtype: refused, not written).
    """
    import torch

    for dt in (w_dtype, a_dtype, b_dtype):
        if not torch_dtype(dt).is_floating_point:
            raise UnsupportedError(f"merge-lora computes in floating point; found a {dt} tensor")
    r, n_in = a_shape
    n_out, r2 = b_shape
    want = (n_in, n_out) if transpose else (n_out, n_in)
    if r != r2 or tuple(w_shape) != want:
        raise UnsupportedError(f"lora_A {list(a_shape)} and lora_B {list(b_shape)} give a delta of shape {list(want)}"
                               f", but the weight is {list(w_shape)}")
    i0, j0 = rows if rows is not None else (0, w_shape[0])
    wt = tensor_of(w, w_dtype, (j0 - i0, *w_shape[1:]))
    at, bt = tensor_of(a, a_dtype, a_shape), tensor_of(b, b_dtype, b_shape)
    half = bt.dtype in (torch.float16, torch.bfloat16)  # PEFT: lora_B's dtype, cast_to_fp32 on the CPU
    compute = torch.float32 if half else torch.promote_types(at.dtype, bt.dtype)
    delta_dtype = bt.dtype if half else compute
    acc_dtype = torch.promote_types(wt.dtype, delta_dtype)
    at, bt = at.to(compute), bt.to(compute)
    with torch.no_grad():
        for i, j in [(i0, j0)] if rows is not None else lora_blocks(w_shape):
            block = (bt @ at[:, i:j]).t() if transpose else bt[i:j] @ at
            block = block.mul_(scaling).to(delta_dtype)  # block * scaling, in place
            acc = wt[i - i0:j - i0].to(acc_dtype)
            acc += block
            new = acc.to(wt.dtype)  # one rounding back to W's dtype, as .to(dtype)
            bad = ~torch.isfinite(new) & torch.isfinite(wt[i - i0:j - i0])
            if bool(bad.any()):
                raise UnsupportedError(f"merging makes {int(bad.sum())} finite values of this weight inf or NaN in "
                                       f"{w_dtype} (scaling {scaling:g}: the merged value does not fit the dtype); "
                                       "nothing was written: check lora_alpha and r in adapter_config.json, or "
                                       "merge into a wider dtype")
            wt[i - i0:j - i0].copy_(new)
