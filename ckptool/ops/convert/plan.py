"""Planning ``convert``'s output: tensors grouped by storage (units), what safetensors stores, shards.

safetensors holds no sharing, so each storage is stored once: a tensor that lies inside a stored contiguous
tensor of the same storage becomes an *alias*, recorded in ``__metadata__`` (:func:`shared_metadata`; an exact
alias also as ``alias -> kept name``, by :func:`ckptool.ops.convert.write.write_safetensors`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ckptool.errors import UnsupportedError
from ckptool.formats.dtypes import DTYPE_SIZES, ST_CODES
from ckptool.formats.tensors import Storage, Tensor, is_contiguous
from ckptool.ops.convert.source import out_dtype
from ckptool.writers.encoders import SharedGroup, SharedView, encode_shared


@dataclass(eq=False)
class Unit:
    """The tensors of one source storage, as they go into the output.

    ``stored`` tensors get their bytes written (safetensors); ``aliases`` maps each other tensor to the stored
    contiguous tensor whose bytes it lies in. ``lo`` / ``hi`` bound the elements any member reaches.
    """

    storage: Storage
    members: list[Tensor]
    dtype: str
    stored: list[Tensor] = field(default_factory=list)
    aliases: dict[int, Tensor] = field(default_factory=dict)  # id(alias) -> keeper
    lo: int = 0
    hi: int = 0

    @property
    def first(self) -> int:
        return self.members[0].index

    def stored_bytes(self) -> int:
        return sum(t.numel for t in self.stored) * DTYPE_SIZES[self.dtype]


def units(tensors: list[Tensor], cast: str | None) -> list[Unit]:
    """Group tensors by storage (order of first use) and choose, per storage, what safetensors stores.

    A member is an alias when its elements lie inside a stored contiguous member; contiguous members are tried
    first, longest first, then in state_dict order, so of two tied weights the first in the state_dict is kept.
    """
    by_storage: dict[int, Unit] = {}
    out: list[Unit] = []
    for t in tensors:
        u = by_storage.get(id(t.storage))
        if u is None:
            u = by_storage[id(t.storage)] = Unit(t.storage, [], out_dtype(t.dtype, cast))
            out.append(u)
        u.members.append(t)
    for u in out:
        spans = [t.span for t in u.members if t.numel]
        u.lo = min((s[0] for s in spans), default=0)
        u.hi = max((s[1] for s in spans), default=0)
        if len(u.members) == 1:
            u.stored = list(u.members)
            continue
        keepers: list[Tensor] = []
        order = sorted(u.members, key=lambda t: (not is_contiguous(t.shape, t.stride), -(t.span[1] - t.span[0]),
                                                 t.index))
        for t in order:
            lo, hi = t.span
            keeper = next((k for k in keepers if t.numel and k.span[0] <= lo and hi <= k.span[1]), None)
            if keeper is not None:
                u.aliases[id(t)] = keeper
                continue
            u.stored.append(t)
            if t.numel and is_contiguous(t.shape, t.stride):
                keepers.append(t)
        u.stored.sort(key=lambda t: t.index)
    return out


def union_elements(members: list[Tensor]) -> int:
    """Number of storage elements that at least one of ``members`` reaches."""
    total, end = 0, None
    for lo, hi in sorted(t.span for t in members if t.numel):
        if end is None or lo >= end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def shared_metadata(plan: list[Unit], positions: dict[int, int]) -> str | None:
    """The :data:`~ckptool.formats.safetensors.SHARED_KEY` value (:func:`~ckptool.formats.safetensors.encode_shared`)
    for the units of ``plan`` holding more than one tensor, or None.

    One group per shared storage, trimmed to the elements its tensors reach (``numel``); each member's ``offset`` /
    ``stride`` are in elements of that trimmed storage and ``index`` is its position in the state_dict (``positions``:
    id(tensor) -> position).
    """
    return encode_shared([
        SharedGroup(u.dtype, u.hi - u.lo, {
            t.name: SharedView(positions[id(t)], (t.offset - u.lo) if t.numel else 0, t.shape, t.stride)
            for t in u.members})
        for u in plan if len(u.members) > 1])


def check_safetensors_dtypes(tensors: list[Tensor], cast: str | None, where: str) -> None:
    """Raise :class:`UnsupportedError` naming the tensors whose output dtype safetensors has no code for."""
    bad = [t for t in tensors if out_dtype(t.dtype, cast) not in ST_CODES]
    if bad:
        names = ", ".join(f"{t.name} ({t.dtype})" for t in bad[:5])
        names += f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise UnsupportedError(f"{where}: safetensors has no dtype for {names}; convert with --format torch instead")


def split(plan: list[Unit], limit: int, size: Callable[[Unit], int]) -> list[list[Unit]]:
    """Shards of at most ``limit`` bytes, filled in order (``huggingface_hub.split_state_dict_into_shards``'
    rule); a storage larger than the limit gets a shard of its own; a storage is never split."""
    shards: list[list[Unit]] = [[]]
    used = 0
    for u in plan:
        n = size(u)
        if shards[-1] and used + n > limit:
            shards.append([])
            used = 0
        shards[-1].append(u)
        used += n
    return shards
