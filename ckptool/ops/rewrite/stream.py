"""Stream a checkpoint into a new zip-format file with a rewritten pickle and retagged storages.

This is the one write path behind ``remap`` and the key-renaming commands: the main pickle is written anew from
its node graph (:mod:`ckptool.formats.pickler`), every other record is copied byte for byte. Memory is bounded by the
pickle, not by the tensors.

Zip inputs keep their records, record order and archive folder; only ``data.pkl`` changes. Legacy inputs become
the zip layout ``torch.save`` writes today (``data.pkl``, ``.format_version``, ``.storage_alignment``,
``byteorder``, ``data/<key>``, ``version``, ``.data/serialization_id``), their storage keys kept as record names
and their 6-field persistent ids written as the 5 fields the zip loader expects.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptool import _source as source
from ckptool._fileio import atomic_output, clone_block, copy_range, file_mode, same_file
from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats.nodes import CLASS_BUILD, PickledObject, StorageRef, split_use
from ckptool.model.devices import LocationFn, location_function
from ckptool.model.graph import mapping_items, set_mapping_items
from ckptool.model.rename_plan import RenamePlan, RenameSummary
from ckptool.model.units import plural, retagged_words, wrote_line
from ckptool.readers import FORMATS, Checkpoint, Format
from ckptool.readers.read_torch import locate_records
from ckptool.readers.structures import ENCRYPTED, SafetensorsHeader, recorded_names
from ckptool.writers import is_folder_form, writer
from ckptool.writers.encoders import PicklerError, TorchZipWriter, dumps, encode_header, rename_metadata


@dataclass
class WriteResult:
    """What a rewrite wrote: ``dst`` path, ``bytes_written``, storages re-tagged ``{(old, new): count}``;
    ``kept``: the names of the files of the input's model folder copied beside the output byte for byte
    (``config.json``, tokenizer files: :mod:`ckptool.ops.rewrite.companions`; a folder output only), ``notes``
    for the user (what was not copied)."""

    src: str
    dst: str
    format_in: str
    storages: int = 0
    bytes_written: int = 0
    retagged: dict[tuple[str, str], int] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list, kw_only=True)
    notes: list[str] = field(default_factory=list, kw_only=True)

    def unit(self) -> str:
        """What :attr:`storages` counts, in the singular: the input format's :attr:`~ckptool.readers.Format.counts`
        (``tensor`` for safetensors), else ``storage``."""
        spec = FORMATS.get(self.format_in)
        return spec.counts if spec is not None else "storage"

    def detail(self) -> str:
        """The words of the ``Wrote`` line after the size: ``9 storages`` (:meth:`unit`), a set's shards and notes
        (:class:`~ckptool.ops.rewrite.sets.SetFilesResult`), the re-tagging."""
        shards = getattr(self, "shards", None)  # a set's result: its shard count and notes
        words = [plural(self.storages, self.unit()) + (f" in {plural(shards, 'shard')}" if shards is not None else ""),
                 *self.notes, retagged_words(self.retagged)]
        return "; ".join(w for w in words if w)

    def __str__(self) -> str:
        """The line ``ckptool`` prints for this write: ``Wrote DST (SIZE, DETAIL)`` (:meth:`detail`)."""
        return wrote_line(self.dst, self.bytes_written, self.detail())


def refuse_unwritable(spec: Format, path: str, action: str) -> None:
    """Raise the clear error for formats that have no storages to rewrite (safetensors, TorchScript, pickle): the
    registry entry's ``"rewrite"`` refusal (:meth:`ckptool.readers.Format.refusal_for`).

    Raises:
        UnsupportedError: ``spec`` refuses a rewrite, naming ``path`` and ``action``.
    """
    refusal = spec.refusal_for("rewrite", path, action=action)
    if refusal is not None:
        raise UnsupportedError(refusal)


def retag_function(ck: Checkpoint, to: str | None, mapping: Mapping[str, str] | None, *,
                   allow_missing: bool = False) -> LocationFn | None:
    """The location rewrite of ``--to`` / ``--map`` for checkpoint ``ck``
    (:func:`ckptool.model.devices.location_function`, checked against the tags its storages carry); None when
    neither is given.

    Raises:
        UsageError: both given, or a bad device string.
        DeviceNotFoundError: a ``mapping`` source matches no storage of ``ck``, unless ``allow_missing``.
    """
    return location_function(to, mapping, tags=[r.location for r in ck.storages.values()],
                             allow_missing=allow_missing, where=ck.path)


def output_path(src: str, dst: str | None, in_place: bool, tag: str) -> str:
    """Choose the output path: ``dst``, ``src`` itself for in-place, or ``<stem>.<tag><ext>`` beside ``src``. A
    ``dst`` that names a folder (``out/``, an existing folder, a name without suffix:
    :func:`ckptool.writers.is_folder_form`) gets the file under ``src``'s own name inside it.

    Raises:
        UsageError: both ``dst`` and ``in_place``, or ``dst`` is the input file without ``in_place``.
    """
    if in_place:
        if dst is not None and not same_file(src, dst):
            raise UsageError("give either -o/--output or --in-place, not both")
        return src
    if dst is None:
        stem, ext = os.path.splitext(src)
        dst = f"{stem}.{tag}{ext or '.pt'}"
    elif is_folder_form(dst):
        dst = os.path.join(dst, os.path.basename(src.split("?", 1)[0].rstrip("/")))
    if same_file(src, dst):
        raise UsageError(f"output {dst} is the input file; pass --in-place to overwrite it, or choose another -o path")
    return dst


#: ``progress(nbytes)``: the one progress convention of every operation (remap, the prefix commands, convert,
#: extract-state-dict, sanitize, rename, filter, average): called with the bytes done since the last call
ProgressFn = Callable[[int], None]


def announce_total(progress: ProgressFn | None, total: int) -> None:
    """Tell ``progress`` how many bytes an operation will report, before its first call, when it has a ``total``
    attribute that is still None (``ckptool.cli._common.Progress``; a ``tqdm`` bar's ``update`` has none: give it
    ``total=`` yourself). For operations whose total is not the input's size (``convert`` writes the selected
    state_dict, cast or not)."""
    if progress is not None and getattr(progress, "total", 0) is None:
        progress.total = total  # type: ignore[attr-defined]  # checked just above


def write_zip(ck: Checkpoint, out: Any, root: Any, location_fn: LocationFn | None = None,
              new_records: Sequence[tuple[str, bytes]] = (), progress: ProgressFn | None = None) -> WriteResult:
    """Write ``ck`` with pickle ``root`` into the open binary file ``out`` in torch's zip layout.

    Every storage record is copied unchanged; each storage's location tag becomes ``location_fn(tag)``.
    ``new_records`` (``(name, bytes)``, e.g. ``("data/7", ...)`` for a storage ``root`` adds) are written after
    the copied records. ``progress(nbytes)`` is called as record bytes are copied (by the writer, per chunk).

    Raises:
        UnsupportedError: legacy storage views (``view_metadata``), values the pickle writer cannot express, a BUILD
            on a class (class mutation: the node graph does not hold it, so writing would silently drop it).
        CorruptCheckpointError: a record is shorter than declared.
    """
    mutated = [f"{m}.{split_use(n)[0]}" for m, n in ck.globals if split_use(n)[1] == CLASS_BUILD]
    if mutated:
        raise UnsupportedError(
            f"{ck.path}: the pickle sets attributes on the class {mutated[0]} itself (a BUILD on the class: class "
            f"mutation, dangerous; see `ckptool scan {ck.path}`); ckptool cannot write it back, and leaving it out "
            "would change the file")
    res = WriteResult(ck.path, "", ck.format, storages=len(ck.storages))
    legacy = ck.is_legacy

    def hook(ref: StorageRef) -> tuple[Any, ...]:
        new = location_fn(ref.location) if location_fn else ref.location
        extra = ref.extra
        if legacy:
            if extra and extra[0] is not None:
                raise UnsupportedError(
                    f"{ck.path}: storage {ref.key!r} is a legacy storage view (torch < 0.4); load it with torch "
                    "and re-save it"
                )
            extra = ()
        return (ref.typename, ref.storage_type, ref.key, new, ref.numel, *extra)

    try:
        data_pkl = dumps(root, protocol=ck.protocol, storage_hook=hook)
    except PicklerError as e:
        raise UnsupportedError(f"{ck.path}: cannot write the pickle back ({e})") from e
    res.retagged = retag_counts(ck.storages, location_fn)

    w = TorchZipWriter(out, ck.archive_name, progress=progress)
    with source.open_binary(ck.path) as src:
        if legacy:
            w.begin_torch_save(data_pkl)
            for rec in ck.records:
                w.copy_record(rec.name, src, rec.offset, rec.size)
            for name, data in new_records:
                w.write_bytes(name, data)
            w.end_torch_save()
            res.bytes_written = w.pos
            return res
        else:
            locate_records(ck, src)
            for rec in ck.records:
                if rec.name == "data.pkl":
                    w.write_bytes("data.pkl", data_pkl)
                elif rec.zipinfo is not None and rec.zipinfo.method != 0:
                    # torch never compresses records; a re-packed file might: copy the compressed bytes as they are
                    # (never inflated: a small record may inflate to gigabytes)
                    zi = rec.zipinfo
                    if zi.method != 8 or zi.flags & ENCRYPTED:
                        raise CorruptCheckpointError(f"{ck.path}: record {rec.name!r} uses compression method "
                                                     f"{zi.method} (or is encrypted); torch cannot read it")
                    if rec.offset + zi.compress_size > ck.size:
                        raise CorruptCheckpointError(f"{ck.path}: record {rec.name!r} is truncated; re-download it")
                    w.copy_compressed(rec.name, src, rec.offset, zi.compress_size, zi.file_size, zi.crc)
                else:
                    if rec.offset + rec.size > ck.size:
                        raise CorruptCheckpointError(f"{ck.path}: record {rec.name!r} is truncated; re-download it")
                    w.copy_record(rec.name, src, rec.offset, rec.size, rec.crc)
            for name, data in new_records:
                w.write_bytes(name, data)
    w.close()
    res.bytes_written = w.pos
    return res


def retag_counts(storages: Mapping[str, StorageRef], location_fn: LocationFn | None) -> dict[tuple[str, str], int]:
    """``{(old tag, new tag): storage count}`` of the location tags ``location_fn`` changes among ``storages``
    (each storage once, by key); empty for None."""
    out: dict[tuple[str, str], int] = {}
    if location_fn is None:
        return out
    for ref in storages.values():
        new = location_fn(ref.location)
        if new != ref.location:
            out[(ref.location, new)] = out.get((ref.location, new), 0) + 1
    return out


def rewrite_file(ck: Checkpoint, dst: str, root: Any, location_fn: LocationFn | None = None,
                 new_records: Sequence[tuple[str, bytes]] = (), progress: ProgressFn | None = None) -> WriteResult:
    """Write ``ck`` (with pickle ``root``) to ``dst`` atomically (temporary file, fsync, rename); ``progress`` as in
    :func:`write_zip`.

    When ``dst`` is the input (in-place), the input's permission bits are kept. Raises what :func:`write_zip`
    and :func:`ckptool._fileio.atomic_output` raise.
    """
    mode = file_mode(ck.path) if same_file(ck.path, dst) else None
    with atomic_output(dst, mode=mode) as out:
        res = write_zip(ck, out, root, location_fn, new_records, progress)
    res.dst = dst
    return res


# ------------------------------------------------------------------------------------------------ renaming
@dataclass(kw_only=True)
class RenameResult(WriteResult, RenameSummary):
    """What a prefix command wrote: the :class:`~ckptool.ops.rewrite.stream.WriteResult` fields (``src``, ``dst``,
    ``format_in``, ``storages``, ``bytes_written`` in bytes, ``retagged``) plus ``operation`` and the
    :class:`~ckptool.model.rename_plan.RenameSummary` fields (``state_dicts`` changed, ``unchanged``, ``renamed``
    key count, ``removed`` / ``added`` ``{prefix: keys}``, ``wrappers_removed``, per-state_dict ``changes``)."""

    operation: str = ""

    @classmethod
    def combine(cls, write: WriteResult, summary: RenameSummary, operation: str) -> RenameResult:
        return cls(**vars(write), operation=operation, **vars(summary))


def rename_mapping_node(obj: Any, mapping: dict[str, str], plan: RenamePlan) -> None:
    """Rename the keys of a dict / OrderedDict node in place by ``mapping`` (old -> new; others kept), and the
    module paths of its ``_metadata`` by ``plan`` (bound to the keys, :meth:`RenamePlan.bind`)."""
    items = mapping_items(obj) or []
    set_mapping_items(obj, [(mapping.get(k, k) if isinstance(k, str) else k, v) for k, v in items])
    state = obj.state if isinstance(obj, PickledObject) else None
    if type(state) is dict and "_metadata" in state:
        meta = state["_metadata"]
        meta_items = mapping_items(meta)
        if meta_items:
            set_mapping_items(meta, plan.rename_metadata(meta_items))


def safetensors_keys(src: str, header: SafetensorsHeader) -> list[str]:
    """The tensor names of the safetensors file ``src`` with ``header`` that a renaming renames: the stored entries
    and the names its ``__metadata__`` records without storing them (tied names stored once are keys too).

    Raises:
        CorruptCheckpointError: an inconsistent shared-tensor record.
    """
    return list(header.entries) + recorded_names(header, src)


def write_renamed_safetensors(src: str, out: str, header: SafetensorsHeader, mapping: Mapping[str, str],
                              progress: ProgressFn | None) -> WriteResult:
    """Write ``src`` (a safetensors file whose parsed ``header`` is given) to ``out`` atomically with every tensor
    name renamed by ``mapping`` (old -> new; names it lacks are kept), in the header and in the names its
    ``__metadata__`` records; the data block is copied byte for byte (cloned where the filesystem can).
    ``progress(nbytes)`` gets the data bytes copied.

    Raises:
        OutputError / UsageError: as :func:`ckptool._fileio.atomic_output`.
        CorruptCheckpointError: an inconsistent shared-tensor record.
    """
    entries = {mapping.get(k, k): e for k, e in header.entries.items()}
    metadata = rename_metadata(header, src, mapping)
    with source.open_binary(src) as f:
        mode = file_mode(src) if same_file(out, src) else None
        with atomic_output(out, mode=mode) as o:
            # on a filesystem with reflinks, start the data where the input's does modulo the block: it is cloned
            block = clone_block(f, o) if header.data_start % 8 == 0 and header.data_size > (1 << 20) else 0
            o.write(encode_header(entries, metadata, data_start=(header.data_start, block) if block else (0, 8)))
            copy_range(f, o, header.data_start, header.data_size, block=block)
            if progress is not None:
                progress(header.data_size)
            written = o.tell()
    # a renamed safetensors file is safetensors again: the format in is the format the output reads as
    return WriteResult(src, out, writer("safetensors").reads_as, storages=len(entries), bytes_written=written)
