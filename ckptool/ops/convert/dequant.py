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
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptool.errors import UnsupportedError
from ckptool.formats.dtypes import DTYPE_SIZES, contiguous_stride, numel
from ckptool.formats.tensors import Scaled, Source, Storage, Tensor, is_contiguous

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


@dataclass(frozen=True)
class Scheme:
    """A quantization ckptool dequantizes: its ``name``, the suffix of a weight's scale after the module path
    (``scale``), the other per-module tensors that leave the output with it (``extra``: a static activation scale),
    whether the product is rounded in the scale's dtype (``in_scale_dtype``: compressed-tensors) or in float32."""

    name: str
    scale: str
    extra: tuple[str, ...] = ()
    in_scale_dtype: bool = False


#: fine-grained FP8 (transformers ``integrations/finegrained_fp8.py``; DeepSeek-V3's ``weight_scale_inv``)
FINE_GRAINED = Scheme("fine-grained fp8", FP8_SCALE)
#: compressed-tensors FP8, per tensor or per channel (``compressors/naive_quantized/base.py``: ``weight_scale``,
#: ``input_scale`` for static activations; ``forward_helpers._dequantize``: ``x_q.to(scale.dtype) * scale``)
COMPRESSED_TENSORS = Scheme("compressed-tensors fp8", "weight_scale", ("input_scale",), in_scale_dtype=True)
#: MXFP4 (gpt-oss; transformers ``integrations/mxfp4.py``): ``X_blocks`` uint8 ``(experts, rows, groups, 16)``, two
#: e2m1 values a byte (low nibble first), 32 a block, and ``X_scales`` uint8 E8M0 exponents ``(experts, rows, groups)``
MXFP4 = Scheme("mxfp4", "_scales")
#: compressed-tensors formats whose FP8 weights are stored as they are, one scale per tensor or channel
_CT_FORMATS = ("naive-quantized", "float-quantized")


def _refuse(src: Source, why: str) -> UnsupportedError:
    return UnsupportedError(f"{src.path}: {why}; nothing was written")


def _check_compressed_tensors(src: Source, quant: Mapping[str, Any]) -> None:
    """Raise unless every config group of a compressed-tensors ``quant`` is 8-bit float weights, symmetric, per
    tensor or per channel, stored naive- or float-quantized, without transforms."""
    if quant.get("transform_config"):
        raise _refuse(src, "compressed-tensors with a transform (rotation) config is not dequantized")
    for name, group in (quant.get("config_groups") or {}).items():
        fmt = group.get("format") or quant.get("format")
        w = group.get("weights") or {}
        if fmt not in _CT_FORMATS:
            raise _refuse(src, f"compressed-tensors format {fmt!r} ({name}) is not dequantized: ckptool reads "
                               f"{' and '.join(_CT_FORMATS)} FP8 only")
        if (w.get("type"), w.get("num_bits")) != ("float", 8) or w.get("symmetric") is False:
            raise _refuse(src, f"compressed-tensors {name}: {w.get('num_bits')}-bit {w.get('type')} weights "
                               f"(symmetric: {w.get('symmetric')}) are not dequantized: ckptool reads symmetric FP8")
        if w.get("strategy") not in ("tensor", "channel"):
            raise _refuse(src, f"compressed-tensors {name}: strategy {w.get('strategy')!r} is not dequantized: "
                               "ckptool reads per-tensor and per-channel FP8")


def _scheme(src: Source, quant: Mapping[str, Any] | None) -> Scheme | None:
    """The scheme ``quant`` (a ``quantization_config``) names, checked; None without a config (then each weight's
    scale name says it).

    Raises:
        UnsupportedError: a scheme ckptool does not dequantize, with the reason.
    """
    method = (quant or {}).get("quant_method")
    if quant is None or method is None:
        return None
    if method in REFUSED_METHODS:
        raise _refuse(src, f"{method} quantization is not dequantized by ckptool: {REFUSED_METHODS[method]}")
    if method == "fp8":
        if quant.get("scale_fmt") == "ue8m0":
            raise _refuse(src, "FP8 with ue8m0 (power-of-two) scales is not dequantized yet")
        return FINE_GRAINED
    if method == "mxfp4":
        return MXFP4
    if method == "compressed-tensors":
        _check_compressed_tensors(src, quant)
        return COMPRESSED_TENSORS
    raise _refuse(src, f"quant_method {method!r} is not one ckptool dequantizes (fp8, compressed-tensors, mxfp4)")


