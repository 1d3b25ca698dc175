"""The state_dict of a pickled ``nn.Module``, computed from the node graph without importing its class.

``nn.Module.state_dict()`` (torch/nn/modules/module.py ``_save_to_state_dict``) gives each module's parameters and
persistent buffers, prefixed by the module path, detached (``requires_grad=False``), and a ``_metadata`` attribute
holding each module's ``_version``. :func:`module_state_dict` reproduces that from a pickled module tree
(:func:`ckptool.model.graph.walk_module`); :func:`state_dict_node` builds the ``OrderedDict`` node torch pickles.
Used by ``extract-state-dict`` and by ``sanitize`` (a full-model pickle becomes its state_dict).
"""

from __future__ import annotations

from typing import Any

from ckptool.errors import UnsupportedError
from ckptool.formats.nodes import REBUILD_FROM_TYPE_V2, REBUILD_QTENSOR, TensorNode
from ckptool.model.graph import (
    class_name,
    compiled_inner,
    mapping_items,
    module_state,
    ordered_dict_node,
    unwrap_tensor,
    walk_module,
)
from ckptool.model.nonstrided import non_strided

__all__ = ["detached", "module_state_dict", "module_versions", "state_dict_node"]

#: ``_version`` of torch module classes whose version is not nn.Module's 1 (torch 2.13,
#: ``{c: c._version for c in nn.Module subclasses if c._version != 1}``, norm layers only)
_VERSIONS: dict[str, int] = {
    f"torch.nn.modules.{mod}.{cls}": 2
    for mod, classes in {
        "batchnorm": ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "_BatchNorm", "_NormBase"),
        "instancenorm": ("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "_InstanceNorm"),
    }.items()
    for cls in classes
}
#: torch classes whose state_dict is not nn.Module's default (custom ``_save_to_state_dict`` or ``state_dict``)
_CUSTOM_PREFIXES = ("torch.ao.", "torch.nn.quantized.", "torch.nn.intrinsic.", "torch.nn.qat.",
                    "torch.distributed.", "torch.quantization.")


def module_versions() -> dict[str, int]:
    """The ``_version`` table used for ``_metadata`` (class ``module.qualname`` -> version; others are 1)."""
    return dict(_VERSIONS)



def module_state_dict(module: Any) -> tuple[list[tuple[str, TensorNode]], dict[str, int]]:
    """The ``(key, tensor)`` entries and ``_metadata`` versions ``{module path: version}`` of ``module.state_dict()``
    for a pickled module tree (:func:`ckptool.model.graph.walk_module`).

    Raises:
        UnsupportedError: a submodule that is not a pickled ``nn.Module``, a class whose state_dict torch computes
            with its own code (quantized, lazy), state_dict hooks, a parameter or buffer that is not a
            storage-backed tensor.
        CorruptCheckpointError: a module that contains itself, a tree too deep or too large.
    """
    entries: list[tuple[str, TensorNode]] = []
    meta: dict[str, int] = {}
    classes: dict[str, str] = {}
    for key, value, kind in walk_module(module):
        if kind != "module":
            t = unwrap_tensor(value)
            if t is None or t.storage is None:
                owner = classes[key.rpartition(".")[0]]
                found = non_strided(value, key)
                what = found.what if found else f"not a storage-backed tensor ({value!r})"
                fix = f" ({found.fix.replace('save ', 'store ', 1)} in the model and save it again)" if found else ""
                raise UnsupportedError(
                    f"{kind} {key} of {owner} is {what}: extract-state-dict rebuilds storage-backed strided tensors "
                    f"only{fix}; or extract with --trust, which runs the file's code")
            entries.append((key, t))
            continue
        where = key or "(top level)"
        if compiled_inner(value) is not None:  # torch.compile's OptimizedModule: an nn.Module holding _orig_mod
            meta.setdefault(key, 1)
            continue
        st = module_state(value)
        if st is None:
            raise UnsupportedError(f"submodule {where} is not a pickled nn.Module ({class_name(value)}); extract it "
                                   "with --trust")
        cls = classes[key] = class_name(value)
        if cls.startswith(_CUSTOM_PREFIXES) or (cls.startswith("torch.nn.modules.") and ".Lazy" in cls):
            raise UnsupportedError(
                f"module {where} is a {cls}, whose state_dict torch computes with its own code; extract with --trust "
                "(runs the file's code) or load the model and call state_dict()")
        for hooks in ("_state_dict_hooks", "_state_dict_pre_hooks"):
            if mapping_items(st.get(hooks)):
                raise UnsupportedError(
                    f"module {where} ({cls}) has state_dict hooks, which change what state_dict() returns; extract "
                    "with --trust (runs the file's code)")
        meta.setdefault(key, _VERSIONS.get(cls, 1))
    return entries, meta



def detached(t: TensorNode) -> TensorNode:
    """The tensor as ``state_dict()`` holds it: ``param.detach()``, so ``requires_grad=False``."""
    if not t.requires_grad:
        return t
    args = list(t.args)
    if (t.func.module, t.func.name) == REBUILD_FROM_TYPE_V2:
        inner = list(args[2])
        inner[5 if t.rebuild_name == REBUILD_QTENSOR else 4] = False
        args[2] = tuple(inner)
    else:
        args[5 if t.rebuild_name == REBUILD_QTENSOR else 4] = False
    return TensorNode(t.func, tuple(args))



def state_dict_node(items: list[tuple[str, Any]], meta: dict[str, int]) -> Any:
    """``OrderedDict`` node with the items and a ``_metadata`` attribute, as torch pickles a state_dict."""
    sd = ordered_dict_node(items)
    sd.state = {"_metadata": ordered_dict_node((k, {"version": v}) for k, v in meta.items())}
    sd.order = ["setitems", "build"]
    return sd


