"""Dequantizing on ``convert --dtype``: which tensors of a source are quantized weights, which scale belongs to each,
and their blocks (torch-free; the arithmetic is :func:`ckptool.torch_ops.cast.dequantized`).

Fine-grained FP8 (DeepSeek-V3/R1, Qwen3-FP8, transformers' ``FineGrainedFP8Config``): a ``float8_e4m3fn`` weight
``X.weight`` (``(..., rows, cols)``) with a float32 ``X.weight_scale_inv`` of ``(..., ceil(rows / bm), ceil(cols /
bn))``, one scale per ``bm x bn`` block (``quantization_config.weight_block_size``, 128 x 128 in practice; without
it the block is ``rows / scale rows`` x ``cols / scale columns``, as transformers' ``Fp8Dequantize`` derives it).
Source: transformers ``integrations/finegrained_fp8.py`` (``Fp8Quantize._quantize_one`` names the scale,
``Fp8Dequantize._dequantize_one`` multiplies in float32).

Compressed-tensors FP8 (``quant_method: compressed-tensors``, format ``naive-quantized`` / ``float-quantized``,
llm-compressor's FP8 models): ``X.weight`` ``float8_e4m3fn`` with ``X.weight_scale`` of shape ``[1]`` (per tensor) or
``[rows, 1]`` (per channel), in the model's dtype, and for static activations an ``X.input_scale`` that leaves with
it. Source: compressed-tensors ``compressors/naive_quantized/base.py`` (``decompress``) and
``quantization/lifecycle/forward_helpers.py`` (``_dequantize``: ``x_q.to(scale.dtype) * scale``).

A weight is replaced by a float32 storage of its values (:class:`~ckptool.formats.tensors.Scaled`), rounded once to
the target dtype by the writer; the scales leave.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ckptool.errors import UnsupportedError
from ckptool.formats.dtypes import DTYPE_SIZES, contiguous_stride, numel
from ckptool.formats.tensors import Scaled, Source, Storage, Tensor, is_contiguous
from ckptool.model.quantization import FINE_GRAINED, MXFP4, Pair, block_of, find_pairs, scheme_of
from ckptool.model.quantization import quantization_config as quantization_config  # re-exported for convert


def _refuse(src: Source, why: str) -> UnsupportedError:
    return UnsupportedError(f"{src.path}: {why}; nothing was written")


def _values_of_fp8(t: Tensor, s: Tensor, pair: Pair, quant: Mapping[str, Any] | None) -> None:
    """Make ``t`` (an FP8 weight) the float32 values of ``t`` times its scale ``s`` by block.

    Raises:
        UnsupportedError: the scale's grid does not cover the weight; a weight stored as a view; a scale of another
            dtype (ue8m0).
    """
    if s.dtype not in ("float32", "bfloat16", "float16"):
        raise UnsupportedError(f"{s.name}: a {s.dtype} scale (ue8m0 or another format) is not dequantized yet; "
                               "nothing was written")
    block = block_of(quant if pair.scheme is FINE_GRAINED else None, t.shape, s.shape)
    if block == (0, 0):
        raise UnsupportedError(f"{t.name}: a weight of shape {list(t.shape)} does not fit its scale of shape "
                               f"{list(s.shape)} in blocks; nothing was written")
    if t.offset or not is_contiguous(t.shape, t.stride) or t.numel * DTYPE_SIZES[t.dtype] > t.storage.nbytes:
        raise UnsupportedError(f"{t.name}: a quantized weight stored as a view is not dequantized")
    st = t.storage
    compute = s.dtype if pair.scheme.in_scale_dtype else "float32"
    t.dtype, t.storage = "float32", Storage(st.path, st.offset, t.numel * DTYPE_SIZES["float32"], "float32",
                                            st.location, scaled=Scaled(st, t.shape, s, block, pair.scheme.name,
                                                                       compute))


def _values_of_mxfp4(t: Tensor, s: Tensor, pair: Pair, taken: Mapping[str, Tensor]) -> None:
    """Make ``t`` (an MXFP4 ``X_blocks``) ``X``, its float32 values in the layout transformers'
    ``convert_moe_packed_tensors`` gives (``(experts, groups * 32, rows)``).

    Raises:
        UnsupportedError: blocks and scales whose shapes do not match as MXFP4's do; the name ``X`` is taken.
    """
    if len(t.shape) != 4 or t.shape[:-1] != s.shape or t.offset or not is_contiguous(t.shape, t.stride):
        raise UnsupportedError(f"{t.name}: MXFP4 blocks of shape {list(t.shape)} with scales of shape "
                               f"{list(s.shape)} (expected (experts, rows, groups, 16) and (experts, rows, groups), "
                               "contiguous); nothing was written")
    if pair.name in taken:
        raise UnsupportedError(f"{t.name}: the dequantized name {pair.name} is taken; nothing was written")
    st = t.storage
    t.storage = Storage(st.path, st.offset, numel(pair.shape) * DTYPE_SIZES["float32"], "float32", st.location,
                        scaled=Scaled(st, t.shape, s, (1, t.shape[-1] * 2), MXFP4.name, fp4_packed=True))
    t.name, t.dtype, t.shape, t.stride = pair.name, "float32", pair.shape, contiguous_stride(pair.shape)


def dequantize_source(src: Source, quant: Mapping[str, Any] | None) -> list[str]:
    """Replace every quantized weight of ``src`` with its scale (:func:`ckptool.model.quantization.find_pairs`:
    fine-grained and compressed-tensors FP8, MXFP4) by its values (a float32 storage computed when written:
    :class:`~ckptool.formats.tensors.Scaled`) and leave its scale (and a static ``input_scale``) out; ``quant`` is the
    model folder's ``config.json`` ``quantization_config`` (or None: the scheme is then the scale's name). Returns
    notes saying what was done.

    Raises:
        UnsupportedError: a quantization ckptool does not dequantize (GPTQ, AWQ, bitsandbytes, ue8m0 scales,
            compressed-tensors other than FP8 per tensor / channel, another ``quant_method``:
            :func:`ckptool.model.quantization.scheme_of`), or a weight whose scale does not fit it.
    """
    chosen, why = scheme_of(quant)
    if why is not None:
        raise _refuse(src, why)
    by_name = {t.name: t for t in src.tensors}
    pairs = find_pairs({t.name: (t.dtype, t.shape) for t in src.tensors}, chosen)
    gone: set[int] = set()
    done: dict[str, int] = {}
    for pair in pairs:
        t, s = by_name[pair.weight], by_name[pair.scale]
        if pair.scheme is MXFP4:
            _values_of_mxfp4(t, s, pair, by_name)
        else:
            _values_of_fp8(t, s, pair, quant)
        gone.update(id(by_name[n]) for n in (pair.scale, *pair.extra))
        done[pair.scheme.name] = done.get(pair.scheme.name, 0) + 1
    if not done:
        return []
    dropped = [t.name for t in src.tensors if id(t) in gone]
    src.tensors[:] = [t for t in src.tensors if id(t) not in gone]
    what = ", ".join(f"{n} {name} weight(s)" for name, n in done.items())
    note = (f"dequantized {what} (upcast, times the scale of each block, rounded once); {len(dropped)} scale "
            f"tensor(s) left out ({dropped[0]}{' ...' if len(dropped) > 1 else ''})")
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
