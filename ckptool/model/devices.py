"""Location tags: the device strings torch writes for each storage (``cpu``, ``cuda:1``) and the rules that
rewrite them.

``torch.save`` records where each storage lived as a location tag, and ``torch.load`` restores it there
(``default_restore_location`` in torch/serialization.py) unless a ``map_location`` says otherwise. These functions
check tags and build the tag rewrite a ``map_location`` would apply, without torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from ckptool.errors import DeviceNotFoundError, UsageError

__all__ = [
    "DEVICE_HELP",
    "LocationFn",
    "chosen_tags",
    "location_function",
    "map_location_for",
    "parse_device",
    "parse_mapping",
]

#: ``fn(location_tag) -> location_tag`` applied to every storage persistent id on write
LocationFn = Callable[[str], str]

_DEVICE_RE = re.compile(r"^(cpu|meta|mps|(cuda|xpu|hpu|mtia|npu|xla|privateuseone)(:\d+)?)$")
DEVICE_HELP = "cpu, cuda, cuda:N, mps, meta, xpu:N, hpu:N, mtia:N"





def parse_device(s: str) -> str:
    """Validate a location tag such as ``cpu``, ``cuda:1``, ``mps`` and return it stripped.

    Raises:
        UsageError: not a device string torch writes as a location tag.
    """
    d = s.strip()
    if not _DEVICE_RE.match(d):
        raise UsageError(f"unknown device {s!r}: expected one of {DEVICE_HELP}")
    return d


def parse_mapping(items: Mapping[str, str] | list[str] | tuple[str, ...]) -> dict[str, str]:
    """Turn ``["cuda:1=cuda:0", ...]`` (or a dict) into ``{"cuda:1": "cuda:0"}``, validating each side.

    A bare device type on the left (``cuda``) matches every index of that type (``cuda:0``, ``cuda:3``).

    Raises:
        UsageError: an item without ``=``, or an invalid device on either side.
    """
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        pairs = []
        for it in items:
            if "=" not in it:
                raise UsageError(f"--map expects FROM=TO (e.g. cuda:1=cuda:0), got {it!r}")
            a, b = it.split("=", 1)
            pairs.append((a, b))
    return {parse_device(a): parse_device(b) for a, b in pairs}


def _matches(source: str, tag: str) -> bool:
    """True when mapping source ``source`` applies to location tag ``tag`` (a bare type matches every index)."""
    return tag == source or (":" not in source and tag.split(":", 1)[0] == source)


def location_function(to: str | None = None, mapping: Mapping[str, str] | None = None, *,
                      tags: Iterable[str] | None = None, allow_missing: bool = False,
                      where: str = "checkpoint") -> LocationFn | None:
    """The tag rewrite for ``to`` (every storage) or ``mapping`` (matching tags only); None when neither is given.

    This is the one place ``--to DEVICE`` / ``--map FROM=TO`` become the function every writer applies to each
    storage's location tag in its one streaming pass (the effect of ``torch.load(map_location=...)`` followed by
    ``torch.save``). With ``tags`` (the location tags the checkpoint's storages carry) every mapping source must
    match one of them, unless ``allow_missing``; ``where`` names the checkpoint in that error.

    Raises:
        UsageError: both given, or an invalid device string.
        DeviceNotFoundError: a mapping source matches none of ``tags`` (the tags found are listed); nothing is
            written by the caller.
    """
    if to is not None and mapping:
        raise UsageError("give either --to DEVICE or --map FROM=TO, not both")
    if to is not None:
        target = parse_device(to)
        return lambda loc: target
    if not mapping:
        return None
    m = parse_mapping(mapping)
    if tags is not None and not allow_missing:
        found = sorted(set(tags))
        unmatched = [a for a in m if not any(_matches(a, t) for t in found)]
        if unmatched:
            raise DeviceNotFoundError(
                f"{where}: no storage is tagged {' or '.join(map(repr, unmatched))} (--map); its storages carry "
                f"{', '.join(found) or 'no location tags'}; nothing was written. Check the tags with "
                "`ckptool inspect`, or pass --allow-missing (allow_missing=True) to write the file anyway",
                found,
            )

    def fn(loc: str) -> str:
        if loc in m:
            return m[loc]
        return m.get(loc.split(":", 1)[0], loc)

    return fn


def chosen_tags(to: str | None = None, mapping: Mapping[str, str] | None = None) -> frozenset[str]:
    """The location tags the user asked for with ``to`` / ``mapping`` (the targets), validated."""
    if to is not None:
        return frozenset({parse_device(to)})
    return frozenset(parse_mapping(mapping).values()) if mapping else frozenset()


def map_location_for(tags: Iterable[str], target: str = "cpu") -> str | None:
    """The ``map_location`` argument, as Python source, that opens storages tagged ``tags`` on ``target``, or None
    when none is needed (every tag is ``cpu`` or ``target`` already). ``'cpu'`` for a cpu target; for a GPU target
    the exact dict (``{'cuda:1': 'cuda:0'}``), so cpu-tagged storages (Adam's ``step``) stay on the cpu."""
    others = sorted(t for t in set(tags) if t not in ("cpu", target))
    if not others:
        return None
    return repr(target) if target == "cpu" else repr(dict.fromkeys(others, target))
