"""Reading safetensors files and sharded sets for ``convert``: byte ranges from the headers, sharing restored.

A safetensors file written by ckptool records the storages its tensors shared under ``__metadata__``
(:data:`~ckptool.formats.safetensors.SHARED_KEY`); those groups become one storage again, with every member (the
aliases included) a view of it. A name dropped by ``safetensors.torch.save_model`` alone (``__metadata__[alias] =
kept``, no ckptool record) stays a metadata item: ``load_into`` / ``verify`` restore it, ``convert`` carries it. A
sharded set is read through its ``*.index.json``, shard by shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats import detect as formats
from ckptool.formats.dtypes import ST_NAMES, ST_READ_ONLY, contiguous_stride, element_size, numel
from ckptool.formats.safetensors import SHARED_KEY, SharedGroup, decode_shared, library_aliases, read_header
from ckptool.formats.sharded import read_index
from ckptool.formats.tensors import Piece, Source, Storage, Tensor, is_contiguous
from ckptool.readers.read_torch import torch_source
from ckptool.readers.reader import Reader

if TYPE_CHECKING:
    from ckptool.formats.safetensors import SafetensorsHeader
    from ckptool.formats.sharded import ShardIndex
    from ckptool.readers import Opened


def safetensors_source(path: str) -> Source:
    """Read a safetensors file as a :class:`Source`: one storage per stored tensor, and for the sharing groups
    recorded under :data:`SHARED_KEY` one storage per group with every member (aliases included) a view of it.

    Raises:
        UnsupportedError: a dtype code ckptool cannot convert (``F4``...).
        CorruptCheckpointError: a malformed header, an entry whose byte size does not match its shape, or an
            inconsistent sharing record.
    """
    header = read_header(path)
    meta = header.metadata
    src = Source(path, formats.SAFETENSORS, [], key=None, metadata=meta)
    by_name: dict[str, Tensor] = {}
    for i, (name, e) in enumerate(header.entries.items()):
        code = e["dtype"]
        dtype = ST_NAMES.get(code) if code not in ST_READ_ONLY else None
        if dtype is None:
            raise UnsupportedError(f"{path}: tensor {name!r} has safetensors dtype {code!r}, which ckptool "
                                   "cannot convert")
        shape = tuple(e["shape"])
        b, end = e["data_offsets"]
        need = numel(shape) * element_size(dtype)
        if end - b != need:
            raise CorruptCheckpointError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) needs {need} bytes but its "
                                         f"data_offsets span {end - b}; the file is damaged")
        st = Storage(path, header.data_start + b, end - b, dtype, "cpu")
        t = Tensor(name, name, dtype, shape, contiguous_stride(shape), 0, st, False, i)
        by_name[name] = t
        src.tensors.append(t)
    raw = (meta or {}).get(SHARED_KEY)
    groups = decode_shared(raw, path, header.entries) if raw is not None else []
    members = _restore_groups(src, by_name, groups, path)
    for i, t in enumerate(src.tensors):
        t.index = i
    if meta:  # carried to safetensors output, less what ckptool writes anew there
        src.metadata = {k: v for k, v in meta.items() if k != SHARED_KEY and k not in members}
    return src


def _restore_groups(src: Source, by_name: dict[str, Tensor], groups: list[SharedGroup], path: str) -> set[str]:
    """Rebuild the storages of ``groups`` (:func:`~ckptool.formats.safetensors.decode_shared`) in place: every
    member becomes a view of its group's one storage, the aliases at their places in the state_dict order;
    returns the names of every group member."""
    aliases: list[tuple[int, Tensor]] = []
    names: set[str] = set()
    for g in groups:
        names.update(g.tensors)
        esize = element_size(g.dtype)
        pieces = [Piece(t.storage.offset, t.storage.nbytes, v.offset, v.shape, v.stride)
                  for name, v in g.tensors.items() if (t := by_name.get(name)) is not None]
        p0 = pieces[0]
        if len(pieces) == 1 and p0.offset == 0 and p0.nbytes == g.numel * esize and is_contiguous(p0.shape, p0.stride):
            storage = Storage(path, p0.file_offset, p0.nbytes, g.dtype, "cpu")  # the common case: one stored tensor
        else:
            storage = Storage(path, -1, g.numel * esize, g.dtype, "cpu", pieces=pieces)
        for name, v in g.tensors.items():
            t = by_name.get(name)
            if t is None:
                aliases.append((v.index, Tensor(name, name, g.dtype, v.shape, v.stride, v.offset, storage)))
            else:
                t.shape, t.stride, t.offset, t.storage = v.shape, v.stride, v.offset, storage
    for idx, t in sorted(aliases, key=lambda a: a[0]):  # back at their places in the state_dict order
        src.tensors.insert(min(max(idx, 0), len(src.tensors)), t)
    return names


def index_source(index_path: str) -> Source:
    """Read a sharded set through its ``*.index.json``: every shard's tensors, shard by shard in ``weight_map`` order.

    Raises:
        CorruptCheckpointError: the index is not JSON or has no ``weight_map``; a shard lacks a tensor the index
            assigns to it; a tensor appears in two shards.
        UsageError: a shard file is missing.
        (and what reading each shard raises)
    """
    index = read_index(index_path)
    src = Source(index_path, "sharded", [])
    kinds = set()
    seen: dict[str, str] = {}
    for shard in index.shards:
        p = index.shard_path(shard)
        fmt = formats.detect_format(p)
        sub = safetensors_source(p) if fmt == formats.SAFETENSORS else torch_source(p, fmt, None)
        kinds.add("safetensors" if fmt == formats.SAFETENSORS else "torch")
        names = {t.name for t in sub.tensors}
        missing = [n for n, s in index.weight_map.items() if s == shard and n not in names]
        if missing:
            raise CorruptCheckpointError(f"{index_path} assigns {missing[0]!r} to {shard} but that shard does not hold "
                                         "it; the set is incomplete or mixed from two versions")
        for t in sub.tensors:
            if t.name in seen:
                raise CorruptCheckpointError(f"{index_path}: {t.name!r} is in both {seen[t.name]} and {shard}")
            seen[t.name] = shard
            src.tensors.append(t)
        src.left_out += [f"{shard}: {x}" for x in sub.left_out]
        src.skipped += [f"{shard}: {x}" for x in sub.skipped]
        if src.metadata is None and sub.metadata:
            src.metadata = sub.metadata
    for i, t in enumerate(src.tensors):
        t.index = i
    src.format = set_format_name(kinds)
    return src


def set_format_name(kinds: set[str]) -> str:
    """The registry name (:data:`ckptool.readers.FORMATS`) of a sharded set whose shards are of ``kinds``
    (``"safetensors"`` / ``"torch"``): ``sharded-safetensors`` when every shard is safetensors, else ``sharded-bin``
    (torch shards, or a mix)."""
    return "sharded-safetensors" if kinds == {"safetensors"} else "sharded-bin"


def restore_library_aliases(src: Source) -> list[str]:
    """Give back the names ``safetensors.torch.save_model`` dropped from a safetensors ``src``: each
    ``__metadata__`` record ``alias -> kept name`` (:meth:`ckptool.formats.safetensors.SafetensorsHeader.aliases`,
    where no ckptool sharing record already restored it) becomes a tensor sharing the kept tensor's storage, after
    the stored tensors, and its record leaves ``src.metadata``. For torch output, where storages can be shared, so
    that ``model.load_state_dict`` finds both tied names. Returns the names restored.
    """
    by_name = {t.name: t for t in src.tensors}
    restored = []
    for alias, kept in library_aliases(src.metadata, by_name).items():
        t = by_name[kept]
        src.tensors.append(Tensor(alias, alias, t.dtype, t.shape, t.stride, t.offset, t.storage, t.requires_grad,
                                  len(src.tensors)))
        restored.append(alias)
    if restored:
        src.metadata = {k: v for k, v in (src.metadata or {}).items() if k not in restored}
        src.notes.append(f"restored {len(restored)} tied name(s) recorded by safetensors.torch.save_model "
                         f"({', '.join(restored[:5])}) as views of the tensor they share")
    return restored


class SafetensorsReader(Reader):
    """A safetensors file (the registry's ``reader``): one flat mapping listed by name in a JSON header ahead of
    one data block, its ``__metadata__`` strings its values."""

    def __init__(self, opened: Opened) -> None:
        super().__init__(opened)
        self._header: SafetensorsHeader | None = None

    def tensors(self, key: str | None, tag: str | None, exclude_frozen: bool) -> Source:
        """:func:`safetensors_source` of the file (its sharing record restored)."""
        return safetensors_source(self.opened.target)

    def finish(self, src: Source) -> None:
        """The tied names ``safetensors.torch.save_model`` left out, restored as views
        (:func:`restore_library_aliases`)."""
        restore_library_aliases(src)

    def values(self) -> dict[str, object]:
        """The ``__metadata__`` strings."""
        return dict(self.safetensors_header().metadata or {})

    def header(self) -> SafetensorsHeader:
        """The JSON header (:meth:`safetensors_header`): a rewrite renames the tensors there and copies the data
        block."""
        return self.safetensors_header()

    def safetensors_header(self) -> SafetensorsHeader:
        """The JSON header (:func:`ckptool.formats.safetensors.read_header`), read once."""
        if self._header is None:
            self._header = read_header(self.opened.target)
        return self._header


class SetReader(Reader):
    """A sharded set, safetensors or torch shards (the registry's ``reader``): one flat mapping over its shards."""

    def __init__(self, opened: Opened) -> None:
        super().__init__(opened)
        self._index: ShardIndex | None = None

    def tensors(self, key: str | None, tag: str | None, exclude_frozen: bool) -> Source:
        """:func:`index_source` of its index."""
        return index_source(self.opened.target)

    def index(self) -> ShardIndex:
        """The index, every shard it names checked to exist (:func:`ckptool.formats.sharded.read_index`), read
        once."""
        if self._index is None:
            self._index = read_index(self.opened.target)
        return self._index
