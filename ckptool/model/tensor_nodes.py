"""New tensor nodes over new storages, written the way ``torch.save`` writes them (no torch).

A writer that adds tensors to a graph (``ckptool sanitize`` turning numpy arrays into tensors) builds each one here:
``_rebuild_tensor_v2`` over the typed storage class of its dtype (``torch.HalfStorage``...), or, for dtypes without
one (uint16/32/64, float8...), ``_rebuild_tensor_v3`` over ``torch.storage.UntypedStorage`` (``numel`` counted in
bytes) with the dtype global, as torch/_tensor.py ``_reduce_ex_internal`` does. Every global named is in
``torch.load(weights_only=True)``'s allowlist (:data:`ckptool.model.allowlist.WEIGHTS_ONLY_ALLOWED`).
"""

from __future__ import annotations

from ckptool.formats.dtypes import STORAGE_TYPES, element_size, numel
from ckptool.formats.nodes import StorageRef, TensorNode, global_placeholder

__all__ = ["V2_STORAGE", "storage_ref", "tensor_node", "view_node"]

#: dtype name -> legacy storage class ``torch.save`` names with ``_rebuild_tensor_v2`` (torch/storage.py); other
#: dtypes are written as ``_rebuild_tensor_v3`` over an ``UntypedStorage``, as torch does for uint16, float8...
V2_STORAGE = {dt: cls for cls, (dt, _n) in STORAGE_TYPES.items() if not cls.startswith(("Q", "Untyped"))}


def storage_ref(key: str, dtype: str, numel_: int, location: str = "cpu") -> StorageRef:
    """The persistent id of a new storage of ``numel_`` elements of ``dtype``, record ``data/<key>``, tagged
    ``location``: its typed storage class when ``dtype`` has one, else ``UntypedStorage`` counted in bytes.

    Raises:
        UnsupportedError: ``dtype`` is not a torch dtype.
    """
    g = global_placeholder
    cls = V2_STORAGE.get(dtype)
    if cls is not None:
        return StorageRef("storage", g("torch", cls), key, location, numel_, ())
    return StorageRef("storage", g("torch.storage", "UntypedStorage"), key, location, numel_ * element_size(dtype), ())


def view_node(ref: StorageRef, dtype: str, offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
              requires_grad: bool = False) -> TensorNode:
    """A tensor of ``dtype`` over the storage ``ref`` (:func:`storage_ref`) at element ``offset`` with ``shape`` and
    ``stride`` (elements): ``_rebuild_tensor_v2`` for a typed storage, ``_rebuild_tensor_v3`` with the dtype global
    over an ``UntypedStorage``."""
    g = global_placeholder
    hooks = g("collections", "OrderedDict")()
    if dtype in V2_STORAGE:
        node = g("torch._utils", "_rebuild_tensor_v2")(ref, offset, shape, stride, requires_grad, hooks)
    else:
        node = g("torch._utils", "_rebuild_tensor_v3")(ref, offset, shape, stride, requires_grad, hooks,
                                                       g("torch", dtype))
    assert isinstance(node, TensorNode)  # node_type_for: the tensor rebuild functions record TensorNodes
    return node


def tensor_node(key: str, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...], *,
                location: str = "cpu", storage_numel: int | None = None) -> TensorNode:
    """A tensor of ``dtype`` (torch dtype name), ``shape`` and ``stride`` (elements) at offset 0 of a new storage
    whose record is ``data/<key>``, tagged ``location``, without ``requires_grad``.

    ``storage_numel`` is the storage's element count (default ``numel(shape)``: a contiguous tensor, or a
    Fortran-ordered one, fills its storage exactly).

    Raises:
        UnsupportedError: ``dtype`` is not a torch dtype.
    """
    ref = storage_ref(key, dtype, numel(shape) if storage_numel is None else storage_numel, location)
    return view_node(ref, dtype, 0, shape, stride)
