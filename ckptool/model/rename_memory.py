"""Renaming the keys of loaded state_dicts (Python mappings), without mutating them.

The in-memory half of the prefix commands: :func:`rename_state_dict` renames one mapping with any key function,
:func:`rename_mapping` applies a :class:`~ckptool.model.rename_plan.RenamePlan` to every state_dict found in a
loaded checkpoint (or the one at a dotted path). Results are NEW mappings of the input's type holding the same
values (the same tensor objects); ``_metadata`` is renamed consistently (:mod:`ckptool.model.keys`). Tensors are
recognised through ``sys.modules``: torch is never imported here (a mapping can only hold torch tensors once the
caller imported torch).
"""

from __future__ import annotations

import contextlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

from ckptool.errors import UnsupportedError, UsageError
from ckptool.model.keys import raise_on_collisions, rename_metadata_items
from ckptool.model.objects import find_object_state_dicts
from ckptool.model.paths import resolve_path
from ckptool.model.rename_plan import RenamePlan, plan_keys

__all__ = ["copy_meta", "new_like", "rename_mapping", "rename_state_dict", "replace_at"]


def _is_tensor_value(v: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.Tensor)


def new_like(m: Mapping[Any, Any], items: Iterable[tuple[Any, Any]]) -> Any:
    """A new mapping of ``type(m)`` holding ``items`` (a plain dict when that type cannot be built empty)."""
    items = list(items)
    out: Any
    try:
        out = type(m)()
    except TypeError:
        out = {}
    try:
        for k, v in items:
            out[k] = v
    except TypeError:  # read-only mapping types
        out = dict(items)
    return out


def copy_meta(src: object, dst: Any) -> Any:
    """``dst`` carrying the ``_metadata`` of ``src`` (an ``OrderedDict`` state_dict's per-module versions), when
    ``src`` has one and ``dst`` can hold it; ``dst`` itself."""
    meta = getattr(src, "_metadata", None)
    if meta is not None:
        with contextlib.suppress(AttributeError):  # a plain dict cannot carry _metadata
            dst._metadata = meta
    return dst


def replace_at(obj: Any, keys: list[Any], new: object) -> Any:
    """``obj`` with the value at ``keys`` (mapping keys, list / tuple indices) replaced by ``new``; the containers
    along the path are shallow copies."""
    if not keys:
        return new
    head, rest = keys[0], keys[1:]
    if isinstance(obj, Mapping):
        child = replace_at(obj[head], rest, new)
        return copy_meta(obj, new_like(obj, [(k, child if k == head else v) for k, v in obj.items()]))
    items = list(obj)
    items[head] = replace_at(items[head], rest, new)
    return items if isinstance(obj, list) else tuple(items)


def _renamed(sd: Mapping[Any, Any], mapping: Mapping[str, str], key_fn: Callable[[str], str]) -> Any:
    out = new_like(sd, [(mapping.get(k, k) if isinstance(k, str) else k, v) for k, v in sd.items()])
    meta = getattr(sd, "_metadata", None)
    if isinstance(meta, Mapping):
        entries = ((m, dict(v) if isinstance(v, dict) else v) for m, v in meta.items())
        with contextlib.suppress(AttributeError):  # a plain dict cannot carry _metadata
            out._metadata = OrderedDict(rename_metadata_items(entries, key_fn))
    return out


def _selected(obj: Mapping[Any, Any], key: str) -> tuple[list[Any], Mapping[Any, Any]]:
    """``(keys from obj, mapping)`` of the state_dict at dotted ``key`` (:func:`ckptool.model.paths.resolve_path`).

    Raises:
        UsageError: nothing there, a path through something other than mappings, lists and tuples, or an entry that
            is not a mapping.
    """
    try:
        trail = resolve_path(obj, key)
    except KeyError:
        raise UsageError(f"no entry {key!r} (key=) in the given mapping") from None
    if any(not isinstance(link.parent, (Mapping, list, tuple)) for link in trail):
        raise UsageError(f"no entry {key!r} (key=) in the given mapping")
    sd = trail[-1].child if trail else obj
    if not isinstance(sd, Mapping):
        raise UsageError(f"key={key!r} selects a {type(sd).__name__}, not a state_dict")
    return [link.key for link in trail], sd


def rename_mapping(obj: Mapping[Any, Any], plan: RenamePlan, *, key: str | None = None,
                   allow_missing: bool = False) -> Any:
    """Apply ``plan`` to the state_dicts of a loaded checkpoint mapping; returns a new mapping of ``obj``'s type.

    ``key`` (dotted path) selects one mapping; without it every state_dict found
    (:func:`ckptool.model.objects.find_object_state_dicts`, optimizer state never) is renamed where its keys carry
    the prefix. Containers on the way to a renamed state_dict are shallow copies; nothing is mutated.

    Raises:
        UsageError: ``key`` names no entry or one that is not a mapping.
        UnsupportedError: no state_dict found, FSDP flat parameters.
        KeyCollisionError / PrefixNotFoundError: as :func:`ckptool.model.rename_plan.plan_keys`.
    """
    if key is not None:
        targets = [(*_selected(obj, key), key)]
    else:
        found = find_object_state_dicts(obj, _is_tensor_value)
        if not found:
            raise UnsupportedError(
                "no state_dict found in the given mapping (string keys mapped to tensors); pass key=... to "
                "select the mapping to rename"
            )
        targets = [([link.key for link in ref.trail], ref.obj, ref.path) for ref in found]
    keyed = [(path, [k for k in sd if isinstance(k, str)], False) for _keys, sd, path in targets]
    mappings, _summary = plan_keys(keyed, plan, allow_missing=allow_missing, where="state_dict")
    result: Any = obj
    for (keys, sd, _path), mapping in zip(targets, mappings):
        result = replace_at(result, keys, _renamed(sd, mapping, plan.bind(mapping).rename))
    if result is obj:  # nothing selected: still return a new mapping, as promised
        result = copy_meta(obj, new_like(obj, obj.items()))
    return result


#: the state_dict given to :func:`rename_state_dict`: the result has its type
StateDictT = TypeVar("StateDictT", bound=Mapping[Any, Any])


def rename_state_dict(state_dict: StateDictT, key_fn: Callable[[str], str]) -> StateDictT:
    """Return a new state_dict whose keys are ``key_fn(key)``; ``state_dict`` is not mutated.

    ``state_dict`` is any mapping (usually the ``OrderedDict`` from ``model.state_dict()``); the result has the
    same type, the same values (the same tensor objects, in the same order) and, when the input carries
    ``_metadata`` (the per-module versions ``load_state_dict`` passes on), a renamed copy of it
    (:func:`ckptool.model.keys.rename_metadata_items`), so stripping ``module.`` turns ``"module.fc"`` into
    ``"fc"`` as torch's ``consume_prefix_in_state_dict_if_present`` does. Keys that are not strings are kept.

    Raises:
        KeyCollisionError: two keys would get one name (``.collisions`` maps each new key to the old ones).
    """
    mapping = {k: key_fn(k) for k in state_dict if isinstance(k, str)}
    raise_on_collisions(mapping)
    return cast("StateDictT", _renamed(state_dict, mapping, key_fn))
