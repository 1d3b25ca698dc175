"""Location tags: the device strings torch writes for each storage (``cpu``, ``cuda:1``) and the rules that
rewrite them.

``torch.save`` records where each storage lived as a location tag, and ``torch.load`` restores it there
(``default_restore_location`` in torch/serialization.py) unless a ``map_location`` says otherwise. These functions
check tags and build the tag rewrite a ``map_location`` would apply, without torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from ckptool.errors import UsageError

__all__ = ["DEVICE_HELP", "LocationFn", "location_function", "parse_device", "parse_mapping"]

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


def location_function(to: str | None = None, mapping: Mapping[str, str] | None = None) -> LocationFn:
    """The tag rewrite for ``to`` (every storage) or ``mapping`` (matching tags only).

    Raises:
        UsageError: neither or both given.
    """
    if (to is None) == (not mapping):
        raise UsageError("give exactly one of --to DEVICE or --map FROM=TO")
    if to is not None:
        target = parse_device(to)
        return lambda loc: target
    m = parse_mapping(mapping or {})

    def fn(loc: str) -> str:
        if loc in m:
            return m[loc]
        return m.get(loc.split(":", 1)[0], loc)

    return fn
