"""numpy arrays, scalars and dtypes as a pickle holds them, read from the node graph without numpy.

How numpy (1.x: ``numpy.core``; 2.x: ``numpy._core``) pickles them, protocols 2 to 5 (numpy/_core/src/multiarray
``array_reduce_ex``, ``array_setstate``, ``arraydescr_reduce``; numpy/_core/numeric.py ``_frombuffer``):

* an array, protocol < 5 or not contiguous: ``multiarray._reconstruct(numpy.ndarray, (0,), b'b')`` then BUILD
  ``(1, shape, dtype, is_fortran, rawdata)`` (older pickles: the 4-tuple without the version). ``rawdata`` is the
  C-order bytes, or the Fortran-order bytes when ``is_fortran``; at protocol 2 bytes are written as
  ``_codecs.encode(str, 'latin1')``.
* an array, protocol 5 and C- or Fortran-contiguous: ``numeric._frombuffer(buffer, dtype, shape, order)`` with the
  buffer in-band (``bytearray`` or ``bytes``).
* a scalar (``numpy.float64(0.5)``): ``multiarray.scalar(dtype, rawbytes)``.
* a dtype: ``numpy.dtype(code, False, True)`` then BUILD ``(3, byteorder, subarray, names, fields, elsize,
  alignment, flags)`` (version 4 appends metadata); ``code`` is ``'f2'``, ``'i8'``, ``'b1'``, ``'c8'``...
  ``byteorder`` is ``'<'``, ``'>'``, ``'|'`` (no order) or ``'='`` (native).
* a scalar type used as a value (``numpy.float32``): the GLOBAL ``numpy.float32`` itself.

Only numeric dtypes with a torch equivalent are read (bool, int8-64, uint8-64, float16-64, complex64/128);
structured, object, string, datetime and longdouble arrays are refused with the reason. Big-endian data is
byte-swapped to the little-endian order torch stores.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Any

from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats.dtypes import contiguous_stride, element_size, numel
from ckptool.formats.nodes import GlobalMeta, PickledObject, ReduceNode

__all__ = ["NUMPY_CODES", "NUMPY_TYPES", "NumpyArray", "numpy_kind", "numpy_type_dtype", "read_array",
           "read_dtype"]

_CORE = ("numpy.core", "numpy._core")
_RECONSTRUCT = frozenset(f"{m}.multiarray._reconstruct" for m in _CORE)
_FROMBUFFER = frozenset(f"{m}.numeric._frombuffer" for m in _CORE)
_SCALAR = frozenset(f"{m}.multiarray.scalar" for m in _CORE)
_DTYPE = "numpy.dtype"
_NDARRAY = "numpy.ndarray"

#: numpy dtype code (``numpy.dtype.str`` without the byte order) -> torch dtype name
NUMPY_CODES: dict[str, str] = {
    "b1": "bool", "i1": "int8", "i2": "int16", "i4": "int32", "i8": "int64", "u1": "uint8", "u2": "uint16",
    "u4": "uint32", "u8": "uint64", "f2": "float16", "f4": "float32", "f8": "float64", "c8": "complex64",
    "c16": "complex128",
}

#: numpy scalar type global (``numpy.float32``) -> torch dtype name
NUMPY_TYPES: dict[str, str] = {
    **{f"numpy.{name}": name for name in set(NUMPY_CODES.values())},
    "numpy.bool_": "bool", "numpy.half": "float16", "numpy.single": "float32", "numpy.double": "float64",
    "numpy.csingle": "complex64", "numpy.cdouble": "complex128",
}


@dataclass(frozen=True)
class NumpyArray:
    """A numpy array or scalar read from a pickle: torch ``dtype`` name, ``shape``, ``stride`` (elements; Fortran
    order kept as strides) and ``data``, the ``numel * element size`` bytes in little-endian order."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    data: bytes


def numpy_kind(obj: object) -> str | None:
    """``"array"``, ``"scalar"`` or ``"dtype"`` for a node numpy pickled that way (by its global), else None."""
    name = obj.global_name if isinstance(obj, ReduceNode) else None
    if name in _RECONSTRUCT or name in _FROMBUFFER:
        return "array"
    if name in _SCALAR:
        return "scalar"
    if name == _DTYPE:
        return "dtype"
    return None


def numpy_type_dtype(g: GlobalMeta) -> str | None:
    """The torch dtype name of a numpy scalar type global (``numpy.float32`` -> ``"float32"``), else None."""
    return NUMPY_TYPES.get(g.qualified_name)


