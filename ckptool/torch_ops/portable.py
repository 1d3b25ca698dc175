"""Save checkpoints that load anywhere: :func:`save_portable` is what training code should call instead of
``torch.save``: wrapper prefixes removed, every storage tagged ``cpu``, nothing ``torch.load(weights_only=True)``
refuses, written atomically.

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

import copy
import os
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckptool._deprecate import renamed_argument
from ckptool._fileio import atomic_output
from ckptool.errors import UnsupportedError
from ckptool.model.graph import join
from ckptool.model.keys import (
    WRAPPER_COMPONENTS,
    WRAPPER_ONLY_COMPONENTS,
    raise_on_collisions,
    rename_metadata_items,
    shared_prefixes,
    strip_prefix_key,
)
from ckptool.model.objects import is_object_state_dict
from ckptool.torch_ops.devices import MoveMemo, is_tensor, map_tensors, move_tensor
from ckptool.torch_ops.loaders import registered_safe_globals

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

__all__ = ["portable_key", "save_portable"]


def _unwrap_module(m: nn.Module) -> nn.Module:
    """Peel ``DataParallel`` / ``DistributedDataParallel`` (``.module``) and ``torch.compile``'s
    ``OptimizedModule`` (``._orig_mod``) off the outside of a module."""
    from torch import nn

    while True:
        inner = getattr(m, "_orig_mod", None)
        if isinstance(m, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            m = m.module
        elif type(m).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
            m = inner
        else:
            return m


def portable_key(key: str, lead: Sequence[str]) -> str:
    """``key`` without the shared leading wrapper prefixes ``lead`` and without wrapper-only components
    (``_orig_mod``, ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``) anywhere before its last component.

    A leading ``module.`` carried by only some keys is kept: it is then an attribute named ``module``, not
    DataParallel.
    """
    key = strip_prefix_key(key, lead)
    parts = key.split(".")
    kept = [c for c in parts[:-1] if c not in WRAPPER_ONLY_COMPONENTS] + parts[-1:]
    return ".".join(kept)


def _portable_state_dict(sd: Mapping[str, Any], memo: MoveMemo) -> dict[str, Any]:
    """``sd`` with portable keys (:func:`portable_key` with the wrapper prefixes every key shares), its values
    through :func:`_portable_value` and its ``_metadata`` renamed alongside (a later entry that lands on an
    earlier one's name wins, in the earlier one's position).

    Raises:
        KeyCollisionError: two keys would become one.
    """
    keys = list(sd)
    lead = [p for p in shared_prefixes(keys) if p[:-1] in WRAPPER_COMPONENTS]
    mapping = {k: portable_key(k, lead) for k in keys}
    raise_on_collisions(mapping)
    out: dict[str, Any] = {} if type(sd) is dict else OrderedDict()
    for k, v in sd.items():
        out[mapping[k]] = _portable_value(v, memo)
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        renamed = rename_metadata_items(meta.items(), lambda k: portable_key(k, lead))
        out._metadata = OrderedDict((m, copy.deepcopy(v)) for m, v in renamed)  # type: ignore[attr-defined]
    return out


def _portable_value(v: Any, memo: MoveMemo) -> Any:
    """``v`` with every tensor on the CPU (storage sharing kept), every ``nn.Module`` replaced by its unwrapped
    module's state_dict and every state_dict made portable (:func:`_portable_state_dict`)."""
    import torch
    from torch import nn

    cpu = torch.device("cpu")

    def special(o: object) -> dict[str, Any] | None:
        if isinstance(o, nn.Module):
            return _portable_state_dict(_unwrap_module(o).state_dict(), memo)
        if isinstance(o, Mapping) and is_object_state_dict(o, is_tensor):
            return _portable_state_dict(o, memo)
        return None

    return map_tensors(v, lambda t: move_tensor(t, cpu, memo), memo, special)


_SAFE_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray)


