"""Choosing the state_dict to load inside a loaded checkpoint, and matching its keys to a model's.

:func:`select_state_dict` picks the state_dict (a named entry, the top level, or the nested candidate that fits the
model best); :func:`reconciliation` maps its keys to the model's (wrapper prefixes reconciled, kept as saved, or
given prefixes stripped). Used by :func:`ckptool.torch_ops.load.load_into` and the functions built on it.

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ckptool.errors import UnsupportedError, UsageError
from ckptool.model.keys import (
    STATE_DICT_NAMES,
    Reconciliation,
    normalize_prefix,
    raise_on_collisions,
    reconcile,
    strip_prefix_key,
)
from ckptool.model.objects import find_object_state_dicts, is_object_state_dict
from ckptool.model.paths import get_path
from ckptool.torch_ops.devices import is_tensor

if TYPE_CHECKING:  # pragma: no cover
    from typing import TypeAlias

    #: how keys are matched to the model's: ``"auto"`` (reconcile wrapper prefixes), None / False / ``"none"``
    #: (keys as saved), or the prefix (or prefixes, in order) to strip
    PrefixSpec: TypeAlias = str | Sequence[str] | Literal[False] | None

__all__ = ["as_state_dict", "find_state_dicts", "reconciliation", "select_state_dict"]

_MAX_WALK_DEPTH = 6


# ------------------------------------------------------------------------------------------------ state_dicts
def find_state_dicts(obj: object) -> list[tuple[str, Mapping[str, Any]]]:
    """Every state_dict in a loaded checkpoint, outermost first: ``[(dotted_path, state_dict)]``.

    A state_dict is a mapping with string keys and tensor values (``*_extra_state`` entries allowed); an
    ``nn.Module`` (a full-model pickle) counts as its ``state_dict()``. Optimizer state_dicts (``state`` +
    ``param_groups``) are skipped. The walk (:func:`ckptool.model.objects.find_object_state_dicts`: breadth
    first, linear) does not enter a state_dict it found, and stops at depth 6.
    """
    from torch import nn

    refs = find_object_state_dicts(obj, is_tensor, is_module=lambda o: isinstance(o, nn.Module),
                                   max_depth=_MAX_WALK_DEPTH)
    return [(r.path, r.obj.state_dict() if r.is_module else r.obj) for r in refs]


def as_state_dict(obj: object) -> Mapping[str, Any] | None:
    """``obj`` as a state_dict: an ``nn.Module``'s ``state_dict()``, a mapping of names to tensors itself, else None."""
    from torch import nn

    if isinstance(obj, nn.Module):
        return obj.state_dict()
    return obj if isinstance(obj, Mapping) and is_object_state_dict(obj, is_tensor) else None


def select_state_dict(obj: Any, key: str | None, model_keys: list[str] | None = None, *,
                      prefixes: PrefixSpec = "auto", path: str = "checkpoint"
                      ) -> tuple[str, Mapping[str, Any], list[str]]:
    """Choose the state_dict to load from a loaded checkpoint.

    With ``key`` (a dotted path such as ``"state_dict"``, ``"model"``, ``"ema"``; see
    :func:`ckptool.model.paths.get_path`: a key holding dots is matched whole, longest dotted run first) that entry
    is used. Without it, a top-level state_dict (or ``nn.Module``) wins; otherwise the nested candidates
    (:func:`find_state_dicts`) are ranked by how many of their keys match ``model_keys`` (after prefix
    reconciliation when ``prefixes == "auto"``), then by name (:data:`ckptool.model.keys.STATE_DICT_NAMES` order:
    ``state_dict``, ``model_state_dict``, ``model``, ... EMA copies last), then by depth. Returns
    ``(dotted_path, state_dict, every_candidate_path)``.

    Raises:
        UsageError: ``key`` names nothing, or something that is not a state_dict.
        UnsupportedError: the checkpoint holds no state_dict at all.
    """
    found = find_state_dicts(obj)
    paths = [p for p, _ in found]
    listing = ", ".join(p or "(top level)" for p in paths) or "none"
    if key is not None:
        try:
            sub = get_path(obj, key)
        except KeyError:
            raise UsageError(f"{path} has no entry {key!r}; state_dicts found: {listing}") from None
        sd = as_state_dict(sub)
        if sd is None:
            raise UsageError(f"{path}: {key!r} is a {type(sub).__name__}, not a state_dict (a mapping of names to "
                             f"tensors); state_dicts found: {listing}")
        return key, sd, paths
    if not found:
        top = ", ".join(map(str, list(obj)[:10])) if isinstance(obj, Mapping) else type(obj).__name__
        raise UnsupportedError(f"{path} holds no state_dict (a mapping of names to tensors); found: {top}")
    if found[0][0] == "":
        return "", found[0][1], paths
    wanted = set(model_keys or ())  # once, not once per candidate

    def rank(item: tuple[int, tuple[str, Mapping[str, Any]]]) -> tuple[int, int, int, int]:
        i, (p, sd) = item
        last = p.rsplit(".", 1)[-1]
        name_rank = STATE_DICT_NAMES.index(last) if last in STATE_DICT_NAMES else len(STATE_DICT_NAMES)
        matched = 0
        if model_keys is not None:
            keys = list(sd)
            matched = reconcile(keys, model_keys).matched if prefixes == "auto" else len(wanted.intersection(keys))
        return (-matched, name_rank, p.count("."), i)

    _, (best_path, best) = min(enumerate(found), key=rank)
    return best_path, best, paths


# ------------------------------------------------------------------------------------------------ key renaming
def reconciliation(ckeys: list[str], model_keys: list[str], prefixes: PrefixSpec) -> Reconciliation:
    """Checkpoint key -> model key for ``prefixes``: ``"auto"`` (:func:`ckptool.model.keys.reconcile`), None /
    False / ``"none"`` (keys as saved) or the prefixes to strip.

    Raises:
        UsageError: a prefix that is not one.
        KeyCollisionError: stripping would merge two keys.
    """
    if prefixes == "auto":
        return reconcile(ckeys, model_keys)
    wanted = set(model_keys)  # built once: a set per key made this quadratic (20,000 keys: 30 s)
    if prefixes is None or prefixes is False or prefixes == "none":
        return Reconciliation({k: k for k in ckeys}, matched=sum(k in wanted for k in ckeys))
    plist = [prefixes] if isinstance(prefixes, str) else list(prefixes)
    try:
        plist = [normalize_prefix(p) for p in plist]
    except UsageError as e:
        raise UsageError(f"prefixes must be 'auto', None or the prefixes to strip: {e}") from None
    mapping = {k: strip_prefix_key(k, plist) for k in ckeys}
    raise_on_collisions(mapping)
    used = [p for p in plist if any(k.startswith(p) for k in ckeys)]
    return Reconciliation(mapping, removed=used, matched=sum(v in wanted for v in mapping.values()))
