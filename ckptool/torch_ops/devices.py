"""Devices for loading: the default one, a user's device spec checked against this machine, a model's device,
and moving a loaded object's tensors to a device with their sharing kept.

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

from ckptool.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from ckptool.torch_ops.annotations import DeviceLike as DeviceLike  # re-export (its home)

__all__ = [
    "MoveMemo", "default_device", "is_tensor", "map_tensors", "model_device", "move_tensor", "resolve_device",
    "same_device",
]


def default_device() -> torch.device:
    """``cuda:0`` when ``torch.cuda.is_available()``, else ``cpu``."""
    import torch

    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(device: DeviceLike) -> torch.device:
    """Turn ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``torch.device(...)`` or an int (a CUDA index) into a
    ``torch.device`` with an explicit index for CUDA (``"cuda"`` -> the current CUDA device), checking that it
    exists here.

    Raises:
        UsageError: not a device string, or a CUDA / MPS device this machine does not have.
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise UsageError(f"unknown device {device!r}: expected cpu, cuda, cuda:N, mps or another torch device") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {device!s} requested but torch.cuda.is_available() is False on this machine; "
                             "use device='cpu' (--device cpu)")
        idx = torch.cuda.current_device() if dev.index is None else dev.index
        if idx >= torch.cuda.device_count():
            raise UsageError(f"device {device!s} requested but this machine has {torch.cuda.device_count()} CUDA "
                             "device(s); use cuda:0")
        dev = torch.device("cuda", idx)
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UsageError(f"device {device!s} requested but MPS is not available here; use device='cpu'")
    return dev


def is_tensor(obj: object) -> TypeGuard[torch.Tensor]:
    """``isinstance(obj, torch.Tensor)``: the tensor test given to the torch-free walkers of
    :mod:`ckptool.model.objects`."""
    import torch

    return isinstance(obj, torch.Tensor)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter, else of its first buffer, else ``cpu``."""
    import torch

    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` (index None and 0) count as one device; otherwise ``torch.device`` equality."""
    if a.type != b.type:
        return False
    return (a.index or 0) == (b.index or 0)


# ------------------------------------------------------------------------------------------------ moving tensors
@dataclass
class MoveMemo:
    """What one :func:`map_tensors` rebuild has converted so far, so that sharing survives it."""

    #: (device, data_ptr, nbytes) of a source storage -> its copy on the target device
    storages: dict[tuple[str, int, int], torch.UntypedStorage] = field(default_factory=dict)
    #: id(source object) -> the converted object
    objects: dict[int, Any] = field(default_factory=dict)
    #: the sources, so their ids stay unique while converting
    keep: list[Any] = field(default_factory=list)


def move_tensor(t: torch.Tensor, device: torch.device, memo: MoveMemo) -> torch.Tensor:
    """``t`` on ``device`` (``t`` itself when it is there already), keeping storage sharing: each source storage
    is copied once, and every tensor viewing it becomes a view (same offset, size, stride, dtype) of the one copy.
    A ``Parameter`` stays a ``Parameter`` with its ``requires_grad``; other tensors are detached leaves.

    Sparse, quantized, subclassed and meta tensors are moved with ``Tensor.to`` (their storages are not shared)."""
    import torch

    if t.device == device:
        return t
    if (t.layout != torch.strided or t.is_quantized or type(t) not in (torch.Tensor, torch.nn.Parameter)
            or t.device.type == "meta"):
        return t.to(device)
    st = t.untyped_storage()
    sk = (str(st.device), st.data_ptr(), st.nbytes())
    moved = memo.storages.get(sk)
    if moved is None:
        as_bytes = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
        moved = memo.storages[sk] = as_bytes.to(device).untyped_storage()
    with torch.no_grad():
        out = torch.empty(0, dtype=t.dtype, device=device).set_(moved, t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if t.is_leaf else out.detach()


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], memo: MoveMemo,
                special: Callable[[Any], Any] | None = None) -> Any:
    """``obj`` rebuilt with every tensor ``t`` replaced by ``fn(t)``: dicts (an ``OrderedDict`` stays one, other
    dict subclasses become dicts; ``_metadata`` kept), lists and tuples are rebuilt, anything else is kept as is.

    Each object is converted once (``memo``), so an object reached twice (a tied weight, a shared sub-dict) is
    one object in the result too, and a container that holds itself is rebuilt as one that holds itself.
    ``special(o)``, when given, is asked first for every non-tensor ``o``: a result other than None replaces it.
    """
    import torch

    if id(obj) in memo.objects:
        return memo.objects[id(obj)]
    memo.keep.append(obj)
    out: Any
    if isinstance(obj, torch.Tensor):
        out = fn(obj)
    elif special is not None and (replaced := special(obj)) is not None:
        out = replaced
    elif isinstance(obj, dict):
        out = memo.objects[id(obj)] = type(obj)() if type(obj) in (dict, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = map_tensors(v, fn, memo, special)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
    elif isinstance(obj, list):
        out = memo.objects[id(obj)] = []
        out.extend(map_tensors(v, fn, memo, special) for v in obj)
    elif type(obj) is tuple:
        out = tuple(map_tensors(v, fn, memo, special) for v in obj)
    else:
        out = obj
    memo.objects[id(obj)] = out
    return out
