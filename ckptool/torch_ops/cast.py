"""Storage bytes as torch tensors, for ``ckptool convert``: views over raw buffers, dtype casts, byte buffers.

Only a storage that needs torch (a ``--dtype`` cast, a non-contiguous view stored contiguous, a safetensors
sharing group assembled from its pieces) is materialised, one storage at a time; everything else is copied as bytes
without torch. Storages and tensors are the readers layer's (:class:`~ckptool.formats.tensors.Storage`,
:class:`~ckptool.formats.tensors.Tensor`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptool.errors import UnsupportedError
from ckptool.formats.dtypes import DTYPE_SIZES, numel
from ckptool.formats.tensors import Scaled, Storage, Tensor
from ckptool.model.casts import CastCount
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


#: elements cast and counted at a time (bounded temporaries: a few buffers of this many elements)
_COUNT_BLOCK = 1 << 20


def _count_block(a: torch.Tensor, b: torch.Tensor, count: CastCount) -> None:
    """Add to ``count`` what rounding ``a`` to ``b`` did (both of one dtype, float32 or wider: the difference of a
    value and its rounding, ``b`` within a factor of 2 of ``a`` or zero, is exact there (Sterbenz's lemma)). A block
    whose largest difference is finite has nothing non-finite on either side (an inf or NaN makes it inf or NaN):
    it needs no finiteness masks."""
    import torch

    if not a.numel():
        return
    err = (b - a).abs_()
    top = float(err.max())
    nz = a != 0
    if not math.isfinite(top):  # an inf or NaN on a side: count them, and the errors over the finite values
        fin_a, fin_b = torch.isfinite(a), torch.isfinite(b)
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        count.overflow += int((fin_a & ~fin_b & ~nan_b).sum())
        count.nan_made += int((fin_a & nan_b).sum())
        count.nan_in += int(nan_a.sum())
        count.nan_out += int(nan_b.sum())
        both = fin_a & fin_b
        err = torch.where(both, err, 0)
        top = float(err.max())
        nz &= fin_a
    count.underflow += int((nz & (b == 0)).sum())
    count.max_abs_error = max(count.max_abs_error, top)
    rel = err.div_(torch.where(nz, a.abs(), 1))  # zero where a is 0 (then b is 0 too) or not finite
    count.max_rel_error = max(count.max_rel_error, float(rel.max()))


def cast_counting(flat: torch.Tensor, dtype: str) -> tuple[torch.Tensor, CastCount]:
    """``flat`` (a 1-D floating tensor) cast to ``dtype`` (``Tensor.to``: IEEE round to nearest even, one rounding),
    and what the cast did to its values (:class:`~ckptool.model.casts.CastCount`), counted exactly, block by block of
    :data:`_COUNT_BLOCK` elements so the temporaries stay bounded.

    Overflow: finite in, ``+-inf`` out; underflow: finite non-zero in, zero out; errors over the values finite on
    both sides, computed in the wider of float32 and ``flat``'s dtype (exact: :func:`_count_block`).
    """
    import torch

    out = flat.to(torch_dtype(dtype))
    count = CastCount(str(flat.dtype).removeprefix("torch."), dtype, elements=flat.numel())
    wide = flat.dtype if flat.dtype in (torch.float32, torch.float64) else torch.float32
    for lo in range(0, flat.numel(), _COUNT_BLOCK):
        _count_block(flat[lo:lo + _COUNT_BLOCK].to(wide), out[lo:lo + _COUNT_BLOCK].to(wide), count)
    return out, count


#: rows of a quantized weight dequantized at a time (one row of scale blocks is this many rows or fewer)
_ROWS = 128


class _Rounder:
    """Rounds blocks of float32 values to ``dtype`` once (:func:`cast_counting`, counts summed in :attr:`count`), or
    keeps them for ``dtype`` float32 (no rounding, nothing counted)."""

    def __init__(self, dtype: str, src: str) -> None:
        self.dtype = torch_dtype(dtype)
        self.count: CastCount | None = None if dtype == "float32" else CastCount(src, dtype)

    def __call__(self, vals: torch.Tensor) -> torch.Tensor:
        if self.count is None:
            return vals
        out, c = cast_counting(vals.reshape(-1), str(self.dtype).removeprefix("torch."))
        label = self.count.src  # the stored dtype and scheme, not the float32 products counted
        self.count.add(c)
        self.count.src = label
        return out.reshape(vals.shape)


def dequantized(sc: Scaled, read: Callable[[str, int, int], bytearray],
                dtype: str = "float32") -> tuple[torch.Tensor, CastCount | None]:
    """The values of the quantized weight ``sc`` as a 1-D tensor of ``dtype``, and what rounding them to it did
    (:class:`~ckptool.model.casts.CastCount`; None for float32). Each element is upcast and multiplied by the scale of
    its block in ``sc.compute``'s precision: float32 as transformers' ``Fp8Dequantize._dequantize_one``
    (``q.to(float32) * s.to(float32)``), or the scale's own dtype as compressed-tensors' ``dequantize``
    (``q.to(scale.dtype) * scale``: a float8 element times a 16-bit scale is exact in float32, so the product rounded
    once to ``compute`` is theirs); then rounded once to ``dtype``. Computed a block of rows at a time (whole rows of
    scale blocks, at least :data:`_ROWS` rows): besides the stored bytes and the result, only a block's temporaries.

    Raises:
        UnsupportedError: the installed torch lacks the weight's, the scale's, ``compute``'s or ``dtype``'s dtype.
    """
    import torch

    rnd = _Rounder(dtype, f"{sc.weight.dtype} ({sc.scheme})")
    if sc.fp4_packed:
        return _mxfp4_values(sc, read, rnd), rnd.count
    w, f32 = sc.weight, torch.float32
    rows, cols = sc.shape[-2:]
    q = from_bytes(read(w.path, w.offset, numel(sc.shape) * DTYPE_SIZES[w.dtype]), w.dtype).reshape(-1, rows, cols)
    st = sc.scale.storage
    scale = from_bytes(read(st.path, st.offset, st.nbytes), st.dtype)
    scale = scale.as_strided(sc.scale.shape, sc.scale.stride, sc.scale.offset).to(f32)
    scale = scale.reshape(-1, *(scale.shape[-2:] if scale.dim() >= 2 else (1, 1)))
    compute = torch_dtype(sc.compute)
    out = torch.empty(q.shape, dtype=rnd.dtype)
    bm, bn = sc.block
    step = bm * max(1, _ROWS // bm, _COUNT_BLOCK // (bm * cols))  # whole rows of blocks, about a count block
    for e in range(q.shape[0]):
        grid = scale[e if scale.shape[0] > 1 else 0]
        for lo in range(0, rows, step):
            hi = min(lo + step, rows)
            s = grid[lo // bm:(hi + bm - 1) // bm].repeat_interleave(bm, 0)[:hi - lo].repeat_interleave(bn, 1)[:, :cols]
            prod = q[e, lo:hi].to(f32) * s
            out[e, lo:hi] = rnd(prod if compute == f32 else prod.to(compute).to(f32))
    return out.reshape(-1), rnd.count


#: the e2m1 value of each 4-bit code (transformers ``integrations/mxfp4.py`` ``FP4_VALUES``; OCP MX spec)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _mxfp4_values(sc: Scaled, read: Callable[[str, int, int], bytearray], rnd: _Rounder) -> torch.Tensor:
    """The values of an MXFP4 expert stack (:attr:`~ckptool.formats.tensors.Scaled.fp4_packed`) as a 1-D tensor of
    ``rnd``'s dtype in the layout ``(experts, groups * 32, rows)``, one expert at a time: each byte's low then high
    nibble looked up as e2m1, times ``2 ** (scale - 127)`` (``torch.ldexp``: exact in float32), rounded once, as
    transformers' ``convert_moe_packed_tensors`` computes it."""
    import torch

    experts, rows, groups, nbytes = sc.shape
    blocks = from_bytes(read(sc.weight.path, sc.weight.offset, numel(sc.shape)), "uint8").reshape(sc.shape)
    st = sc.scale.storage
    scales = from_bytes(read(st.path, st.offset, st.nbytes), st.dtype)
    scales = scales.as_strided(sc.scale.shape, sc.scale.stride, sc.scale.offset).to(torch.int32) - 127
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    out = torch.empty(experts, groups * nbytes * 2, rows, dtype=rnd.dtype)
    for e in range(experts):
        blk = blocks[e].reshape(rows * groups, nbytes)
        vals = torch.empty(rows * groups, nbytes * 2, dtype=torch.float32)
        vals[:, 0::2] = lut[(blk & 0x0F).long()]
        vals[:, 1::2] = lut[(blk >> 4).long()]
        torch.ldexp(vals, scales[e].reshape(rows * groups, 1), out=vals)
        out[e] = rnd(vals).reshape(rows, groups * nbytes * 2).t()
    return out.reshape(-1)


class FlatCache:
    """Materialises storages as 1-D tensors of their output dtype, keeping only the last one (memory stays bounded
    by the largest storage): a cache of torch buffers over :class:`~ckptool.formats.tensors.Storage`, not a
    model of its own.

    ``read(path, offset, nbytes)`` returns the bytes of a file range; ``out_dtype(dtype)`` names the dtype a
    storage of ``dtype`` is written as (a cast, or ``dtype`` itself); ``counted(storage, count)``, when given, receives
    what each cast did to the storage's values (:func:`cast_counting`).
    """

    def __init__(self, read: Callable[[str, int, int], bytearray], out_dtype: Callable[[str], str],
                 counted: Callable[[Storage, CastCount], None] | None = None) -> None:
        self.read, self.out_dtype, self.counted = read, out_dtype, counted
        self._key: int | None = None
        self._flat: torch.Tensor | None = None

    def flat(self, st: Storage) -> torch.Tensor:
        """The storage ``st`` as a 1-D tensor of its output dtype."""
        if self._key == id(st) and self._flat is not None:
            return self._flat
        self._flat = None  # release the previous storage before reading the next
        import torch

        out = self.out_dtype(st.dtype)
        if st.scaled is not None:  # a quantized weight's values, dequantized and rounded once to ``out``
            flat, count = dequantized(st.scaled, self.read, out)
            if count is not None and self.counted is not None:
                self.counted(st, count)
            self._key, self._flat = id(st), flat
            return flat
        if st.segments is not None:  # gathered from several files (a DeepSpeed ZeRO parameter)
            flat = from_bytes(read_segments(st.segments, self.read), st.dtype)
        elif st.pieces is None:
            flat = from_bytes(self.read(st.path, st.offset, st.nbytes), st.dtype)
        else:
            flat = torch.empty(st.numel, dtype=torch_dtype(st.dtype))
            for p in st.pieces:
                data = from_bytes(self.read(st.path, p.file_offset, p.nbytes), st.dtype)
                flat.as_strided(p.shape, p.stride, p.offset).copy_(data.reshape(p.shape))
        if out != st.dtype and self.counted is not None:
            flat, count = cast_counting(flat, out)
            self.counted(st, count)
        elif out != st.dtype:
            flat = flat.to(torch_dtype(out))
        self._key, self._flat = id(st), flat
        return flat

    def view(self, t: Tensor) -> torch.Tensor:
        """The tensor ``t`` (its view of the materialised storage, output dtype)."""
        return self.flat(t.storage).as_strided(t.shape, t.stride, t.offset)