def _check_weights_only(obj: object) -> None:
    """Raise when ``obj`` holds a value ``torch.load(weights_only=True)`` refuses (an argparse.Namespace, a
    dataclass, a NumPy array, a custom class, a tensor subclass...), naming where it is. Accepted: the types of
    torch's allowlist (:mod:`ckptool.model.allowlist`: dict, OrderedDict, Counter, list, tuple, set, scalars, str,
    bytes, ``torch.Tensor`` / ``Parameter``, ``torch.Size``, ``torch.dtype``, ``torch.device``, layouts) and
    classes registered with ``torch.serialization.add_safe_globals``."""
    import torch

    registered = registered_safe_globals()
    containers = (dict, OrderedDict, Counter, list, tuple, set)
    stack: list[tuple[str, Any]] = [("", obj)]
    seen: set[int] = set()
    while stack:
        w, o = stack.pop()
        if isinstance(o, (*_SAFE_SCALARS, torch.dtype, torch.device, torch.layout)):
            continue
        if type(o) in (torch.Tensor, torch.nn.Parameter, torch.Size):
            continue
        if type(o) in containers:
            if id(o) in seen:
                continue
            seen.add(id(o))
            if isinstance(o, dict):
                stack += [(join(w, f"<key {k!r}>"), k) for k in o] + [(join(w, k), v) for k, v in o.items()]
            else:
                stack += [(join(w, i), v) for i, v in enumerate(o)]
            continue
        name = f"{type(o).__module__}.{type(o).__qualname__}"
        if name in registered:
            continue
        raise UnsupportedError(
            f"save_portable: {w or 'the object'} is a {name}, which torch.load(weights_only=True) refuses; convert "
            "it to plain types first (vars(args), dataclasses.asdict(cfg), tensor.tolist()...) so the file loads "
            "anywhere; nothing was written")


@renamed_argument("path", "dst")
def save_portable(obj: object, dst: str | os.PathLike[str]) -> str:
    """Save ``obj`` to ``dst`` so that a plain ``torch.load(dst, weights_only=True)`` opens it on any machine.

    ``dst`` was called ``path`` in ckptool 0.1; ``path=`` still works with a ``DeprecationWarning`` until 0.3.

    ``obj`` may be an ``nn.Module`` (its ``state_dict()`` is saved, after peeling ``DataParallel`` /
    ``DistributedDataParallel`` / ``torch.compile`` wrappers off it), a state_dict, or a training-checkpoint dict
    (``{"epoch": ..., "model": module_or_state_dict, "optimizer": optimizer.state_dict(), ...}``) whose nested
    modules and state_dicts are converted the same way. In every state_dict, wrapper prefixes shared by all keys
    (``module.``, ``_orig_mod.``...) and wrapper-only components anywhere (``_orig_mod``,
    ``_checkpoint_wrapped_module``...) are removed (``_metadata`` renamed alongside); every tensor is copied to the
    CPU, once per storage so shared storages stay shared, so every storage is tagged ``cpu``; dtypes, shapes and
    strides are kept. The file is written with ``torch.save`` through :func:`ckptool._fileio.atomic_output`
    (temporary file, fsync, rename). Returns the absolute path written.

    Raises:
        UnsupportedError: ``obj`` holds something ``torch.load(weights_only=True)`` refuses (argparse.Namespace,
            custom classes...); nothing is written.
        KeyCollisionError: removing prefixes would merge two keys.
        UsageError / CkptError: the destination folder is missing or the write failed (nothing left behind).
    """
    import torch
    from torch import nn

    memo = MoveMemo()
    if isinstance(obj, nn.Module):
        out = _portable_state_dict(_unwrap_module(obj).state_dict(), memo)
    else:
        out = _portable_value(obj, memo)
    _check_weights_only(out)
    where = os.path.abspath(os.fspath(dst))
    with atomic_output(where) as f:
        torch.save(out, f)
    return where

