"""The arithmetic of ``ckptool average``, with numpy: a weighted mean of tensor elements in float64, cast back.

Elements arrive as little-endian bytes (the files' own encoding) one chunk at a time; :class:`Accumulator` adds each
input's chunk times its weight into a float64 buffer (complex128 for complex dtypes) and :meth:`Accumulator.result`
divides by the sum of the weights and encodes the mean in the tensor's dtype. The cast back is the one torch's
``Tensor.to(dtype)`` makes from float64: float32 and float64 directly (round to nearest even); float16 and bfloat16
through float32 first, as torch's ``c10::Half`` / ``c10::BFloat16`` are built from a float (bfloat16 rounds to
nearest even, NaN becomes ``0x7FC0``: ``c10::detail::round_to_nearest_even``). numpy is imported when an
accumulator is made; torch is not (so averaging files stays small in memory: importing torch alone takes about
200 MiB). :func:`average_state_dicts` is the same mean on loaded tensors, with torch.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckptool.errors import UnsupportedError, UsageError
from ckptool.model.paths import get_path
from ckptool.torch_ops.value_stats import decode_elements

if TYPE_CHECKING:
    import numpy as np

#: dtypes whose elements are averaged (the others are taken from the first input, or refused)
AVERAGED = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")
#: dtypes whose elements are taken from the first input: counts and flags (``num_batches_tracked``, masks)
TAKEN_FROM_FIRST = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
_DIRECT = {"float32": "<f4", "float64": "<f8", "complex64": "<c8", "complex128": "<c16"}


class Accumulator:
    """A running weighted sum of ``n`` elements of ``dtype`` (one of :data:`AVERAGED`) in float64 / complex128."""

    def __init__(self, dtype: str, n: int) -> None:
        import numpy as np

        self.dtype = dtype
        self.acc = np.zeros(n, dtype="<c16" if dtype.startswith("complex") else "<f8")
        self._tmp = np.empty_like(self.acc)

    def add(self, data: bytes | bytearray, weight: float) -> None:
        """Add ``weight`` times the elements encoded in ``data`` (exactly ``n`` of them)."""
        import numpy as np

        x = decode_elements(data, self.dtype)
        if weight == 1.0:
            np.add(self.acc, x, out=self.acc)
        else:
            np.multiply(x, weight, out=self._tmp, dtype=self.acc.dtype)  # in float64, not in x's dtype
            np.add(self.acc, self._tmp, out=self.acc)

    def result(self, total_weight: float) -> bytes:
        """The sum divided by ``total_weight``, encoded in the accumulator's dtype (see the module docstring)."""
        import numpy as np

        mean = np.divide(self.acc, total_weight, out=self.acc)
        code = _DIRECT.get(self.dtype)
        if code is not None:
            return mean.astype(code).tobytes()
        f32 = mean.astype("<f4")
        if self.dtype == "float16":
            return f32.astype("<f2").tobytes()
        return _bfloat16(f32).tobytes()


def _bfloat16(f32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even, NaN as ``0x7FC0`` (torch's ``round_to_nearest_even``)."""
    import numpy as np

    u = f32.view("<u4")
    bits: np.ndarray = ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype("<u2")
    bits[np.isnan(f32)] = 0x7FC0
    return bits


def _select(obj: Mapping[Any, Any], key: str | None) -> Mapping[Any, Any]:
    """The state_dict at dotted ``key`` of a loaded checkpoint (``obj`` itself without ``key``).

    Raises:
        UsageError: nothing there, or no mapping.
    """
    if key is None:
        return obj
    try:
        sd = get_path(obj, key)
    except KeyError:
        raise UsageError(f"no entry {key!r} (key=) in an input mapping") from None
    if not isinstance(sd, Mapping):
        raise UsageError(f"key={key!r} selects a {type(sd).__name__}, not a state_dict")
    return sd


def _check_same(sds: list[Mapping[Any, Any]]) -> None:
    """Raises UnsupportedError naming the first key missing, extra, or of another shape or dtype in an input."""
    first = sds[0]
    fix = "average needs the same keys, shapes and dtypes in every input"
    for i, sd in enumerate(sds[1:], 2):
        for k, v in first.items():
            if k not in sd:
                raise UnsupportedError(f"input {i} has no key {k!r}, which input 1 has; {fix}")
            o = sd[k]
            a = (tuple(getattr(v, "shape", ())), getattr(v, "dtype", None))
            b = (tuple(getattr(o, "shape", ())), getattr(o, "dtype", None))
            if a != b:
                raise UnsupportedError(f"{k!r} is {a[1]} {list(a[0])} in input 1 but {b[1]} {list(b[0])} in input {i}; "
                                       f"{fix}")
        extra = [k for k in sd if k not in first]
        if extra:
            raise UnsupportedError(f"input {i} has key {extra[0]!r}, which input 1 has not; {fix}")


def average_state_dicts(state_dicts: list[Mapping[Any, Any]], weights: list[float], *,
                        key: str | None = None) -> OrderedDict[Any, Any]:
    """The weighted mean of loaded state_dicts (the state_dict at dotted ``key`` of each, when given), with torch.

    Floating and complex tensors: ``sum(w_i * t_i.double()) / sum(w)`` computed on the CPU, cast back with
    ``.to(dtype)`` and moved to the first input's device; integer and bool tensors and non-tensor values are the
    first input's (the same objects). Tensors that are one view of one storage in every input (tied weights) give
    one result object. The result is an ``OrderedDict`` carrying the first input's ``_metadata``; nothing is mutated.

    Raises:
        UsageError: ``key`` selects nothing or no mapping.
        UnsupportedError: keys, shapes or dtypes that differ between inputs (the key is named).
    """
    import torch

    sds = [_select(x, key) for x in state_dicts]
    _check_same(sds)
    total = math.fsum(weights)
    out: OrderedDict[Any, Any] = OrderedDict()
    made: dict[tuple[Any, ...], Any] = {}
    for k, v0 in sds[0].items():
        if not isinstance(v0, torch.Tensor) or not (v0.is_floating_point() or v0.is_complex()):
            out[k] = v0
            continue
        views = tuple((sd[k].untyped_storage().data_ptr(), sd[k].storage_offset(), tuple(sd[k].shape),
                       tuple(sd[k].stride()), sd[k].dtype) for sd in sds)
        if views in made:
            out[k] = made[views]
            continue
        wide = torch.complex128 if v0.is_complex() else torch.float64
        with torch.no_grad():
            acc = torch.zeros(v0.shape, dtype=wide)
            for sd, w in zip(sds, weights):
                acc += sd[k].detach().to("cpu", wide) * w  # two roundings, no fused multiply-add
            out[k] = made[views] = acc.div_(total).to(v0.dtype).to(v0.device)
    meta = getattr(sds[0], "_metadata", None)
    if meta is not None:
        out._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]  # what torch's state_dict() sets
    return out
