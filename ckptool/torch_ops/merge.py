"""The arithmetic of ``ckptool merge-lora``, with torch: ``W' = W + scaling * (B @ A)`` on one weight at a time.

What PEFT's ``LoraLayer.merge`` computes (``peft/tuners/lora/layer.py``: ``Linear.get_delta_weight`` and
``Embedding.get_delta_weight``, then ``base_layer.weight.data += delta_weight``), on bytes read from the files:

- the delta is ``B @ A`` (``A``: ``(r, in)``, ``B``: ``(out, r)``) in float32 at least (``torch.promote_types`` of
  the adapter's dtypes and float32: PEFT casts half adapter weights to float32 on the CPU, and PEFT's default
  ``autocast_adapter_dtype`` keeps them float32 anyway), transposed for ``fan_in_fan_out`` (GPT-2's ``Conv1D``) and
  for embeddings, times ``scaling`` (a Python float, as PEFT multiplies);
- it is added to ``W`` in the promoted dtype of ``W`` and the delta (float32 for half weights: ``W.float() + delta``,
  one rounding back to ``W``'s dtype, as torch's in-place ``W += delta`` of a half tensor and a float32 one does).

The delta is computed a block of ``W``'s rows at a time (:data:`BLOCK_ELEMENTS` elements): rows of ``B`` for a
plain weight, columns of ``A`` for a transposed one, so that memory stays at ``W``'s bytes plus a few float32
blocks. Each element of ``B @ A`` is one dot product of length ``r``; a block is the same products, so the result is
the same bits as the whole product (held by ``tests/test_merge_lora.py`` against PEFT with small blocks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptool.errors import UnsupportedError
from ckptool.torch_ops.cast import torch_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["BLOCK_ELEMENTS", "add_lora_delta"]

#: elements of ``W`` merged at a time (16 MiB of float32)
BLOCK_ELEMENTS = 1 << 22


def _tensor(data: bytearray | bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``data`` (little-endian elements, row-major) as a tensor of ``dtype`` and ``shape``, sharing its memory
    when ``data`` is a ``bytearray``."""
    import torch

    buf = data if isinstance(data, bytearray) else bytearray(data)
    if not buf:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    return torch.frombuffer(buf, dtype=torch_dtype(dtype)).view(shape)


def add_lora_delta(w: bytearray, w_dtype: str, w_shape: tuple[int, ...], a: bytes | bytearray, a_dtype: str,
                   a_shape: tuple[int, ...], b: bytes | bytearray, b_dtype: str, b_shape: tuple[int, ...],
                   scaling: float, transpose: bool) -> None:
    """Add ``scaling * (B @ A)`` (transposed when ``transpose``) to the weight ``W`` held in ``w``, in place.

    ``w``: the row-major little-endian bytes of ``W`` (``w_dtype``: float16, bfloat16, float32 or float64;
    ``w_shape``: ``(out, in)``, or ``(in, out)`` when ``transpose``); ``a`` / ``b``: those of ``A`` ``(r, in)`` and
    ``B`` ``(out, r)``. See the module docstring for the dtypes and the order of operations.

    Raises:
        UnsupportedError: a dtype that is not floating, or shapes that do not compose to ``W``'s.
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
    wt = _tensor(w, w_dtype, tuple(w_shape))
    at, bt = _tensor(a, a_dtype, a_shape), _tensor(b, b_dtype, b_shape)
    delta_dtype = torch.promote_types(torch.promote_types(at.dtype, bt.dtype), torch.float32)
    acc_dtype = torch.promote_types(wt.dtype, delta_dtype)
    at, bt = at.to(delta_dtype), bt.to(delta_dtype)
    rows = max(1, BLOCK_ELEMENTS // max(1, w_shape[1]))
    with torch.no_grad():
        for i in range(0, w_shape[0], rows):
            j = min(w_shape[0], i + rows)
            block = (bt @ at[:, i:j]).t() if transpose else bt[i:j] @ at
            block = block * scaling
            acc = wt[i:j].to(acc_dtype)
            acc += block
            wt[i:j].copy_(acc)  # one rounding back to W's dtype, as .to(dtype)
