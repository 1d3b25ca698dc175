"""Tensors that are not one strided view of one storage: sparse, quantized, packed, nested and other rebuilt
tensors, told apart in the node graph so that a command that cannot write them says so by name.

torch pickles these with their own rebuild functions (torch/_utils.py, torch/_tensor.py):

* sparse: ``_rebuild_sparse_tensor(layout, data)``, ``layout`` ``torch.sparse_coo`` (or, since torch 2.x,
  ``torch.serialization._get_layout('torch.sparse_csr')``: CSR, CSC, BSR, BSC), ``data`` the index and value tensors;
* quantized: ``_rebuild_qtensor(storage, offset, size, stride, quantizer_params, ...)``, ``quantizer_params``
  ``(torch.per_tensor_affine, scale, zero_point)`` or ``(torch.per_channel_affine, scales, zero_points, axis)``;
* packed parameters: the state_dict of a dynamically quantized model (``torch.ao.quantization.quantize_dynamic``)
  holds ``<layer>._packed_params._packed_params`` = ``(quantized weight, bias)`` and
  ``<layer>._packed_params.dtype`` = a dtype (``LinearPackedParams._save_to_state_dict``);
* nested: ``_rebuild_nested_tensor(buffer, sizes, strides, storage_offsets)`` (``torch.strided`` nested layout) and
  ``_rebuild_from_type_v2(_rebuild_njt, NestedTensor, ...)`` (``torch.jagged``);
* others without a storage of their own in the file: ``_rebuild_wrapper_subclass`` (tensor subclasses such as
  DTensor), ``_rebuild_meta_tensor_no_storage``, ``_rebuild_device_tensor_from_numpy`` /
  ``_from_cpu_tensor``, tensor subclasses whose rebuild function is not a storage rebuilder.

The storage-backed parts (indices, values, the quantized integers) are ordinary tensor nodes, so ``inspect``,
``remap``, the renaming commands and ``verify`` (which rewrite or load the pickle as it is) keep them bit for bit;
only writers that hold plain strided tensors (safetensors, ``convert``'s torch writer) refuse them, with
:func:`refusal`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptool.formats.dtypes import DTYPE_SIZES
from ckptool.formats.nodes import REBUILD_FROM_TYPE_V2, REBUILD_QTENSOR, GlobalMeta, ReduceNode, TensorNode
from ckptool.model.graph import breadth_first, is_module, is_tensor, join, mapping_items, unwrap_tensor

__all__ = ["NonStrided", "find_non_strided", "non_strided", "refusal"]

_SPARSE_NAMES = {"sparse_coo": "COO", "sparse_csr": "CSR", "sparse_csc": "CSC", "sparse_bsr": "BSR",
                 "sparse_bsc": "BSC"}


@dataclass(frozen=True)
class NonStrided:
    """What a non-strided tensor is: ``kind`` (``sparse``, ``quantized``, ``packed_params``, ``nested``,
    ``no_storage``), ``layout`` (``torch.sparse_csr``, ``per_channel_affine qint8``, ``torch.jagged``...), ``what``
    (a phrase for messages) and ``fix``: how to turn it into plain tensors before saving."""

    kind: str
    layout: str
    what: str
    fix: str


def _layout_name(node: Any) -> str:
    """``torch.sparse_csr`` from ``_get_layout('torch.sparse_csr')`` or the GLOBAL ``torch.sparse_coo``."""
    if isinstance(node, GlobalMeta):
        return f"{node.module}.{node.name}"
    if isinstance(node, ReduceNode) and node.args and isinstance(node.args[0], str):
        return node.args[0]
    return "an unknown layout"


def _qscheme(t: TensorNode) -> str:
    params = t.rebuild_args[4] if len(t.rebuild_args) > 4 else None
    scheme = params[0] if isinstance(params, tuple) and params else None
    name = scheme.name if isinstance(scheme, GlobalMeta) else "unknown scheme"
    ref = t.storage
    dtype = ref.storage_type_name.replace("Storage", "").lower() if ref is not None else "?"
    return f"{name} {dtype}"


def non_strided(v: Any, key: str = "") -> NonStrided | None:
    """What node ``v`` (the value of ``key``) is when it is a tensor but not a plain strided one, else None (plain
    tensors, parameters over them and non-tensor values)."""
    t = unwrap_tensor(v)
    if t is not None:
        if t.rebuild_name == REBUILD_QTENSOR:
            scheme = _qscheme(t)
            return NonStrided("quantized", scheme, f"a quantized tensor ({scheme})",
                              "save t.dequantize() (float values) instead")
        return None
    if isinstance(v, tuple) and key.endswith("_packed_params") and any(
            (u := unwrap_tensor(x)) is not None and u.rebuild_name == REBUILD_QTENSOR for x in v):
        return NonStrided("packed_params", "packed (weight, bias)",
                          "the packed (quantized weight, bias) of a dynamically quantized layer "
                          "(torch.ao.quantization.quantize_dynamic)",
                          "save the float model's state_dict before quantizing it, or load this one into the "
                          "quantized model with load_state_dict")
    if not isinstance(v, ReduceNode) or not isinstance(v.func, GlobalMeta):
        return None
    mod, name = v.func.module, v.func.name
    if (mod, name) == ("torch._utils", "_rebuild_sparse_tensor"):
        layout = _layout_name(v.args[0] if v.args else None)
        short = _SPARSE_NAMES.get(layout.rsplit(".", 1)[-1], layout)
        return NonStrided("sparse", layout, f"a sparse {short} tensor (layout {layout})",
                          "save t.to_dense() instead")
    if (mod, name) == ("torch._utils", "_rebuild_nested_tensor"):
        return NonStrided("nested", "torch.strided (nested)", "a nested tensor (torch.nested, strided layout)",
                          "save its components (t.unbind()) or t.to_padded_tensor(0) instead")
    if (mod, name) == REBUILD_FROM_TYPE_V2:
        cls = v.args[1] if len(v.args) > 1 else None
        cname = f"{cls.module}.{cls.name}" if isinstance(cls, GlobalMeta) else "a tensor subclass"
        if cname.endswith("NestedTensor"):
            return NonStrided("nested", "torch.jagged", "a nested jagged tensor (torch.nested, layout torch.jagged)",
                              "save t.values() and t.offsets() instead")
        return NonStrided("no_storage", cname, f"a tensor subclass ({cname}) rebuilt by its own code",
                          "save plain tensors (t.as_subclass(torch.Tensor) or the subclass's own inner tensors)")
    if mod == "torch._utils" and name.startswith("_rebuild_") and name not in ("_rebuild_parameter",
                                                                                "_rebuild_parameter_with_state"):
        return NonStrided("no_storage", name, f"a tensor without a storage in the file (torch._utils.{name})",
                          "save it as a plain CPU tensor (t.detach().cpu() or t.full_tensor() for a DTensor)")
    return None


def _is_dtype(v: Any) -> bool:
    return isinstance(v, GlobalMeta) and v.module == "torch" and v.name in DTYPE_SIZES


def iter_non_strided(items: list[tuple[Any, Any]], prefix: str = "") -> Iterator[tuple[str, NonStrided]]:
    """``(dotted key, what)`` of each non-strided tensor among a mapping's ``items`` (one level)."""
    for k, v in items:
        if isinstance(k, str):
            found = non_strided(v, k)
            if found is not None:
                yield join(prefix, k), found


def find_non_strided(root: Any) -> list[tuple[str, NonStrided]]:
    """The non-strided tensors of the mappings of ``root`` that would be state_dicts if such tensors counted as
    tensors (string keys, tensor values, and a dynamically quantized layer's packed-params ``dtype`` entries), as
    ``(dotted key, what)``, outermost mapping first. Empty when there are none."""
    def tensor_like(v: Any) -> bool:
        return is_tensor(v) or non_strided(v, "_packed_params") is not None or _is_dtype(v)

    out: list[tuple[str, NonStrided]] = []
    for sd in breadth_first(root, items=mapping_items, tensor_test=tensor_like, is_module=is_module, max_depth=None):
        items = mapping_items(sd.obj)
        if items is not None:
            out += iter_non_strided(items, sd.path)
    return out


def refusal(where: str, key: str, found: NonStrided, why: str, route: str) -> str:
    """The one-line refusal: ``where`` (the file), the tensor ``key``, what it is, ``why`` the command cannot
    write it (``"safetensors holds plain strided tensors only"``), the fix, and ``route``: what works instead."""
    return f"{where}: {key!r} is {found.what}; {why}. To convert it, {found.fix}; {route}"