def _raw_bytes(v: object, what: str) -> bytes:
    """The bytes of ``v``: bytes, bytearray, a latin-1 str (protocol 2 text) or ``_codecs.encode(str, 'latin1')``
    / ``bytearray(...)`` / ``bytes()`` as protocol 2 writes them."""
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    if isinstance(v, str):
        return v.encode("latin1")
    if isinstance(v, ReduceNode) and v.global_name in ("builtins.bytes", "builtins.bytearray") and not v.args:
        return b""  # protocol 2 writes empty bytes as ``bytes()``
    if isinstance(v, ReduceNode) and v.global_name in ("_codecs.encode", "builtins.bytearray") and v.args:
        text = v.args[0]
        if isinstance(text, str) and (len(v.args) == 1 or v.args[1] == "latin1"):
            return text.encode("latin1")
        if isinstance(text, (bytes, bytearray)):
            return bytes(text)
    raise UnsupportedError(f"the data of {what} is {v!r}, not bytes (an object array?)")


def read_dtype(node: object) -> tuple[str, bool]:
    """``(torch dtype name, big-endian)`` of a pickled ``numpy.dtype(...)`` node.

    Raises:
        UnsupportedError: not a dtype node, or a dtype without a torch equivalent (structured, object, string,
            datetime, longdouble, subarray).
    """
    if not isinstance(node, ReduceNode) or node.global_name != _DTYPE or not node.args:
        raise UnsupportedError(f"{node!r} is not a numpy dtype")
    code = node.args[0]
    state = node.state if isinstance(node.state, tuple) else ()
    order = state[1] if len(state) > 1 else "<"
    structured = len(state) > 4 and (state[2] is not None or state[3] is not None)
    dtype = NUMPY_CODES.get(code) if isinstance(code, str) else None
    if dtype is None or structured:
        raise UnsupportedError(f"numpy dtype {code!r}{' (structured)' if structured else ''} has no torch "
                               "equivalent (only bool, int, uint, float16-64 and complex64/128 do)")
    return dtype, order == ">"


def _little_endian(data: bytes, dtype: str) -> bytes:
    """``data`` with each element's bytes reversed (complex: each half's), for big-endian arrays."""
    size = element_size(dtype) // (2 if dtype.startswith("complex") else 1)
    if size == 1:
        return data
    a = array.array({2: "H", 4: "I", 8: "Q"}[size])
    a.frombytes(data)
    a.byteswap()
    return a.tobytes()


def _fortran_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(contiguous_stride(tuple(reversed(shape)))))


def _int_shape(v: object, what: str) -> tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = (v,)
    if not isinstance(v, (tuple, list)) or not all(isinstance(s, int) and s >= 0 for s in v):
        raise CorruptCheckpointError(f"the shape of {what} is {v!r}, not a tuple of sizes; the file is damaged")
    return tuple(v)


def _array(dtype_node: object, shape: tuple[int, ...], fortran: bool, raw: object, what: str) -> NumpyArray:
    dtype, big = read_dtype(dtype_node)
    data = _raw_bytes(raw, what)
    want = numel(shape) * element_size(dtype)
    if len(data) != want:
        raise CorruptCheckpointError(
            f"{what} declares {want} bytes ({dtype} {list(shape)}) but holds {len(data)}; the file is damaged")
    if big:
        data = _little_endian(data, dtype)
    return NumpyArray(dtype, shape, _fortran_stride(shape) if fortran else contiguous_stride(shape), data)


def read_array(node: PickledObject, what: str = "the numpy array") -> NumpyArray:
    """The array or scalar of a node for which :func:`numpy_kind` says ``"array"`` or ``"scalar"``.

    Raises:
        UnsupportedError: an ndarray subclass (``numpy.matrix``...), a dtype without a torch equivalent, object
            data.
        CorruptCheckpointError: a shape that is not sizes, data shorter or longer than the shape needs.
    """
    kind = numpy_kind(node)
    if not isinstance(node, ReduceNode) or kind not in ("array", "scalar"):
        raise UnsupportedError(f"{what} is not a numpy array or scalar")
    args = node.args
    if kind == "scalar":
        if len(args) != 2:
            raise UnsupportedError(f"{what}: a numpy scalar without raw data (an object scalar?)")
        return _array(args[0], (), False, args[1], what)
    if node.global_name in _FROMBUFFER:
        if len(args) != 4:
            raise CorruptCheckpointError(f"{what}: _frombuffer takes (buffer, dtype, shape, order); damaged file")
        return _array(args[1], _int_shape(args[2], what), args[3] == "F", args[0], what)
    cls = args[0] if args else None
    if not isinstance(cls, GlobalMeta) or cls.qualified_name != _NDARRAY:
        raise UnsupportedError(f"{what} is a {cls!r}, an ndarray subclass without a torch equivalent")
    state: Any = node.state
    if isinstance(state, tuple) and len(state) == 5:
        state = state[1:]
    if not isinstance(state, tuple) or len(state) != 4:
        raise CorruptCheckpointError(f"{what}: the array state is not (shape, dtype, is_fortran, data); damaged file")
    shape, dtype_node, fortran, raw = state
    return _array(dtype_node, _int_shape(shape, what), bool(fortran), raw, what)
