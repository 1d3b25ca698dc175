"""The torch legacy stream walk of ``ckptool scan`` (:class:`LegacyWalk`, a base class of
:class:`ckptool.scanning.pickles.Scanner`): the five pickles of a file ``torch.save`` wrote before torch 1.6, then
its storage blocks, to find data after them. Nothing is imported or called from the file.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ckptool.errors import CkptError, TruncatedError
from ckptool.formats.dtypes import STORAGE_TYPES
from ckptool.formats.nodes import StorageRef, qualified_name
from ckptool.formats.pickle_check import PickleBuffer
from ckptool.scanning.results import PickleFinding, ScanResult
from ckptool.scanning.tar import inside, join_where

__all__ = ["LegacyWalk", "failed"]


def failed(where: str, offset: int, names: list[str], err: Exception) -> PickleFinding:
    """The finding of a pickle that could not be read to its end because of ``err``: ``truncated`` when the data
    ended first (:class:`~ckptool.errors.TruncatedError`)."""
    return PickleFinding(where, offset, names, str(err), truncated=isinstance(err, TruncatedError))


class LegacyWalk:
    """The legacy stream walk of a scan, a base class of :class:`~ckptool.scanning.pickles.Scanner`, which provides
    the attributes and methods declared here."""

    res: ScanResult
    #: the pickles torch's loader reads (every other one is hidden)
    loaded: set[str]

    if TYPE_CHECKING:  # provided by Scanner
        def load_at(self, buf: PickleBuffer, pos: int, where: str,
                    storages: dict[str, StorageRef] | None) -> tuple[Any, Any, int]: ...
        def record(self, finding: PickleFinding, root: Any = None, uncalled: Collection[str] = ()) -> None: ...
        def note(self, text: str) -> None: ...
        def trailing(self, buf: PickleBuffer, pos: int, where: str, depth: int) -> None: ...
        def globals_before_failure(self, buf: PickleBuffer, pos: int, what: str, e: CkptError) -> list[str]: ...

    def legacy(self, buf: PickleBuffer, where: str, depth: int) -> None:
        """The five pickles of a torch legacy stream (torch/serialization.py ``_legacy_load``), then its storage
        blocks, to find data after them."""
        pos = 0
        main_storages: dict[str, StorageRef] = {}
        keys: object = None
        for i, part in enumerate(("magic number", "protocol version", "sys_info", "main pickle", "storage keys")):
            label = join_where(where, f"legacy {part}")
            if not where:
                self.loaded.add(label)
            try:
                root, up, end = self.load_at(buf, pos, label, main_storages if i == 3 else None)
            except CkptError as e:
                self.record(failed(label, pos, self.globals_before_failure(buf, pos, label, e), e))
                return
            self.record(PickleFinding(label, pos, [qualified_name(m, n) for m, n in up.globals_seen]),
                        root if i == 3 else None, up.uncalled_globals())
            if i == 4:
                keys = root
            pos = end
        # the storage blocks: 8-byte element count + numel * element size bytes each, in key order
        if not isinstance(keys, list):
            self.note("the legacy storage key list is not a list; data after it was not checked")
            return
        for key in keys:
            ref = main_storages.get(str(key)) if isinstance(key, (str, int)) else None
            head = bytes(buf[pos:pos + 8])
            if ref is not None and len(head) != 8:
                self.res.incomplete.append(f"the data ends at byte {len(buf)}{inside(where)}, before the legacy "
                                           f"storage {key}: the file is truncated (torch.load fails on it)")
                return
            if ref is None:
                self.note("the legacy storage blocks do not match the storage keys; data after them was not checked")
                return
            numel = struct.unpack("<q", head)[0]
            elsize = STORAGE_TYPES.get(ref.storage_type_name, ("", 1))[1]
            if numel < 0:
                self.note("a legacy storage block has a negative size; data after it was not checked")
                return
            if pos + 8 + numel * elsize > len(buf):
                self.res.incomplete.append(
                    f"legacy storage {key} needs {numel * elsize} bytes at byte {pos + 8}{inside(where)}, but the "
                    f"data ends at byte {len(buf)}: the file is truncated (torch.load fails on it)")
                return
            pos += 8 + numel * elsize
        if pos < len(buf):
            self.trailing(buf, pos, where, depth)
