"""Quantization schemes as data (torch-free): which tensors of a checkpoint are quantized weights, which scale
belongs to each, their blocks, and which schemes ckptool dequantizes or refuses, and why. ``convert --dtype``
dequantizes with it (:mod:`ckptool.ops.convert.dequant`), ``inspect`` describes with it; docs/dtypes.md gives the
layouts and the source of each fact.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptool.errors import UnsupportedError
from ckptool.model.units import human_bytes

#: the suffix of a fine-grained FP8 weight's scale tensor, after the weight's module path
FP8_SCALE = "weight_scale_inv"
#: float8 dtypes an FP8 weight is stored in
FP8_DTYPES = ("float8_e4m3fn",)
#: the dtypes a quantized weight of a known scheme is stored in (FP8, MXFP4's uint8 blocks): a checkpoint holding
#: none, without a ``quantization_config``, has nothing :func:`describe` finds
PAIR_DTYPES = frozenset((*FP8_DTYPES, "uint8"))
#: ``quantization_config.quant_method`` values named and refused, with why
REFUSED_METHODS = {
    "gptq": "GPTQ packs int4 weights with zero points and a group index (act-order); dequantize with its own library",
    "awq": "AWQ packs int4 weights with per-group zero points; dequantize with its own library",
    "bitsandbytes": "bitsandbytes NF4/int8 weights carry quantization state tensors only bitsandbytes decodes",
}


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


def _compressed_tensors_refusal(quant: Mapping[str, Any]) -> str | None:
    """Why a compressed-tensors ``quant`` is not dequantized (None: every config group is symmetric 8-bit float
    weights, per tensor or per channel, stored naive- or float-quantized, without transforms)."""
    if quant.get("transform_config"):
        return "compressed-tensors with a transform (rotation) config is not dequantized"
    for name, group in (quant.get("config_groups") or {}).items():
        fmt = group.get("format") or quant.get("format")
        w = group.get("weights") or {}
        if fmt not in _CT_FORMATS:
            return (f"compressed-tensors format {fmt!r} ({name}) is not dequantized: ckptool reads "
                    f"{' and '.join(_CT_FORMATS)} FP8 only")
        if (w.get("type"), w.get("num_bits")) != ("float", 8) or w.get("symmetric") is False:
            return (f"compressed-tensors {name}: {w.get('num_bits')}-bit {w.get('type')} weights (symmetric: "
                    f"{w.get('symmetric')}) are not dequantized: ckptool reads symmetric FP8")
        if w.get("strategy") not in ("tensor", "channel"):
            return (f"compressed-tensors {name}: strategy {w.get('strategy')!r} is not dequantized: ckptool reads "
                    "per-tensor and per-channel FP8")
    return None


def scheme_of(quant: Mapping[str, Any] | None) -> tuple[Scheme | None, str | None]:
    """``(scheme, refusal)`` of a ``quantization_config``: the scheme it names (None without a config or a
    ``quant_method``: each weight's scale name says it then), or why ckptool does not dequantize it."""
    method = (quant or {}).get("quant_method")
    if quant is None or method is None:
        return None, None
    if method in REFUSED_METHODS:
        return None, f"{method} quantization is not dequantized by ckptool: {REFUSED_METHODS[method]}"
    if method == "fp8":
        if quant.get("scale_fmt") == "ue8m0":
            return None, "FP8 with ue8m0 (power-of-two) scales is not dequantized yet"
        return FINE_GRAINED, None
    if method == "mxfp4":
        return MXFP4, None
    if method == "compressed-tensors":
        why = _compressed_tensors_refusal(quant)
        return (None, why) if why else (COMPRESSED_TENSORS, None)
    return None, f"quant_method {method!r} is not one ckptool dequantizes (fp8, compressed-tensors, mxfp4)"


def block_of(cfg: Mapping[str, Any] | None, shape: tuple[int, ...], sshape: tuple[int, ...]) -> tuple[int, int]:
    """The ``(rows, cols)`` block of a weight of ``shape`` whose scale has ``sshape``: ``weight_block_size`` of
    ``cfg`` (a fine-grained FP8 config), else the weight's sides over the scale grid's, as transformers'
    ``Fp8Dequantize`` derives it; ``(0, 0)`` when the grid does not cover the weight in such blocks."""
    rows, cols = shape[-2:]
    srows, scols = sshape[-2:] if len(sshape) >= 2 else (1, 1)
    given = (cfg or {}).get("weight_block_size")
    if given:
        bm, bn = int(given[0]), int(given[1])
    elif srows and scols and rows % srows == 0 and cols % scols == 0:
        bm, bn = rows // srows, cols // scols
    else:
        return 0, 0
    if not bm or not bn or (math.ceil(rows / bm), math.ceil(cols / bn)) != (srows, scols):
        return 0, 0
    if len(sshape) >= 2 and shape[:-2] != sshape[:-2]:
        return 0, 0
    return bm, bn


@dataclass(frozen=True)
class Pair:
    """A quantized weight found by :func:`find_pairs`: ``weight`` and ``scale`` names, its ``scheme``, the tensors
    that leave with it (``extra``), and the ``name`` and ``shape`` it takes once dequantized."""

    weight: str
    scale: str
    scheme: Scheme
    extra: tuple[str, ...]
    name: str
    shape: tuple[int, ...]


def find_pairs(tensors: Mapping[str, tuple[str, tuple[int, ...]]], chosen: Scheme | None) -> list[Pair]:
    """The quantized weights among ``tensors`` (name -> ``(dtype, shape)``, in state_dict order) under the scheme
    ``chosen`` (None: any, by the scale's name): an FP8 weight ``X.weight`` with ``X.weight_scale_inv`` or
    ``X.weight_scale``, an MXFP4 stack ``X_blocks`` (uint8) with ``X_scales`` (uint8)."""
    out = []
    for name, (dtype, shape) in tensors.items():
        if dtype in FP8_DTYPES and name.endswith("weight") and len(shape) >= 2 and chosen is not MXFP4:
            base = name[: -len("weight")]
            scheme = chosen or next((c for c in (FINE_GRAINED, COMPRESSED_TENSORS) if base + c.scale in tensors),
                                    None)
            if scheme is not None and base + scheme.scale in tensors:
                extra = tuple(base + e for e in scheme.extra if base + e in tensors)
                out.append(Pair(name, base + scheme.scale, scheme, extra, name, shape))
        elif dtype == "uint8" and name.endswith("_blocks") and chosen in (None, MXFP4):
            base = name.removesuffix("_blocks")
            sc = tensors.get(base + MXFP4.scale)
            if sc is not None and sc[0] == "uint8":
                dims = (shape[0], shape[2] * shape[3] * 2, shape[1]) if len(shape) == 4 else shape
                out.append(Pair(name, base + MXFP4.scale, MXFP4, (), base, dims))
    return out


def describe(tensors: Mapping[str, tuple[str, tuple[int, ...], int]],
             quant: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What ``inspect`` says of a checkpoint's quantization, from its tensors (name -> ``(dtype, shape, bytes)``)
    and its ``quantization_config`` (or None); None when neither shows one.

    The dict: ``scheme`` (the schemes found, or the config's ``quant_method``), ``quant_method``, ``refused`` (why
    ``convert --dtype`` does not dequantize it, else None), ``weights`` (dequantized name -> ``{"weight", "scale",
    "extra", "block", "shape"}``: the tensors stored, the block of elements one scale covers, the shape once
    dequantized), ``stored_bytes`` (the bytes of those tensors) and ``bfloat16_bytes`` (the weights' bytes once
    dequantized to bfloat16).
    """
    chosen, why = scheme_of(quant)
    method = (quant or {}).get("quant_method")
    pairs = [] if why else find_pairs({k: (d, s) for k, (d, s, _n) in tensors.items()}, chosen)
    if not pairs and method is None:
        return None
    weights: dict[str, Any] = {}
    stored = 0
    for p in pairs:
        if p.scheme is MXFP4:
            block: list[int] = [1, tensors[p.weight][1][-1] * 2]
        else:
            block = list(block_of(quant if p.scheme is FINE_GRAINED else None, tensors[p.weight][1],
                                  tensors[p.scale][1]))
        weights[p.name] = {"weight": p.weight, "scale": p.scale, "extra": list(p.extra), "block": block,
                           "shape": list(p.shape)}
        stored += sum(tensors[n][2] for n in (p.weight, p.scale, *p.extra))
    names = sorted({p.scheme.name for p in pairs}) or [str(method)]
    return {"scheme": ", ".join(names), "quant_method": method, "refused": why, "weights": weights,
            "stored_bytes": stored, "bfloat16_bytes": sum(2 * math.prod(p.shape) for p in pairs)}


def summary(q: Mapping[str, Any]) -> str:
    """One line of :func:`describe`'s dict for people: the scheme, the weights and their blocks, the sizes, or why it
    is refused."""
    if q["refused"]:
        return f"{q['scheme']}: not dequantized by ckptool ({q['refused']})"
    ws = q["weights"]
    blocks = sorted({"x".join(map(str, w["block"])) for w in ws.values()})
    return (f"{q['scheme']}: {len(ws)} quantized weight(s) with their scales (blocks {', '.join(blocks) or '-'}), "
            f"{human_bytes(q['stored_bytes'])} stored, {human_bytes(q['bfloat16_bytes'])} as bfloat16 "
            "(convert --dtype bfloat16 dequantizes them)")
