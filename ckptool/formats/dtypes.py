"""The one dtype table: element sizes, torch storage classes and safetensors dtype codes.

Every module that needs the size of an element, the dtype of a storage class or a safetensors code looks it up
here; nothing else keeps a copy. Sources: ``torch.<dtype>.itemsize`` and ``torch/storage.py`` (storage classes) in
torch 2.13, and the safetensors format description (``Dtype`` in safetensors' ``tensor.rs``;
``safetensors.torch._TYPES`` holds the codes its Python loader maps to torch, which a test checks against
:data:`ST_CODES`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckptool.errors import UnsupportedError

if TYPE_CHECKING:
    from ckptool.formats.nodes import StorageRef, TensorNode

#: ``--max-expand``'s default: the dense bytes of the tensors a command materialises may be this many times the
#: bytes of their storages (tied views of one storage count each in full); :mod:`ckptool.readers.budget`. Here, with
#: the element sizes that count both, rather than in :mod:`ckptool.formats.tensors` (which re-exports them): a scan
#: and the CLI's options need the two numbers, not the tensor model's classes (start-up)
MAX_EXPAND = 64.0
#: dense bytes always allowed, whatever the storages hold (a small broadcast buffer in a tiny file)
EXPAND_FLOOR = 16 << 20

#: dtype name -> element size in bytes, for every dtype ``_rebuild_tensor_v3`` may name (``torch.<dtype>.itemsize``)
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1, "complex32": 4, "complex64": 8,
    "complex128": 16, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1,
    "quint2x4": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    **{f"int{i}": 1 for i in range(1, 8)}, **{f"uint{i}": 1 for i in range(1, 8)},
}

#: storage class name -> (dtype name, element size in bytes), as torch/storage.py defines them
STORAGE_TYPES: dict[str, tuple[str, int]] = {
    "DoubleStorage": ("float64", 8), "FloatStorage": ("float32", 4), "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2), "LongStorage": ("int64", 8), "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2), "CharStorage": ("int8", 1), "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1), "ComplexFloatStorage": ("complex64", 8), "ComplexDoubleStorage": ("complex128", 16),
    "QInt8Storage": ("qint8", 1), "QUInt8Storage": ("quint8", 1), "QInt32Storage": ("qint32", 4),
    "QUInt4x2Storage": ("quint4x2", 1), "QUInt2x4Storage": ("quint2x4", 1), "UntypedStorage": ("uint8", 1),
}

#: torch dtype name -> safetensors dtype code, for the dtypes ckptool writes to and reads from safetensors
#: (the codes ``safetensors.torch`` loads, plus ``F8_E8M0`` which safetensors' Rust reader maps to
#: ``float8_e8m0fnu``)
ST_CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0", "complex64": "C64",
}

#: dtype name -> ``struct`` format character of one element (read little-endian, ``"<" + fmt``), for the dtypes
#: whose values Python's ``struct`` module decodes (numpy scalars and small arrays shown by inspect and diff)
STRUCT_FORMATS: dict[str, str] = {
    "float64": "d", "float32": "f", "float16": "e", "int64": "q", "int32": "i", "int16": "h", "int8": "b",
    "uint64": "Q", "uint32": "I", "uint16": "H", "uint8": "B", "bool": "?",
}

#: safetensors codes ckptool can describe but not convert: the format defines them, the safetensors Python loader
#: of this era does not map them to torch (``F4`` is two float4 values packed in one byte)
ST_READ_ONLY: dict[str, str] = {"F4": "float4_e2m1fn_x2"}

#: safetensors dtype code -> torch dtype name (inverse of :data:`ST_CODES`, plus :data:`ST_READ_ONLY`)
ST_NAMES: dict[str, str] = {**{v: k for k, v in ST_CODES.items()}, **ST_READ_ONLY}

#: every dtype code the safetensors format defines -> bits per element (``Dtype::bitsize`` in safetensors'
#: ``tensor.rs``, 0.8): the codes its reader accepts, sub-byte ones included (``F4``, ``F6_*``)
ST_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}


def element_size(dtype: str) -> int:
    """Size in bytes of one element of ``dtype`` (a torch dtype name such as ``"bfloat16"``).

    Raises:
        UnsupportedError: ``dtype`` is not a dtype of torch 2.13.
    """
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise UnsupportedError(f"dtype {dtype!r} is not a torch dtype ckptool knows (torch 2.13)") from None


def storage_element(ref: StorageRef) -> tuple[str, int]:
    """``(dtype name, element size)`` of a storage from its storage class (``torch.cuda.HalfStorage`` too).

    Raises:
        UnsupportedError: an unknown storage class.
    """
    name = ref.storage_type_name
    try:
        return STORAGE_TYPES[name]
    except KeyError:
        raise UnsupportedError(f"storage {ref.key!r} has unknown storage type {name!r}") from None


def storage_nbytes(ref: StorageRef) -> int:
    """Size in bytes of the storage's data: ``numel * element size`` (``numel`` is bytes for UntypedStorage)."""
    return ref.numel * storage_element(ref)[1]


def tensor_dtype(t: TensorNode) -> str:
    """dtype name of a tensor node: the dtype global of ``_rebuild_tensor_v3``, else its storage class's
    (``"unknown"`` for a tensor without storage).

    Raises:
        UnsupportedError: an unknown storage class.
    """
    g = t.dtype_global
    if g is not None:
        return str(g.name)
    ref = t.storage
    return storage_element(ref)[0] if ref is not None else "unknown"


def safetensors_dtype(code: str) -> str:
    """torch dtype name of a safetensors dtype code (``"BF16"`` -> ``"bfloat16"``); an unknown code is returned
    lower-cased so that it can still be shown."""
    return ST_NAMES.get(code, code.lower())


def numel(shape: Sequence[int]) -> int:
    """Number of elements of a tensor of ``shape`` (1 for a scalar, 0 when a dimension is 0)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` in elements, as ``torch.empty(shape).stride()`` gives them (a dimension of
    size 0 counts as 1, so ``(3, 0)`` -> ``(1, 1)``)."""
    stride: list[int] = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))
