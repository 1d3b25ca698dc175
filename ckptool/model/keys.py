"""Key renaming by whole dotted components: the pure-string part of prefix handling.

A state_dict key is a fully qualified name (FQN) such as ``module.encoder.layers.0.weight``; wrappers add
components to it (``nn.DataParallel`` / ``DistributedDataParallel`` add ``module``, ``torch.compile``'s
``OptimizedModule`` adds ``_orig_mod``, FSDP1 ``_fsdp_wrapped_module``, activation checkpointing
``_checkpoint_wrapped_module``). Unlike ``k.replace('module.', '')`` every function here works on whole
components, so ``mlp_module.fc.weight`` is never touched by a ``module.`` prefix (the same rule as torch's
``consume_prefix_in_state_dict_if_present``).

Nothing in this module imports torch; the functions take and return plain strings.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ckptool.errors import CorruptCheckpointError, KeyCollisionError, UsageError

#: the longest key (in characters) ckptool reads from a file (``Opened.state_dict`` / ``state_dicts``) and matches
#: a rename rule, prefix or filter glob against: real keys are short (under 1 KiB); the cap keeps the work on one
#: key bounded whatever a file holds (issue 36)
MAX_KEY_LENGTH = 64 * 1024
#: Components that wrappers add at the front of every key, in the order they are usually found.
WRAPPER_COMPONENTS: tuple[str, ...] = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
#: Components that only wrappers use, so they are removed wherever they stand in a key.
WRAPPER_ONLY_COMPONENTS: tuple[str, ...] = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
#: Attribute names under which a LightningModule or user wrapper commonly holds the real model.
ATTRIBUTE_PREFIXES: tuple[str, ...] = ("model", "net", "network")
#: Names under which training checkpoints commonly keep the model's state_dict, most preferred first
#: (PyTorch tutorials, Lightning, timm, many repositories). EMA copies come last.
STATE_DICT_NAMES: tuple[str, ...] = (
    "state_dict", "model_state_dict", "model", "model_state", "net", "network", "module", "weights", "params",
    "ema", "state_dict_ema", "model_ema", "ema_state_dict", "ema_model",
)
#: Names under which training checkpoints commonly keep the optimizer's state_dict.
OPTIMIZER_NAMES: tuple[str, ...] = (
    "optimizer_state_dict", "optimizer", "optimizer_state", "optim", "opt", "optimizer_states",
)
#: Names under which training checkpoints commonly keep the learning-rate scheduler's state_dict.
SCHEDULER_NAMES: tuple[str, ...] = (
    "scheduler_state_dict", "scheduler", "lr_scheduler", "lr_scheduler_state_dict", "scheduler_state", "sched",
    "lr_schedulers",
)
#: Names under which training checkpoints commonly keep ``GradScaler.state_dict()`` (torch's AMP recipe
#: "scaler", accelerate/timm style "grad_scaler", "scaler_state_dict", Lightning's "native_amp_scaling_state").
SCALER_NAMES: tuple[str, ...] = (
    "scaler", "grad_scaler", "scaler_state_dict", "scaler_state", "native_amp_scaling_state",
)
_FLAT_PARAM_RE = re.compile(r"(^|\.)(_flat_param|flat_param_\d+|_fsdp_flat_param)$")


def normalize_prefix(prefix: str) -> str:
    """Return ``prefix`` as whole components ending in ``.`` (``"module"`` -> ``"module."``).

    Raises:
        UsageError: the prefix is empty, starts with a dot or holds an empty component (``a..b``).
    """
    p = prefix.strip()
    if p and not p.endswith("."):
        p += "."
    if not p or p.startswith(".") or ".." in p:
        raise UsageError(f"invalid prefix {prefix!r}: give whole dotted components such as 'module.' or 'model.'")
    return p


def is_flat_param_key(key: str) -> bool:
    """True for FSDP flat-parameter keys (``_flat_param``, ``flat_param_0``), which cannot be renamed back to FQNs."""
    return bool(_FLAT_PARAM_RE.search(key))


def has_flat_param_key(keys: Iterable[str]) -> bool:
    """True when any of ``keys`` :func:`is_flat_param_key` (one substring search over all of them first: most
    state_dicts hold none)."""
    keys = keys if isinstance(keys, list) else list(keys)
    return "flat_param" in "\n".join(keys) and any(map(is_flat_param_key, keys))


def strip_prefix_key(key: str, prefixes: Iterable[str]) -> str:
    """One key with each of the (normalised) ``prefixes`` removed from its front, in order, at most once each."""
    for p in prefixes:
        if key.startswith(p) and len(key) > len(p):
            key = key[len(p):]
    return key


def unwrap_key(key: str, attribute: str | None = None) -> tuple[str, list[str]]:
    """Remove wrapper components from one key.

    Every component of :data:`WRAPPER_COMPONENTS` is removed from the front, in any stacking order
    (``module._orig_mod.x`` and ``_orig_mod.module.x`` both give ``x``), and the wrapper-only names of
    :data:`WRAPPER_ONLY_COMPONENTS` are removed wherever they stand (``a._checkpoint_wrapped_module.b``
    gives ``a.b``). ``attribute`` (a component such as ``"model"``, as :func:`attribute_prefix` finds it for the
    whole state_dict) is removed too where it follows the leading wrapper components, and wrapper components after
    it. The last component (the parameter or buffer name) is never removed.

    Returns ``(new_key, removed_components)``.
    """
    parts = key.split(".")
    removed: list[str] = []

    def strip_front() -> None:
        while len(parts) > 1 and parts[0] in WRAPPER_COMPONENTS:
            removed.append(parts.pop(0))

    strip_front()
    if attribute is not None and len(parts) > 1 and parts[0] == attribute:
        removed.append(parts.pop(0))
        strip_front()
    kept = [parts[0]] if parts else []
    for comp in parts[1:-1]:
        if comp in WRAPPER_ONLY_COMPONENTS:
            removed.append(comp)
        else:
            kept.append(comp)
    if len(parts) > 1:
        kept.append(parts[-1])
    return ".".join(kept), removed


def attribute_prefix(keys: Iterable[str]) -> str | None:
    """The attribute component (Lightning's ``model``, a user wrapper's ``net``) that :func:`shared_prefixes`
    reports as a wrapper prefix of these keys, without its dot; None when it reports none.

    This is the one rule that makes ``inspect`` and ``unwrap`` agree: what ``inspect`` lists as a wrapper prefix,
    ``unwrap`` removes (:func:`unwrap_keys`).
    """
    prefixes = shared_prefixes(keys)
    if prefixes and prefixes[-1][:-1] not in WRAPPER_COMPONENTS:
        return prefixes[-1][:-1]
    return None


def unwrap_keys(keys: Iterable[str]) -> tuple[dict[str, str], dict[str, int]]:
    """Apply :func:`unwrap_key` to every key of one state_dict, with the attribute prefix that every key shares
    (:func:`attribute_prefix`): every prefix :func:`shared_prefixes` reports is removed.

    Returns ``({old_key: new_key}, {removed_component: number_of_keys_it_was_removed_from})``.
    """
    keys = list(keys)
    attribute = attribute_prefix(keys)
    mapping: dict[str, str] = {}
    counts: dict[str, int] = {}
    for k in keys:
        new, removed = unwrap_key(k, attribute)
        mapping[k] = new
        for comp in dict.fromkeys(removed):
            counts[comp] = counts.get(comp, 0) + 1
    return mapping, counts


def check_collisions(mapping: Mapping[str, str]) -> dict[str, list[str]]:
    """Return ``{new_key: [old_keys...]}`` for every new key that two or more old keys would map to."""
    seen: dict[str, list[str]] = {}
    for old, new in mapping.items():
        seen.setdefault(new, []).append(old)
    return {new: olds for new, olds in seen.items() if len(olds) > 1}


def raise_on_collisions(mapping: Mapping[str, str], where: str = "state_dict") -> None:
    """Raise :class:`KeyCollisionError` listing the colliding keys when ``mapping`` is not one-to-one."""
    coll = check_collisions(mapping)
    if coll:
        lines = [f"{new!r} <- " + ", ".join(repr(o) for o in olds) for new, olds in list(coll.items())[:10]]
        more = f" (and {len(coll) - 10} more)" if len(coll) > 10 else ""
        raise KeyCollisionError(
            f"renaming would merge keys in {where}: " + "; ".join(lines) + more
            + "; nothing was written. Rename with a more specific prefix, or fix the model so its keys are unique",
            coll,
        )


def shared_prefixes(keys: Iterable[str]) -> list[str]:
    """The wrapper prefixes shared by every key, as whole components ending in ``.``.

    Walks the leading components that all keys have in common while each is a wrapper component
    (:data:`WRAPPER_COMPONENTS`), then takes one more shared component if it is a common attribute name
    (:data:`ATTRIBUTE_PREFIXES`, e.g. Lightning's ``model.``). A component is only a prefix while every key keeps
    at least one component after it. ``["module.", "_orig_mod."]`` for a DDP-of-compiled state_dict, ``[]``
    for a bare one. Time: one pass over the keys (their common leading text is that of the first and last in
    sorted order).
    """
    keys = keys if isinstance(keys, list) else list(keys)
    if not keys:
        return []
    lo, hi = min(keys), max(keys)  # the text every key starts with is theirs
    n = 0
    while n < len(lo) and n < len(hi) and lo[n] == hi[n]:
        n += 1
    common = lo[:n]
    out: list[str] = []
    start = 0
    while True:
        # a component followed by "." in the common text: every key has it, and another component after it
        dot = common.find(".", start)
        if dot < 0:
            break
        comp = common[start:dot]
        if comp in WRAPPER_COMPONENTS:
            out.append(comp + ".")
            start = dot + 1
            continue
        if comp in ATTRIBUTE_PREFIXES:
            out.append(comp + ".")
        break
    return out


def suggest_command(prefixes: list[str], *, src: str | None = None, key: str | None = None) -> str | None:
    """The ckptool command that removes ``prefixes`` (as returned by :func:`shared_prefixes`), or None.

    ``["module."]`` gives ``ckptool strip-dataparallel``, wrapper components only (``["module.", "_orig_mod."]``)
    ``ckptool unwrap``, anything else ``ckptool strip-prefix SRC model.`` (the prefixes joined into one). With
    ``src`` (the file) the command names it (quoted for a POSIX shell) instead of leaving it to the reader (or,
    for strip-prefix, the placeholder ``SRC``); with ``key`` (a nested state_dict's dotted path) it adds
    ``--key PATH``.
    """
    if not prefixes:
        return None
    where = shlex.quote(src) if src is not None else None
    extra = f" --key {shlex.quote(key)}" if key else ""
    if prefixes == ["module."]:
        cmd = "ckptool strip-dataparallel" + (f" {where}" if where else "")
    elif all(p[:-1] in WRAPPER_COMPONENTS for p in prefixes):
        cmd = "ckptool unwrap" + (f" {where}" if where else "")
    else:
        cmd = f"ckptool strip-prefix {where or 'SRC'} " + "".join(prefixes)
    return cmd + extra


def _describe(old: str, new: str) -> tuple[str, str]:
    """The (removed, added) dotted parts that turn ``old`` into ``new`` (common leading/trailing parts dropped)."""
    a, b = old.split("."), new.split(".")
    while a and b and a[-1] == b[-1]:
        a.pop()
        b.pop()
    while a and b and a[0] == b[0]:
        a.pop(0)
        b.pop(0)
    return (".".join(a) + "." if a else "", ".".join(b) + "." if b else "")


@dataclass
class Reconciliation:
    """How checkpoint keys map onto model keys (see :func:`reconcile`).

    ``mapping`` holds ``{checkpoint_key: model_key}`` for every checkpoint key (unmatched keys map to themselves);
    ``removed`` / ``added`` are the prefix components taken off or put on (``["module."]``); ``matched`` the
    number of checkpoint keys that name a model key after the mapping.
    """

    mapping: dict[str, str]
    removed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    matched: int = 0

    @property
    def changed(self) -> bool:
        return any(k != v for k, v in self.mapping.items())


def reconcile(checkpoint_keys: Iterable[str], model_keys: Iterable[str]) -> Reconciliation:
    """Find the renaming of ``checkpoint_keys`` that best matches ``model_keys``, in either direction.

    Both sides are brought to a canonical form (wrapper components removed with :func:`unwrap_key`; on the
    checkpoint side also a shared attribute prefix such as Lightning's ``model.``), and each checkpoint key is
    mapped to the model key with the same canonical form. Handles a ``module.`` checkpoint into a bare model, a
    bare checkpoint into a DataParallel or compiled model, compiled-DDP into bare, and a Lightning
    ``model.``-prefixed state_dict into the inner model. The identity is kept unless a renaming matches more keys.

    Returns a :class:`Reconciliation`; never raises for unmatched keys (those are left for ``load_state_dict``
    to report as missing/unexpected).
    """
    ckeys = list(checkpoint_keys)
    mkeys = list(model_keys)
    mset = set(mkeys)
    best = Reconciliation({k: k for k in ckeys}, matched=sum(k in mset for k in ckeys))
    if best.matched == len(ckeys) and len(ckeys) == len(mset):
        return best

    canon_model: dict[str, str] = {}
    for k in mkeys:
        canon_model.setdefault(unwrap_key(k)[0], k)

    # candidate prefixes to drop from the checkpoint before canonicalising: none, then each leading run of shared
    # components (covers `model.` and deeper attribute wrappers)
    for drop in _leading_prefixes(ckeys):
        mapping, matched = _matched_to(ckeys, drop, canon_model)
        if matched > best.matched and not check_collisions(mapping):
            best = Reconciliation(mapping, matched=matched)
    if best.changed:
        best.removed, best.added = _described(best.mapping)
    return best


def _leading_prefixes(keys: list[str]) -> list[str]:
    """``""``, then each leading run of components every key shares (``model.``, ``model.net.``...), while every
    key keeps a component after it."""
    candidates: list[str] = [""]
    split = [k.split(".") for k in keys]
    depth = 0
    while split and all(len(p) > depth + 1 for p in split) and all(p[depth] == split[0][depth] for p in split):
        candidates.append(".".join(split[0][: depth + 1]) + ".")
        depth += 1
    return candidates


def _matched_to(keys: list[str], drop: str, canon_model: dict[str, str]) -> tuple[dict[str, str], int]:
    """Each key mapped to the model key of the same canonical name once ``drop`` is removed from its front (or to
    itself), and how many found one."""
    mapping: dict[str, str] = {}
    matched = 0
    for k in keys:
        base = k[len(drop):] if drop and k.startswith(drop) else k
        target = canon_model.get(unwrap_key(base)[0])
        if target is not None:
            mapping[k] = target
            matched += 1
        else:
            mapping[k] = k
    return mapping, matched


def _described(mapping: dict[str, str]) -> tuple[list[str], list[str]]:
    """The prefixes a mapping removes and adds (:func:`_describe`), each once, in order."""
    removed: dict[str, None] = {}
    added: dict[str, None] = {}
    for old, new in mapping.items():
        if old != new:
            r, a = _describe(old, new)
            if r:
                removed[r] = None
            if a:
                added[a] = None
    return list(removed), list(added)


# ------------------------------------------------------------------------------------------------ _metadata
# A state_dict's ``_metadata`` maps each module path (``""`` the root, ``"module"``, ``"module.fc"``) to that
# module's ``{"version": ...}``; ``load_state_dict`` passes it to each module's ``_load_from_state_dict``. When keys
# are renamed, the paths must follow. One rule does that everywhere (rename, extract, convert, loading):
# :func:`metadata_key_mapping`; :func:`rename_metadata_items` applies it to the entries.
_SENTINEL = "\x00"
_V = TypeVar("_V")


def _probe(path: str, key_fn: Callable[[str], str]) -> str:
    """What ``key_fn`` makes of module ``path``: the module part of the new name of a key directly inside it."""
    new = key_fn((path + "." if path else "") + _SENTINEL)
    if new.endswith(_SENTINEL):
        return new[: -len(_SENTINEL)].rstrip(".")
    return path  # key_fn dropped the probe component: keep the path as it was


def metadata_key_mapping(metadata_keys: Iterable[str], key_fn: Callable[[str], str]) -> dict[str, str]:
    """Rename the module paths of a state_dict's ``_metadata`` consistently with ``key_fn``, the function that
    renames its tensor keys. Returns ``{old_path: new_path}`` for every path of ``metadata_keys``.

    The rule:

    1. A path is renamed as a key directly inside that module would be (``key_fn`` is called on a probe key), so
       stripping ``module.`` turns ``"module"`` into ``""`` and ``"module.fc"`` into ``"fc"``, as torch's
       ``consume_prefix_in_state_dict_if_present`` does.
    2. A path that rule 1 leaves as it is, but that lies strictly inside the components a renamed path lost, goes
       where that renamed path went: stripping ``"_orig_mod.module."`` maps ``"_orig_mod.module"`` to ``""`` and
       so the wrapper level ``"_orig_mod"`` too (the wrapper it names is gone). torch's own function keeps such a
       path, which then names no module.

    When two paths end on one name the caller keeps the later entry (the inner module's, after its wrapper's) in
    the place of the first: :func:`rename_metadata_items`.
    """
    paths = list(metadata_keys)
    out = {m: _probe(m, key_fn) for m in paths}
    collapsed: dict[str, str] = {}
    for old, new in out.items():
        if new == old:
            continue
        a = old.split(".") if old else []
        b = new.split(".") if new else []
        while a and b and a[-1] == b[-1]:
            a.pop()
            b.pop()
        lead = 0
        while lead < min(len(a), len(b)) and a[lead] == b[lead]:
            lead += 1
        for i in range(lead + 1, len(a)):  # the levels strictly inside the lost components
            collapsed.setdefault(".".join(a[:i]), ".".join(b))
    return {m: collapsed.get(m, new) if new == m else new for m, new in out.items()}


def rename_metadata_items(items: Iterable[tuple[Any, _V]], key_fn: Callable[[str], str]) -> list[tuple[Any, _V]]:
    """The ``(module path, value)`` entries of a ``_metadata`` with every path renamed by
    :func:`metadata_key_mapping` (``key_fn`` renames tensor keys); entries whose key is not a string are kept as
    they are, in place.

    When two paths end on one name the later entry (the inner module's, after its wrapper's) wins, in the place
    of the first: what torch's ``consume_prefix_in_state_dict_if_present`` does with ``_metadata[new] =
    _metadata.pop(old)`` for DataParallel's ``""`` and ``"module"``. Values are not copied.
    """
    entries = list(items)
    mapping = metadata_key_mapping([m for m, _v in entries if isinstance(m, str)], key_fn)
    out: list[tuple[Any, _V]] = []
    index: dict[str, int] = {}
    for m, v in entries:
        if not isinstance(m, str):  # not hashed: a hostile key may be a nest of tuples too deep to hash
            out.append((m, v))
            continue
        new = mapping[m]
        if new in index:
            out[index[new]] = (new, v)
        else:
            index[new] = len(out)
            out.append((new, v))
    return out


def mapping_key_function(mapping: Mapping[str, str]) -> Callable[[str], str]:
    """A key renaming function from a plain ``{old_key: new_key}`` mapping (a :class:`Reconciliation`'s), that
    also renames keys the mapping does not hold, such as the probe keys of :func:`metadata_key_mapping`.

    Each mapped key tells where its modules went: the components it shares at its end with its new name are the
    same modules (``module.fc.weight -> fc.weight``: ``module.fc -> fc`` and ``module -> ""``). Renamed keys are
    read first, then unchanged ones; the first key to place a module wins. A key that is not in ``mapping`` is
    moved with its longest module that is placed (``module.relu.x -> relu.x``), else kept. A key whose last
    component changed says nothing about its modules.

    Cost: O(keys * depth**2) to build, O(depth**2) per call.
    """
    modules: dict[str, str] = {}
    for renamed in (True, False):
        for old, new in mapping.items():
            if (old != new) is not renamed:
                continue
            a, b = old.split("."), new.split(".")
            common = 0
            while common < min(len(a), len(b)) and a[-1 - common] == b[-1 - common]:
                common += 1
            for s in range(1, common + 1):
                modules.setdefault(".".join(a[:-s]), ".".join(b[:-s]))

    def key_fn(key: str) -> str:
        if key in mapping:
            return mapping[key]
        parts = key.split(".")
        for i in range(len(parts) - 1, -1, -1):
            module = modules.get(".".join(parts[:i]))
            if module is not None:
                rest = ".".join(parts[i:])
                return f"{module}.{rest}" if module else rest
        return key

    return key_fn


def check_key_lengths(keys: Iterable[str], where: str) -> None:
    """Refuse a key longer than :data:`MAX_KEY_LENGTH` characters (``where``: the file, for the message): the one
    check, run where a reader hands keys on and before any rule or glob is matched against them.

    Raises:
        CorruptCheckpointError: a key over the cap (the message gives its start, its length and the cap).
    """
    for k in keys:
        if len(k) > MAX_KEY_LENGTH:
            raise CorruptCheckpointError(
                f"{where}: the key {k[:60]!r}... is {len(k):,} characters long, over ckptool's cap of "
                f"{MAX_KEY_LENGTH:,} characters for a key (MAX_KEY_LENGTH); the file was crafted or damaged")
