"""Strided views over raw storage bytes: the elements of a tensor view in row-major order, without torch.

A tensor is ``storage[offset + sum(i_k * stride_k)]`` for every index ``i`` of ``shape`` (torch's strided layout,
``Tensor.as_strided``); :func:`gather` yields those elements' bytes in the order ``Tensor.contiguous()`` lays them
out, reading from the bytes of the storage span the view reaches.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Literal

__all__ = ["gather"]

#: element size in bytes -> the ``memoryview.cast`` format of an unsigned integer that wide
_WORDS: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}


def gather(span: bytes | bytearray | memoryview, esize: int, offset: int, shape: Sequence[int],
           stride: Sequence[int], *, chunk: int | None = None) -> Iterator[bytes]:
    """The bytes of the view ``offset`` / ``shape`` / ``stride`` (in elements, ``offset`` from the start of ``span``)
    over ``span`` (a storage's bytes, elements of ``esize`` bytes), in row-major order, as pieces of at most
    ``chunk`` bytes (``chunk`` a multiple of ``esize``; None: one piece). Strides must be non-negative and the view
    inside ``span`` (the caller checks the span, as torch's ``setStorage`` does).

    Memory: the output pieces; rows are sliced from ``span`` with ``memoryview`` steps (no per-element Python work
    for element sizes 1, 2, 4 and 8).
    """
    n = 1
    for s in shape:
        n *= s
    if n == 0:
        return
    buf = memoryview(span).cast("B")
    if not shape:
        yield bytes(buf[offset * esize:(offset + 1) * esize])
        return
    fmt = _WORDS.get(esize)
    elems = buf.cast(fmt) if fmt else None
    limit = chunk if chunk is not None else n * esize
    out = bytearray()
    inner, step = shape[-1], stride[-1]
    for idx in itertools.product(*(range(s) for s in shape[:-1])):
        start = offset + sum(i * s for i, s in zip(idx, stride[:-1], strict=True))
        if elems is not None and step > 0:
            out += elems[start:start + (inner - 1) * step + 1:step].tobytes()
        else:
            for j in range(inner):
                p = (start + j * step) * esize
                out += buf[p:p + esize]
        while len(out) >= limit:
            yield bytes(out[:limit])
            del out[:limit]
    if out:
        yield bytes(out)
