"""The plain values of a checkpoint (epoch, step, learning rates, hyper-parameters) by dotted key, without tensors.

A value is a leaf of the node graph that is not a tensor: ``int``, ``float``, ``str``, ``bytes``, ``bool``,
``complex``, ``None``, a numpy scalar (``numpy.float64(0.5)`` as numpy pickles it), or a global named as a value
(``torch.float32``). Keys are the dotted paths :func:`ckptool.model.graph.iter_tensors` gives tensors
(``optimizer.param_groups.0.lr``, ``hyper_parameters.lr``), so a checkpoint's tensors and values share one key
space. A state_dict's ``_metadata`` (per-module version numbers, keyed by module path, which follow the key
prefixes) is not a value: it is kept out.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ckptool.formats.dtypes import STRUCT_FORMATS
from ckptool.formats.nodes import GlobalMeta, ParameterNode, PickledObject, TensorNode
from ckptool.model.graph import ATOMS, depth_first, node_children
from ckptool.model.numpy_nodes import numpy_kind, read_array

#: torch dtype name -> ``struct`` format, to show a numpy scalar's value (the dtypes numpy pickles)

_TENSOR = object()  # leaf marker: a tensor, left out
_METADATA_TRAIL = "._state._metadata"  # where a state_dict's _metadata sits in the walk's paths


def _numpy_value(obj: PickledObject) -> object:
    """A numpy scalar as a Python value (``0.5``); other numpy arrays as ``numpy float32 [2, 3] <hex digest>``."""
    arr = read_array(obj)
    fmt = STRUCT_FORMATS.get(arr.dtype)
    if not arr.shape and fmt is not None:
        value: object = struct.unpack("<" + fmt, arr.data)[0]
        return value
    return f"numpy {arr.dtype} {list(arr.shape)} {arr.data.hex() if len(arr.data) <= 32 else arr.data[:32].hex()}"


def _leaf(obj: object) -> tuple[object] | None:
    t = type(obj)
    if t is TensorNode or t is ParameterNode:
        return (_TENSOR,)
    if isinstance(obj, ATOMS):
        return (obj,)
    if isinstance(obj, GlobalMeta):
        return (obj.qualified_name,)
    if isinstance(obj, PickledObject) and numpy_kind(obj) in ("array", "scalar"):
        try:
            return (_numpy_value(obj),)
        except Exception:  # an odd numpy pickle: walk into it like any other object
            return None
    return None


def iter_values(root: Any, prefix: str = "",
                children: Callable[[str, Any], Iterable[tuple[str, Any]]] = node_children,
                ) -> Iterator[tuple[str, object]]:
    """Yield ``(dotted key, value)`` for every plain value reachable from node graph ``root``, in pickle order
    (see the module docstring for what a value is; tensors and a state_dict's ``_metadata`` are left out), keys
    under ``prefix``; ``children``: the walk's (:func:`ckptool.model.graph.state_children` leaves a pickled
    module's attributes out).

    Raises:
        CorruptCheckpointError: containers nested deeper than :data:`ckptool.model.graph.MAX_DEPTH`.
    """
    for path, (value,) in depth_first(root, prefix, children, _leaf):
        if value is _TENSOR or _METADATA_TRAIL in f".{path}":
            continue
        yield path, value
