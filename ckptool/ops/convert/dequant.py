"""Dequantizing on ``convert --dtype``: which tensors of a source are quantized weights, which scale belongs to each,
and their blocks (torch-free; the arithmetic is :func:`ckptool.torch_ops.cast.dequantized`).

Fine-grained FP8 (DeepSeek-V3/R1, Qwen3-FP8, transformers' ``FineGrainedFP8Config``): a ``float8_e4m3fn`` weight
``X.weight`` (``(..., rows, cols)``) with a float32 ``X.weight_scale_inv`` of ``(..., ceil(rows / bm), ceil(cols /
bn))``, one scale per ``bm x bn`` block (``quantization_config.weight_block_size``, 128 x 128 by default; without a
config the block is ``rows / scale rows`` x ``cols / scale columns``, as transformers' ``Fp8Dequantize`` derives it).
Source: transformers ``integrations/finegrained_fp8.py`` (``Fp8Quantize._quantize_one`` names the scale,
``Fp8Dequantize._dequantize_one`` multiplies). A weight is replaced by a float32 storage of its values
(:class:`~ckptool.formats.tensors.Scaled`), rounded once to the target dtype by the writer; the scales leave.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from ckptool.errors import UnsupportedError
from ckptool.formats.dtypes import DTYPE_SIZES
from ckptool.formats.tensors import Scaled, Source, Storage, is_contiguous

#: the suffix of a fine-grained FP8 weight's scale tensor, after the weight's module path
FP8_SCALE = "weight_scale_inv"
#: float8 dtypes a fine-grained FP8 weight is stored in
FP8_DTYPES = ("float8_e4m3fn",)
#: ``quantization_config.quant_method`` values ckptool dequantizes, and those it names and refuses (with why)
REFUSED_METHODS = {
    "gptq": "GPTQ packs int4 weights with zero points and a group index (act-order); dequantize with its own library",
    "awq": "AWQ packs int4 weights with per-group zero points; dequantize with its own library",
    "bitsandbytes": "bitsandbytes NF4/int8 weights carry quantization state tensors only bitsandbytes decodes",
}


def quantization_config(folder: str | None) -> dict[str, Any] | None:
    """``config.json``'s ``quantization_config`` in the model folder ``folder`` (None: no folder, no file, no entry).

    Raises:
        UnsupportedError: ``config.json`` is not a JSON object.
    """
    if folder is None or not os.path.isfile(os.path.join(folder, "config.json")):
        return None
    try:
        with open(os.path.join(folder, "config.json"), "rb") as f:
            cfg = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise UnsupportedError(f"{folder}/config.json: unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise UnsupportedError(f"{folder}/config.json: not a JSON object")
    quant = cfg.get("quantization_config")
    return quant if isinstance(quant, dict) else None


def _block(cfg: Mapping[str, Any] | None, shape: tuple[int, ...], sshape: tuple[int, ...],
           name: str) -> tuple[int, int]:
    """The ``(rows, cols)`` block of weight ``name`` of ``shape`` with a scale of ``sshape``.

    Raises:
        UnsupportedError: the scale's grid does not cover the weight in blocks of that size.
    """
    rows, cols = shape[-2:]
    srows, scols = sshape[-2:] if len(sshape) >= 2 else (1, 1)
    given = (cfg or {}).get("weight_block_size")
    if given:
        bm, bn = int(given[0]), int(given[1])
    elif rows % srows == 0 and cols % scols == 0:
        bm, bn = rows // srows, cols // scols
    else:
        bm = bn = 0
    if not bm or (math.ceil(rows / bm), math.ceil(cols / bn)) != (srows, scols) or shape[:-2] != sshape[:-2]:
        raise UnsupportedError(f"{name}: a weight of shape {list(shape)} does not fit its scale of shape "
                               f"{list(sshape)} in blocks of {bm}x{bn}; nothing was written")
    return bm, bn


def dequantize_source(src: Source, quant: Mapping[str, Any] | None) -> list[str]:
    """Replace every fine-grained FP8 weight of ``src`` by its values (a float32 storage to be computed:
    :class:`~ckptool.formats.tensors.Scaled`) and leave its scale out; ``quant`` is the model folder's
    ``config.json`` ``quantization_config`` (or None). Returns notes saying what was dequantized.

    Raises:
        UnsupportedError: a quantization ckptool does not dequantize (GPTQ, AWQ, bitsandbytes, ue8m0 scales,
            another ``quant_method``), or a weight whose scale grid does not fit it.
    """
    method = (quant or {}).get("quant_method")
    if method in REFUSED_METHODS:
        raise UnsupportedError(f"{src.path}: {method} quantization is not dequantized by ckptool: "
                               f"{REFUSED_METHODS[method]}; nothing was written")
    if method not in (None, "fp8"):
        raise UnsupportedError(f"{src.path}: quant_method {method!r} is not one ckptool dequantizes (fine-grained "
                               "fp8); nothing was written")
    if (quant or {}).get("scale_fmt") == "ue8m0":
        raise UnsupportedError(f"{src.path}: FP8 with ue8m0 (power-of-two) scales is not dequantized yet; nothing "
                               "was written")
    by_name = {t.name: t for t in src.tensors}
    scales: set[int] = set()
    done = 0
    for t in src.tensors:
        if t.dtype not in FP8_DTYPES or not t.name.endswith("weight") or len(t.shape) < 2:
            continue
        s = by_name.get(t.name[: -len("weight")] + FP8_SCALE)
        if s is None:
            continue
        if s.dtype not in ("float32", "bfloat16", "float16"):
            raise UnsupportedError(f"{s.name}: a {s.dtype} scale (ue8m0 or another format) is not dequantized yet; "
                                   "nothing was written")
        block = _block(quant, t.shape, s.shape, t.name)
        if t.offset or not is_contiguous(t.shape, t.stride) or t.numel * DTYPE_SIZES[t.dtype] > t.storage.nbytes:
            raise UnsupportedError(f"{t.name}: a quantized weight stored as a view is not dequantized")
        st = t.storage
        values = Storage(st.path, st.offset, t.numel * DTYPE_SIZES["float32"], "float32", st.location,
                         scaled=Scaled(st, t.shape, s, block, "fine-grained fp8"))
        t.dtype, t.storage = "float32", values
        scales.add(id(s))
        done += 1
    if not done:
        return []
    src.tensors[:] = [t for t in src.tensors if id(t) not in scales]
    note = (f"dequantized {done} fine-grained FP8 weight(s) (each block's scale multiplied in float32, then rounded "
            f"once); their {len(scales)} {FP8_SCALE} tensor(s) left out")
    return [note]



def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def without_key(text: str, key: str) -> str | None:
    """The JSON object ``text`` without its top-level entry ``key``, every other byte kept (the entry is cut from
    its key to the next key, or, when last, from the end of the previous value); None when it has no such entry.

    Raises:
        ValueError: ``text`` is not a JSON object.
    """
    dec = json.JSONDecoder()
    i = _ws(text, 0)
    if text[i:i + 1] != "{":
        raise ValueError("not a JSON object")
    i = _ws(text, i + 1)
    prev_end = i  # just after '{' or after the previous value
    while text[i:i + 1] == '"':
        start = i
        name, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
        i = _ws(text, i)
        if text[i:i + 1] != ":":
            raise ValueError("expected ':'")
        _value, end = dec.raw_decode(text, _ws(text, i + 1))
        j = _ws(text, end)
        last = text[j:j + 1] != ","
        nxt = j if last else _ws(text, j + 1)
        if name == key:
            if not last:
                return text[:start] + text[nxt:]
            return text[:prev_end] + text[end:] if prev_end != start else text[:start] + text[j:]
        prev_end, i = end, nxt
        if last:
            break
    return None


def unquantized_config(src: str, folder: str) -> str | None:
    """Write ``src`` (a ``config.json``) without its ``quantization_config`` into ``folder``; the path written, or None
    when it has none (copied unchanged then).

    Raises:
        UnsupportedError: ``src`` is not a JSON object.
    """
    with open(src, encoding="utf-8") as f:
        text = f.read()
    try:
        out = without_key(text, "quantization_config")
    except ValueError as e:
        raise UnsupportedError(f"{src}: not a JSON object ({e})") from None
    if out is None:
        return None
    path = os.path.join(folder, "config.json")
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(out)
    return path