def _mxfp4(src: Source, chosen: Scheme | None, by_name: dict[str, Tensor], gone: set[int],
           done: dict[str, int]) -> None:
    """Replace each MXFP4 expert stack ``X_blocks`` (with its ``X_scales``) of ``src`` by ``X``, its values in the
    layout transformers' ``convert_moe_packed_tensors`` gives (``(experts, groups * 32, rows)``), adding the scales
    to ``gone`` and the count to ``done``.

    Raises:
        UnsupportedError: blocks and scales whose shapes do not match as MXFP4's do.
    """
    if chosen not in (None, MXFP4):
        return
    for t in src.tensors:
        s = by_name.get(t.name.removesuffix("_blocks") + MXFP4.scale) if t.name.endswith("_blocks") else None
        if s is None or (t.dtype, s.dtype) != ("uint8", "uint8"):
            continue
        name = t.name.removesuffix("_blocks")
        if len(t.shape) != 4 or t.shape[:-1] != s.shape or t.offset or not is_contiguous(t.shape, t.stride):
            raise UnsupportedError(f"{t.name}: MXFP4 blocks of shape {list(t.shape)} with scales of shape "
                                   f"{list(s.shape)} (expected (experts, rows, groups, 16) and (experts, rows, "
                                   "groups), contiguous); nothing was written")
        if name in by_name:
            raise UnsupportedError(f"{t.name}: the dequantized name {name} is taken; nothing was written")
        experts, rows, groups, nb = t.shape
        shape = (experts, groups * nb * 2, rows)
        st = t.storage
        t.storage = Storage(st.path, st.offset, numel(shape) * DTYPE_SIZES["float32"], "float32", st.location,
                            scaled=Scaled(st, t.shape, s, (1, nb * 2), MXFP4.name, fp4_packed=True))
        t.name, t.dtype, t.shape, t.stride = name, "float32", shape, contiguous_stride(shape)
        gone.add(id(s))
        done[MXFP4.name] = done.get(MXFP4.name, 0) + 1


def dequantize_source(src: Source, quant: Mapping[str, Any] | None) -> list[str]:
    """Replace every FP8 weight of ``src`` that has a scale (fine-grained ``weight_scale_inv``, compressed-tensors
    ``weight_scale``) by its values (a float32 storage computed when written: :class:`~ckptool.formats.tensors.Scaled`)
    and leave its scale (and a static ``input_scale``) out; ``quant`` is the model folder's ``config.json``
    ``quantization_config`` (or None: the scheme is then the scale's name). Returns notes saying what was done.

    Raises:
        UnsupportedError: a quantization ckptool does not dequantize (GPTQ, AWQ, bitsandbytes, ue8m0 scales,
            compressed-tensors other than FP8 per tensor / channel, another ``quant_method``), or a weight whose scale
            grid does not fit it.
    """
    chosen = _scheme(src, quant)
    by_name = {t.name: t for t in src.tensors}
    gone: set[int] = set()
    done: dict[str, int] = {}
    for t in src.tensors:
        if chosen is MXFP4 or t.dtype not in FP8_DTYPES or not t.name.endswith("weight") or len(t.shape) < 2:
            continue
        base = t.name[: -len("weight")]
        scheme = chosen or next((c for c in (FINE_GRAINED, COMPRESSED_TENSORS) if base + c.scale in by_name), None)
        s = by_name.get(base + scheme.scale) if scheme is not None else None
        if scheme is None or s is None:
            continue
        if s.dtype not in ("float32", "bfloat16", "float16"):
            raise UnsupportedError(f"{s.name}: a {s.dtype} scale (ue8m0 or another format) is not dequantized yet; "
                                   "nothing was written")
        block = _block(quant if scheme is FINE_GRAINED else None, t.shape, s.shape, t.name)
        if t.offset or not is_contiguous(t.shape, t.stride) or t.numel * DTYPE_SIZES[t.dtype] > t.storage.nbytes:
            raise UnsupportedError(f"{t.name}: a quantized weight stored as a view is not dequantized")
        st = t.storage
        compute = s.dtype if scheme.in_scale_dtype else "float32"
        t.dtype, t.storage = "float32", Storage(st.path, st.offset, t.numel * DTYPE_SIZES["float32"], "float32",
                                                st.location, scaled=Scaled(st, t.shape, s, block, scheme.name, compute))
        gone.update(id(x) for x in (s, *(by_name.get(base + e) for e in scheme.extra)) if x is not None)
        done[scheme.name] = done.get(scheme.name, 0) + 1
    _mxfp4(src, chosen, by_name, gone, done)
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
