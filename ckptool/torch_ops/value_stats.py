"""Element-wise differences between two runs of tensor elements, with numpy, for ``ckptool diff``.

The differences are measured in the manner of ``torch.testing.assert_close(actual=B, expected=A)``: an element of
B is close to A's when ``|b - a| <= atol + rtol * |a|``, NaN equals NaN, and ``inf`` equals ``inf`` of the same
sign; the relative difference is ``|b - a| / |a|``. Elements are compared in float64 (complex128 for complex
dtypes), whatever their dtypes, so tensors of different dtypes compare by value. numpy is imported when a
comparison starts (it is optional for ``ckptool``: without it ``import numpy`` raises ``ModuleNotFoundError``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptool.errors import UnsupportedError
from ckptool.model.numpy_nodes import NUMPY_CODES

if TYPE_CHECKING:
    import numpy as np

#: torch dtype name -> numpy dtype string (little-endian), the inverse of numpy_nodes' table
_NUMPY_DTYPES = {name: "<" + code for code, name in NUMPY_CODES.items()}


def is_numeric(dtype: str) -> bool:
    """True when elements of ``dtype`` (a torch dtype name) can be decoded to numbers here: the numpy dtypes and
    ``bfloat16``."""
    return dtype in _NUMPY_DTYPES or dtype == "bfloat16"


def require_numpy() -> None:
    """Import numpy, which comparing by value with tolerances needs.

    Raises:
        ModuleNotFoundError: numpy is not installed (``pip install numpy``).
    """
    import numpy  # noqa: F401


def decode_elements(data: bytes | bytearray, dtype: str) -> np.ndarray:
    """The little-endian elements of ``dtype`` in ``data`` as a 1-D NumPy array (no copy; ``bfloat16`` widened to
    ``float32``).

    Raises:
        UnsupportedError: a dtype whose elements NumPy cannot compare by value.
    """
    import numpy as np

    if dtype == "bfloat16":  # the upper half of a float32
        return (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view("<f4")
    code = _NUMPY_DTYPES.get(dtype)
    if code is None:
        raise UnsupportedError(f"{dtype} elements cannot be compared by value (only bool, integer, float16/32/64, "
                               "bfloat16 and complex dtypes can)")
    return np.frombuffer(data, dtype=code)


@dataclass
class ValueStats:
    """Running differences over the chunks of one tensor pair: ``max_abs`` / ``max_rel`` the greatest absolute
    and relative differences (NaN against a number left out of both), ``mismatched`` the number of elements that
    differ (bit-exact mode) or are not close (tolerance mode), ``elements`` the number compared."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    mismatched: int = 0
    elements: int = 0

    def update(self, a: bytes | bytearray, b: bytes | bytearray, dtype_a: str, dtype_b: str, *,
               rtol: float | None = None, atol: float | None = None) -> None:
        """Add one chunk: ``a`` and ``b`` hold the same number of elements of ``dtype_a`` / ``dtype_b``, in the same
        order. Without tolerances (``rtol`` and ``atol`` None) an element mismatches when its bytes differ (same
        dtype) or its value differs; with them, when it is not close (see the module docstring).

        Raises:
            UnsupportedError: a dtype that cannot be decoded (float8, quantized...).
            ModuleNotFoundError: numpy is not installed.
        """
        import numpy as np

        va, vb = decode_elements(a, dtype_a), decode_elements(b, dtype_b)
        kind = complex if np.iscomplexobj(va) or np.iscomplexobj(vb) else float
        fa = va.astype(np.complex128 if kind is complex else np.float64)
        fb = vb.astype(np.complex128 if kind is complex else np.float64)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            nan_a, nan_b = np.isnan(fa), np.isnan(fb)
            same = (fa == fb) | (nan_a & nan_b)
            diff = np.where(same, 0.0, np.abs(fb - fa))
            scale = np.abs(fa)
            rel = np.where(diff == 0, 0.0, diff / scale)
            if rtol is None and atol is None:
                if dtype_a == dtype_b:
                    width = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}.get(va.dtype.itemsize)
                    bits_equal = (np.frombuffer(a, dtype=width) == np.frombuffer(b, dtype=width)) if width else same
                    bad = ~bits_equal if width else ~same
                else:
                    bad = ~same
            else:
                bad = ~same & ~(diff <= (atol or 0.0) + (rtol or 0.0) * scale)
            finite = np.isfinite(diff)
            if finite.any():
                self.max_abs = max(self.max_abs, float(diff[finite].max()))
            if not finite.all():  # inf against a number, NaN against a number
                self.max_abs = math.inf
            rel_finite = np.isfinite(rel)
            if rel_finite.any():
                self.max_rel = max(self.max_rel, float(rel[rel_finite].max()))
            if not rel_finite.all():  # a difference where A is 0 (or not finite)
                self.max_rel = math.inf
        self.mismatched += int(bad.sum())
        self.elements += int(va.size)


def squared_norms(a: bytes | bytearray, b: bytes | bytearray, dtype_a: str, dtype_b: str) -> tuple[float, float]:
    """``(sum a**2, sum (b - a)**2)`` over one chunk of elements (in float64; complex: squared magnitudes), for the
    relative change ``||B - A|| / ||A||`` of ``ckptool report``. Elements that are not finite are left out.

    Raises:
        UnsupportedError: a dtype that cannot be decoded (float8, quantized...).
        ModuleNotFoundError: numpy is not installed.
    """
    import numpy as np

    va, vb = decode_elements(a, dtype_a), decode_elements(b, dtype_b)
    kind = np.complex128 if np.iscomplexobj(va) or np.iscomplexobj(vb) else np.float64
    fa, fb = va.astype(kind), vb.astype(kind)
    with np.errstate(invalid="ignore", over="ignore"):
        d = fb - fa
        ok = np.isfinite(fa) & np.isfinite(d)
        return float(np.sum(np.abs(fa[ok]) ** 2)), float(np.sum(np.abs(d[ok]) ** 2))
