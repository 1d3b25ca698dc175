"""The one dtype table (ckptool/formats/dtypes.py) checked against the libraries it mirrors: torch 2.13's dtypes and
storage classes, and the safetensors package's own code table (``safetensors.torch._TYPES``)."""

from __future__ import annotations

import pytest

from ckptool.formats import dtypes

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")


def _name(dt: object) -> str:
    return str(dt).removeprefix("torch.")


def test_safetensors_codes_match_the_safetensors_package() -> None:
    theirs = {code: _name(dt) for code, dt in st_torch._TYPES.items()}
    for code, name in theirs.items():
        assert dtypes.ST_NAMES[code] == name, code
        assert dtypes.ST_CODES[name] == code, name
    # codes we add beyond the Python loader's table are the format's own (safetensors' Rust Dtype enum)
    extra = set(dtypes.ST_CODES.values()) - set(theirs)
    assert extra <= {"F8_E8M0"}, extra
    assert set(dtypes.ST_READ_ONLY) == {"F4"} and not set(dtypes.ST_READ_ONLY) & set(theirs)


def test_element_sizes_match_torch() -> None:
    for name, size in dtypes.DTYPE_SIZES.items():
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            assert dt.itemsize == size, name
    for code, name in dtypes.ST_NAMES.items():
        assert name in dtypes.DTYPE_SIZES, code


def test_storage_classes_match_torch() -> None:
    for cls_name, (dtype, size) in dtypes.STORAGE_TYPES.items():
        cls = getattr(torch, cls_name)
        if cls_name == "UntypedStorage":
            assert (dtype, size) == ("uint8", 1)
            continue
        assert _name(cls(0).dtype) == dtype, cls_name
        assert cls(0).element_size() == size, cls_name


def test_helpers() -> None:
    assert dtypes.safetensors_dtype("BF16") == "bfloat16"
    assert dtypes.safetensors_dtype("F4") == "float4_e2m1fn_x2"
    assert dtypes.safetensors_dtype("X9") == "x9"
    assert dtypes.element_size("bfloat16") == 2
    with pytest.raises(dtypes.UnsupportedError):
        dtypes.element_size("float13")
    for shape in [(3, 0), (0, 3), (2, 3), (), (4,), (2, 1, 5)]:
        assert dtypes.contiguous_stride(shape) == torch.empty(shape).stride(), shape
        assert dtypes.numel(shape) == torch.empty(shape).numel(), shape
