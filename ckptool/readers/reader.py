"""The reader of one format: the small core every format implements (Pillow's ``ImageFile`` plug-ins, fsspec's
``AbstractFileSystem``), so that what differs by format is a method of its reader, not a fact a caller tests.

Each registry entry names its reader class (:attr:`ckptool.readers.Format.reader`, imported when a checkpoint of
that format is met); :class:`ckptool.readers.Opened` makes one per checkpoint and delegates to it:

* :meth:`Reader.tensors`: the selected state_dict's tensors as a :class:`~ckptool.formats.tensors.Source`
  (:meth:`Opened.state_dict <ckptool.readers.Opened.state_dict>`);
* :meth:`Reader.finish`: what makes that Source whole for a command that writes its tensors anew
  (:meth:`Opened.source <ckptool.readers.Opened.source>`);
* :meth:`Reader.tree` / :meth:`Reader.state_dicts`: the nesting a dotted key names, and every state_dict with its
  keys;
* :meth:`Reader.values`: the plain non-tensor values (epoch, step, metadata strings);
* :meth:`Reader.header`: the header that lists the tensors by name ahead of one data block (safetensors), which a
  rewrite renames in place of a pickle's node graph;
* the structures of one format, each parsed once and kept by that format's reader, refused by the others:
  :meth:`Reader.safetensors_header`, :meth:`Reader.index` (a sharded set), :meth:`Reader.pt2`, :meth:`Reader.zero`
  (a DeepSpeed folder, per tag), :meth:`Reader.package`, :meth:`Reader.dcp_metadata` (DCP, Megatron's torch_dist).

A format overrides what it has; the defaults are those of a format holding one flat mapping of tensors and nothing
else. The checks every format shares (refusals, ``--key`` on a flat mapping, key lengths) stay in
:class:`~ckptool.readers.Opened`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptool.errors import UnsupportedError
from ckptool.formats.tensors import Source
from ckptool.model.graph import find_state_dicts
from ckptool.model.keys import shared_prefixes

if TYPE_CHECKING:
    from ckptool.formats.dcp import DcpMetadata
    from ckptool.formats.pt2 import Pt2Archive
    from ckptool.formats.safetensors import SafetensorsHeader
    from ckptool.formats.sharded import ShardIndex
    from ckptool.formats.torch_package import Package
    from ckptool.model.zero import ZeroCheckpoint
    from ckptool.readers import Opened

__all__ = ["Reader", "StateDictEntry"]


@dataclass(frozen=True)
class StateDictEntry:
    """A state_dict a checkpoint holds: its dotted ``path`` (``""``: the top level, or the one flat mapping of
    safetensors, sharded sets and DeepSpeed folders), its ``keys``, the wrapper ``prefixes`` every key shares
    (``module.`` of DataParallel / DDP, ``_orig_mod.`` of ``torch.compile``, Lightning's ``model.``:
    :func:`ckptool.model.keys.shared_prefixes`), and whether it is a pickled ``nn.Module``'s (``module``)."""

    path: str
    keys: tuple[str, ...]
    prefixes: tuple[str, ...]
    module: bool = False


class Reader:
    """The reader of one checkpoint ``opened`` (:class:`ckptool.readers.Opened`: its path, format and the structures
    it caches); the base class is a format of one flat mapping of tensors (a subclass gives :meth:`tensors`)."""

    def __init__(self, opened: Opened) -> None:
        self.opened = opened

    def tensors(self, key: str | None, tag: str | None, exclude_frozen: bool) -> Source:
        """The selected state_dict's tensors (no tensor bytes read): ``key`` a dotted path in a keyed format,
        ``tag`` / ``exclude_frozen`` a DeepSpeed folder's tag folder and frozen parameters (checked by
        :class:`~ckptool.readers.Opened` first).

        Raises:
            UnsupportedError: a format whose tensors are not read (the base class).
        """
        raise UnsupportedError(f"a {self.opened.spec.label.strip('`')} has no read behaviour")

    def finish(self, src: Source) -> None:
        """Make ``src`` (read by :meth:`tensors`) whole for a command that writes its tensors anew; nothing for a
        format whose Source is whole as read."""

    def tree(self) -> Any:
        """The nesting in which a dotted ``key`` names a state_dict; None for a format of one flat mapping."""
        return None

    def state_dicts(self) -> list[StateDictEntry]:
        """Every state_dict the checkpoint holds, outermost first: those :func:`ckptool.model.graph.find_state_dicts`
        finds in :meth:`tree` (a pickle, a DCP folder's nesting), else the format's one flat mapping."""
        root = self.tree()
        if root is not None:
            return [StateDictEntry(r.path, tuple(keys), tuple(shared_prefixes(keys)), r.is_module)
                    for r in find_state_dicts(root) for keys in [r.keys()]]
        names = tuple(t.name for t in self.opened.state_dict().tensors)
        return [StateDictEntry("", names, tuple(shared_prefixes(names)))]

    def values(self) -> dict[str, object]:
        """The plain non-tensor values by dotted path; none for a format whose other entries are pickles ckptool
        does not run, or absent."""
        return {}

    def header(self) -> SafetensorsHeader | None:
        """The header that lists the tensors by name ahead of one data block; None for a format without one."""
        return None

    def _not(self, what: str) -> UnsupportedError:
        """The refusal of a structure this format does not have."""
        return UnsupportedError(f"{self.opened.path} is a {self.opened.spec.label.strip('`')}, not {what}")

    def safetensors_header(self) -> SafetensorsHeader:
        """A safetensors file's JSON header, read once. Raises: UnsupportedError: not a safetensors file."""
        raise self._not("a safetensors file")

    def index(self) -> ShardIndex:
        """A sharded set's index, read once. Raises: UnsupportedError: not a sharded set."""
        raise self._not("a sharded set")

    def pt2(self) -> Pt2Archive:
        """A torch.export archive's structure, read once. Raises: UnsupportedError: not one."""
        raise self._not("a torch.export archive")

    def zero(self, tag: str | None) -> ZeroCheckpoint:
        """A DeepSpeed folder's tag folder ``tag``, read once per tag. Raises: UnsupportedError: not one."""
        raise self._not("a DeepSpeed folder")

    def package(self) -> Package:
        """A torch.package archive's pickles, read once. Raises: UnsupportedError: not one."""
        raise self._not("a torch.package archive")

    def dcp_metadata(self) -> DcpMetadata:
        """A DCP folder's ``.metadata``, read once. Raises: UnsupportedError: not a DCP folder."""
        raise self._not("a DCP folder")
