"""Quantized weights on one side of a diff (torch-free): a quantized folder (fine-grained or compressed-tensors FP8,
MXFP4) against its dequantized output is compared as ``convert --dtype`` produced it.

When one side holds quantized weights with their scales (:func:`ckptool.model.quantization.find_pairs`, under its
folder's ``quantization_config``) and the other side has none of those scales, each such weight stands for its
dequantized values as :func:`ckptool.ops.convert.dequant.dequantize_source` makes them (a float32
:class:`~ckptool.formats.tensors.Scaled` storage; an MXFP4 ``X_blocks`` takes the name ``X`` and its dequantized
shape), and its scales (``weight_scale_inv``, ``weight_scale``, ``input_scale``, ``X_scales``) leave the side
instead of being reported "only in A". The values are computed (with torch:
:func:`ckptool.torch_ops.cast.dequantized`, the arithmetic ``convert`` uses, rounded once to the other side's dtype
as ``convert --dtype`` rounds them) only when compared with ``--rtol`` / ``--atol``: the dtype is then no change.
Bit-exact (no tolerance), a quantized weight is not compared by value and its stored dtype against the other
side's is a change, as for any two tensors of different dtypes.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace

from ckptool.errors import UnsupportedError
from ckptool.formats.tensors import Source, Tensor
from ckptool.model.quantization import find_pairs, quantization_config, scheme_of

#: ``convert``'s dequantizing (:mod:`ckptool.ops.convert.dequant`), imported by a side that has quantized weights:
#: importing ``ckptool.ops.convert`` (its writers) would otherwise double what every ``diff`` imports (start-up)
_DEQUANT = "ckptool.ops.convert.dequant"


def _folder(path: str) -> str:
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def dequantize_side(tensors: dict[str, Tensor], path: str, other: dict[str, Tensor], fmt: str) -> list[str]:
    """Replace, in ``tensors`` (one side's tensors by key, read from ``path``), each quantized weight by its
    dequantized values and drop its scales, when ``other`` (the other side's tensors) holds none of those scales;
    returns notes saying what was done (none: nothing quantized, or both sides quantized and compared as stored).

    A ``quantization_config`` ``convert`` refuses (GPTQ, AWQ, bitsandbytes, ue8m0...) leaves the side as stored;
    so does a weight ``convert`` would refuse (a scale grid that does not fit it), with a note saying why.
    """
    try:
        quant = quantization_config(_folder(path))
    except UnsupportedError:
        quant = None
    chosen, why = scheme_of(quant)
    if why is not None:
        return []
    pairs = find_pairs({k: (t.dtype, t.shape) for k, t in tensors.items()}, chosen)
    if not pairs or any(p.scale in other for p in pairs):
        return []
    src = Source(path, fmt, [replace(t) for t in tensors.values()])  # a refusal leaves ``tensors`` whole
    try:
        notes: list[str] = importlib.import_module(_DEQUANT).dequantize_source(src, quant)
    except UnsupportedError as e:  # the side is compared as stored
        return [f"quantized weights compared as stored: {e}".removesuffix("; nothing was written")]
    tensors.clear()
    tensors.update((t.name, t) for t in src.tensors)
    return [f"{path}: {n}" for n in notes]
