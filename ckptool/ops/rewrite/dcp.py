"""``ckptool.ops.rewrite.dcp``: ``remap`` and the key-renaming commands on a ``torch.distributed.checkpoint`` folder.

A DCP folder (:mod:`ckptool.formats.dcp`) is ``.metadata`` (a pickled ``Metadata``) plus ``__<rank>_<n>.distcp``
data files, each storage record a ``torch.save`` record at ``(offset, length)`` of one of them. The output is a new
DCP folder: ``.metadata`` rewritten from its node graph (:mod:`ckptool.formats.pickler`, nothing imported) and the
``.distcp`` files copied byte for byte (``copy_file_range``, or cloned where the filesystem shares extents; never
hard-linked: the output does not alias the input). Everything is checked before a byte is written; the folder is
written into a staging folder beside the destination (one data file per task with ``--jobs N``:
:mod:`ckptool.ops.rewrite.parallel`) and renamed into place once complete and read back (:func:`rewrite_dcp`); a
failed run leaves nothing. ``storage_meta`` (the folder the checkpoint was saved to, its save id) is kept as
written; files of the folder that no record names are not copied (the result notes them), but for those of a
Megatron-Core torch_dist folder (copied; its cached plans renamed: :mod:`ckptool.ops.rewrite.layouts`).

**Renaming.** DCP saves a nested state (``dcp.save({"model": model.state_dict(), "optim": ...})``) flattened: each
leaf's fully qualified name (FQN) is its path joined with dots (``model.fc.weight``) and ``planner_data`` records
the path (``("model", "fc.weight")``; torch/distributed/checkpoint/_nested_dict.py ``flatten_state_dict``). The
renaming applies to the state_dicts of that nesting exactly as the file commands apply to the file
``dcp_to_torch_save`` writes of the folder: the nesting is rebuilt as a node graph (one placeholder per entry) and
renamed by the caller's ``rename`` (:func:`ckptool.ops.rewrite.prefixes.rename_graph`, the one planner: the same
state_dicts found, optimizer state left alone, ``--key``, :class:`~ckptool.errors.PrefixNotFoundError`,
:class:`~ckptool.errors.KeyCollisionError`); each entry's new path gives its new FQN (``".".join``, as DCP
flattens) and ``planner_data`` path. So ``strip-dataparallel`` turns ``model.module.fc.weight`` (``{"model":
ddp.state_dict()}``) into ``model.fc.weight``, and a folder saved from a bare state_dict
(``dcp.save(ddp.state_dict())``, FQNs ``module.fc.weight``) is one flat state_dict. The FQN is renamed in the keys of
``state_dict_metadata``, in the ``fqn`` of every ``MetadataIndex`` of ``storage_data`` and in ``planner_data``.

**Dropping entries** (``ckptool filter``): the caller's ``drop`` returns the nesting without the entries to drop
(or, for ``--key``, the state_dict it selects: the entries outside it go and the rest are named from it, as the
file command writes that state_dict alone). The dropped entries leave ``state_dict_metadata``, ``storage_data``
and ``planner_data``; their records' bytes leave the data files (a file holding one is laid out anew around the
records kept, their offsets updated; a file left with no record is not written).

**Remap.** DCP moves every tensor chunk to CPU before ``torch.save`` writes it (``_SerialCpuLoader`` /
``_OverlappingCpuLoader``: ``tensor.cpu()``; ``_write_item`` asserts "Tensor must be on CPU device") and reads it
back with ``torch.load(map_location="cpu", weights_only=True)`` (``FileSystemReader.read_data``): its tag never
matters. A non-tensor entry (``BYTE_IO``: a value DCP does not traverse, such as a tuple of tensors or an object
holding tensors) is ``torch.save(value)`` as it is (``DefaultSavePlanner.transform_object``), GPU tags included, and
is read back with ``torch.load(weights_only=False)`` and no ``map_location`` (``DefaultLoadPlanner.load_bytes``): on
a machine without that GPU, ``dcp.load`` and ``dcp_to_torch_save`` fail ("Attempting to deserialize object on a
CUDA device"). ``remap`` therefore rewrites the location tags inside those records (each rewritten by
:func:`ckptool.ops.rewrite.stream.write_zip`, its tensor bytes copied), re-lays out the ``.distcp`` files that hold one
and updates the records' offsets and lengths in ``.metadata``. A remap that would change no tag is refused
("nothing to remap"); with a renaming in the same pass it is written, saying so.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from ckptool._commit import mark_committed, signals_blocked
from ckptool._fileio import clone_block, copy_range, current_umask, temp_path
from ckptool.errors import (
    CkptError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedError,
    UsageError,
    VerificationError,
)
from ckptool.formats.nodes import PickledObject
from ckptool.model.devices import LocationFn, location_function
from ckptool.ops.rewrite.dcp_nesting import Dropper, Renamer, drop_entries, rename_entries
from ckptool.ops.rewrite.layouts import companions_note, copy_companions, follow_names
from ckptool.ops.rewrite.parallel import current_executor, locked, run_each
from ckptool.ops.rewrite.sets import SetRenameResult, SetWriteResult
from ckptool.ops.rewrite.stream import ProgressFn, write_zip
from ckptool.readers import Checkpoint, Opened, open_checkpoint
from ckptool.readers.read_torch import torch_save_graph
from ckptool.readers.structures import METADATA_FILE, DcpLayout, DcpMetadata
from ckptool.scanning.dcp_safety import is_dcp_allowed
from ckptool.writers.encoders import PicklerError, dumps

__all__ = ["rewrite_dcp"]

_NOTHING = ("{src} is a torch.distributed.checkpoint folder. DCP folders store every tensor chunk from CPU (and "
            "torch reads them back with map_location='cpu'), "
            "and {what}: nothing to remap. dcp.load places tensors where the state_dict you pass lives (move the "
            "model first: model.to(device), then torch.distributed.checkpoint.load(model.state_dict(), "
            "checkpoint_id=...)); for one torch file: ckptool convert {src} -o model.pt")


def _check_target(folder: str, dst: str) -> None:
    """Refuse an output that is not a new or empty folder in an existing folder, or that is the input.

    Raises:
        UsageError: as said."""
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise UsageError(f"{dst} already exists and is not an empty folder; a DCP checkpoint is written into a new "
                         "(or empty) folder: choose another -o path")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise UsageError(f"output folder {parent} does not exist; create it first or choose another -o path")
    real = os.path.realpath(dst)
    if real == os.path.realpath(folder) or real.startswith(os.path.realpath(folder) + os.sep):
        raise UsageError(f"output {dst} is inside the input folder {folder}; choose an -o path outside it")


@dataclass
class _Record:
    """One record of ``storage_data``: its ``MetadataIndex`` and ``_StorageInfo`` state dicts, where its bytes are,
    and, once a remap rewrote it, the scratch file holding its new bytes."""

    index: dict[str, Any]
    info: dict[str, Any]
    fqn: str
    is_bytes: bool
    rel: str
    offset: int
    length: int
    transformed: bool
    new_path: str | None = None
    new_length: int = 0
    dropped: bool = False


def _records(meta: DcpMetadata) -> tuple[list[_Record], dict[str, int]]:
    """The records of ``storage_data`` (pickle order) and the size of each ``.distcp`` file they name.

    Raises:
        CorruptCheckpointError: a malformed record, one outside the folder or past its file's end, two records
            sharing one ``MetadataIndex`` or ``_StorageInfo`` object."""
    st = meta.root.state
    storage_data = st.get("storage_data") if type(st) is dict else None
    items = meta.items()  # raises when storage_data is not a dict
    assert isinstance(storage_data, dict)
    out: list[_Record] = []
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for (idx, info), it in zip(storage_data.items(), items):
        ist = idx.state if isinstance(idx, PickledObject) else None
        sst = info.state if isinstance(info, PickledObject) else None
        rel = it.relative_path
        if type(ist) is not dict or type(sst) is not dict or rel is None or type(ist.get("fqn")) is not str:
            raise CorruptCheckpointError(f"{meta.folder}: the record of {it.fqn!r} in .metadata is malformed; the "
                                         "folder is damaged or was not written by torch.distributed.checkpoint")
        if id(ist) in seen or id(sst) in seen:
            raise CorruptCheckpointError(f"{meta.folder}: two records of .metadata share one object ({it.fqn!r}); "
                                         "torch.distributed.checkpoint never writes that")
        seen.update((id(ist), id(sst)))
        if os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] in ("..", "") or rel == METADATA_FILE:
            raise CorruptCheckpointError(f"{meta.folder}: the record of {it.fqn!r} points at {rel!r}, outside the "
                                         "folder's data files; the .metadata is damaged or was crafted")
        if rel not in sizes:
            path = os.path.join(meta.folder, rel)
            if not os.path.isfile(path):
                raise CorruptCheckpointError(f"{meta.folder}: {rel} is missing (the record of {it.fqn!r} is in "
                                             "it); the folder is incomplete: copy it again")
            sizes[rel] = os.path.getsize(path)
        if it.offset < 0 or it.length < 0 or it.offset + it.length > sizes[rel]:
            raise CorruptCheckpointError(f"{meta.folder}: the record of {it.fqn!r} ends past the end of {rel} "
                                         f"(byte {it.offset + it.length} of {sizes[rel]}); the file is truncated")
        out.append(_Record(ist, sst, it.fqn, it.is_bytes, rel, it.offset, it.length, bool(it.transforms)))
    return out, sizes


def _refuse_safetensors_files(folder: str, sizes: dict[str, int]) -> None:
    """Refuse a folder saved with DCP's safetensors serialization (``FileSystemWriter(serialization_format=
    SerializationFormat.SAFETENSORS)``): each ``.distcp`` file is then a safetensors file whose own header and
    ``DCP_SHARDING_INFO`` name every tensor by its FQN (torch/distributed/checkpoint/filesystem.py
    ``_write_files_from_queue``), which copying the files byte for byte would leave behind.

    Raises:
        UnsupportedError: such a data file.
        CorruptCheckpointError: a data file that is a damaged safetensors file."""
    for rel in sizes:
        try:
            data_file = open_checkpoint(os.path.join(folder, rel))
        except CkptError:
            continue
        if data_file.tensor_header() is not None:
            raise UnsupportedError(
                f"{folder}: its data file {rel} is a safetensors file (DCP's safetensors serialization) whose own "
                "header names every tensor by its FQN; ckptool rewrites .metadata and copies the data files, which "
                "would leave those names behind. Consolidate it with torch.distributed.checkpoint."
                "_consolidate_hf_safetensors.consolidate_safetensors_files(SRC, OUT) and run the command on the "
                "safetensors files it writes")


def _apply_names(meta: DcpMetadata, records: list[_Record], fqns: dict[str, str],
                 paths: dict[str, tuple[Any, ...]]) -> None:
    """Rename the FQNs of ``meta``'s graph in place: the keys of ``state_dict_metadata`` and ``planner_data``, the
    ``fqn`` of every ``MetadataIndex`` (``records``), the paths of ``planner_data``."""
    st = meta.root.state
    sdm = st["state_dict_metadata"]
    renamed = {fqns.get(k, k): v for k, v in sdm.items()}
    sdm.clear()
    sdm.update(renamed)
    for r in records:
        r.index["fqn"] = fqns.get(r.fqn, r.fqn)
    planner = st.get("planner_data")
    if isinstance(planner, dict):
        new = {fqns.get(k, k): tuple(paths[k]) if k in paths else v for k, v in planner.items()}
        planner.clear()
        planner.update(new)
    follow_names(meta, fqns, {r.fqn for r in records if r.dropped}, {id(r.index): r.fqn for r in records})


# ------------------------------------------------------------------------------------------------ remap
def _read_record(folder: str, r: _Record, scratch: str) -> Checkpoint:
    """The ``torch.save`` record ``r`` copied to the file ``scratch`` and read as a checkpoint (nothing run).

    Raises:
        CorruptCheckpointError: the record is not a ``torch.save`` zip, or is damaged.
    """
    with open(os.path.join(folder, r.rel), "rb") as f, open(scratch, "wb") as o:
        copy_range(f, o, r.offset, r.length)
        f.seek(r.offset)
        head = f.read(4)
    what = f"{folder}: the non-tensor entry {r.fqn!r} ({r.length} bytes at byte {r.offset} of {r.rel})"
    if head != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{what} is not a torch.save record (it starts {head.hex(' ') or 'empty'}, "
                                     "not as a zip); the folder is damaged or was not written by "
                                     "torch.distributed.checkpoint")
    try:  # read as torch.save wrote it, whatever else its members could make it look like
        return torch_save_graph(scratch)
    except CkptError as e:  # name the record, not the scratch copy
        raise type(e)(str(e).replace(scratch, what)) from None


def _tagged_records(folder: str, records: list[_Record], scratch: str) -> list[tuple[_Record, Checkpoint]]:
    """The non-tensor records kept (not dropped) that hold storages, each copied into the folder ``scratch`` and read
    (:func:`_read_record`); the copies of the others are removed.

    Raises:
        UnsupportedError: a transformed record (compressed by a DCP extension), whose tags ckptool cannot rewrite.
        CorruptCheckpointError: a record that is not a ``torch.save`` zip.
    """
    read: list[tuple[_Record, Checkpoint]] = []
    for i, r in enumerate(x for x in records if x.is_bytes and not x.dropped):
        if r.transformed:
            raise UnsupportedError(f"{folder}: the non-tensor entry {r.fqn!r} is stored transformed (a DCP "
                                   "storage extension such as compression); ckptool cannot rewrite its tags. Load "
                                   "the folder with torch.distributed.checkpoint and save it again")
        path = os.path.join(scratch, f"in{i}")
        ck = _read_record(folder, r, path)
        if ck.storages:
            read.append((r, ck))
        else:
            os.unlink(path)
    return read


def _write_retagged(read: list[tuple[_Record, Checkpoint]], fn: LocationFn) -> dict[tuple[str, str], int]:
    """Write each record of ``read`` whose storages ``fn`` re-tags anew beside its scratch copy (its ``new_path`` /
    ``new_length``); ``{(old, new): storages}`` re-tagged."""
    counts: dict[tuple[str, str], int] = {}
    for r, ck in read:
        changes = [(ref.location, fn(ref.location)) for ref in ck.storages.values()]
        changes = [(a, b) for a, b in changes if a != b]
        if not changes:
            continue
        for pair in changes:
            counts[pair] = counts.get(pair, 0) + 1
        r.new_path = ck.path + ".out"
        with open(r.new_path, "wb") as o:
            write_zip(ck, o, ck.root, fn)
            r.new_length = o.tell()
    return counts


def _retag(folder: str, records: list[_Record], scratch: str, to: str | None, mapping: Mapping[str, str] | None,
           *, allow_missing: bool, renaming: bool) -> tuple[dict[tuple[str, str], int], int]:
    """Rewrite, into files of the folder ``scratch``, the non-tensor records whose storages ``to`` / ``mapping``
    re-tag (each record's ``new_path`` / ``new_length``). Returns ``({(old, new): storages}, storages read)``.

    Raises:
        UnsupportedError: nothing to remap (no tag would change; with ``renaming``, only when a ``--map`` source
            cannot match because no entry holds a tensor), unless ``allow_missing``; a transformed record
            (compressed by a DCP extension) that a remap would have to read.
        DeviceNotFoundError: a ``mapping`` source matches no tag the non-tensor entries carry.
    """
    read = _tagged_records(folder, records, scratch)
    tags = [ref.location for _r, ck in read for ref in ck.storages.values()]
    if not tags and mapping and not allow_missing:
        raise UnsupportedError(_NOTHING.format(what="none of its non-tensor entries holds a tensor", src=folder))
    fn: LocationFn | None = location_function(to, mapping, tags=tags, allow_missing=allow_missing, where=folder)
    assert fn is not None
    counts = _write_retagged(read, fn)
    if not counts and not renaming and not allow_missing:
        what = (f"the tensors its non-tensor entries hold are tagged {', '.join(sorted(set(tags)))} already" if tags
                else "none of its non-tensor entries holds a tensor")
        raise UnsupportedError(_NOTHING.format(what=what, src=folder))
    return counts, len(tags)


# ------------------------------------------------------------------------------------------------ writing
def _copy_file(folder: str, stage: str, rel: str, size: int, recs: list[_Record],
               progress: ProgressFn | None) -> None:
    """Write the data file ``rel`` into ``stage``: byte for byte, or, when a record of ``recs`` (the file's
    records) was rewritten or dropped, its bytes around the records, the records kept, the new records in their
    place and no dropped record (the kept records' ``info`` offsets and lengths updated).

    Raises:
        CorruptCheckpointError: records of a file with a rewritten record overlap.
    """
    dst = os.path.join(stage, rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(os.path.join(folder, rel), "rb") as f, open(dst, "wb") as o:
        if not any(r.new_path or r.dropped for r in recs):
            copy_range(f, o, 0, size, progress=progress, block=clone_block(f, o))
        else:
            pos = 0
            for r in sorted(recs, key=lambda x: (x.offset, x.length)):
                if r.offset < pos:
                    raise CorruptCheckpointError(f"{folder}: records of {rel} overlap (at byte {r.offset}); "
                                                 "torch.distributed.checkpoint never writes that")
                copy_range(f, o, pos, r.offset - pos, progress=progress)
                start = o.tell()
                if r.dropped:
                    pos = r.offset + r.length
                    continue
                if r.new_path:
                    with open(r.new_path, "rb") as n:
                        copy_range(n, o, 0, r.new_length)
                    if progress is not None:
                        progress(r.length)
                else:
                    copy_range(f, o, r.offset, r.length, progress=progress)
                r.info["offset"], r.info["length"] = start, o.tell() - start
                pos = r.offset + r.length
            copy_range(f, o, pos, size - pos, progress=progress)
        o.flush()
        os.fsync(o.fileno())


def _expected(meta: DcpMetadata, records: list[_Record], fqns: dict[str, str]) -> tuple[list[Any], list[Any]]:
    """What the written ``.metadata`` must hold, from the input's parse and the plan: its entries (FQN, dtype,
    shape) and its records (FQN, non-tensor, file, offset, length), in order."""
    entries = [(fqns.get(e.fqn, e.fqn), e.dtype, e.shape) for e in meta.entries]
    items = [(fqns.get(r.fqn, r.fqn), r.is_bytes, r.rel, r.info["offset"], r.info["length"]) for r in records
             if not r.dropped]
    return entries, items


def _read_back(stage: str, dst: str, entries: list[Any], items: list[Any], planner: Any) -> None:
    """Read the written ``.metadata`` back with the restricted unpickler (not the pickler that wrote it) and compare
    it with what the plan says, each record's range with its written file.

    Raises:
        VerificationError: a difference (nothing is kept)."""
    try:
        back = open_checkpoint(stage).dcp_metadata()
        got_items = [(i.fqn, i.is_bytes, i.relative_path, i.offset, i.length) for i in back.items()]
    except CkptError as e:
        raise VerificationError(f"{dst}: the written .metadata does not read back ({e}); nothing was kept") from e
    got = [(e.fqn, e.dtype, e.shape) for e in back.entries]
    diff = ("entries" if got != entries else "records" if got_items != items
            else "planner_data" if back.planner_data != planner else None)
    for _f, _b, rel, off, n in items:
        if diff is None and off + n > os.path.getsize(os.path.join(stage, rel)):
            diff = f"the range of a record in {rel}"
    if diff is not None:
        raise VerificationError(f"{dst}: the written .metadata differs from the plan in its {diff}; nothing was "
                                "kept (a ckptool bug: please report it)")


def _write_metadata(meta: DcpMetadata, stage: str) -> int:
    """Write ``meta``'s (rewritten) graph as ``stage/.metadata`` with the input's pickle protocol; its size.

    Raises:
        UnsupportedError: a value the pickler cannot write back.
    """
    with open(os.path.join(meta.folder, METADATA_FILE), "rb") as f:
        head = f.read(2)
    protocol = head[1] if len(head) == 2 and head[0] == 0x80 else 2
    try:
        data = dumps(meta.root, protocol=protocol)
    except PicklerError as e:
        raise UnsupportedError(f"{meta.folder}: cannot write .metadata back ({e})") from e
    with open(os.path.join(stage, METADATA_FILE), "wb") as o:
        o.write(data)
        o.flush()
        os.fsync(o.fileno())
    return len(data)


def _commit(stage: str, dst: str) -> None:
    """Move the complete ``stage`` folder to ``dst`` (an empty folder there is replaced) with SIGINT / SIGTERM
    held, and record ``dst`` as complete."""
    os.chmod(stage, 0o777 & ~current_umask())  # made 0700 by mkdtemp: give it the mode a new folder gets
    fd = os.open(stage, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    with signals_blocked():
        if os.path.isdir(dst):
            os.rmdir(dst)
        os.replace(stage, dst)
        mark_committed(dst)


def rewrite_dcp(
    src: Opened, dst: str, *, operation: str, rename: Renamer | None = None, drop: Dropper | None = None,
    to: str | None = None, mapping: Mapping[str, str] | None = None, allow_missing: bool = False,
    dry_run: bool = False, progress: ProgressFn | None = None, executor: Executor | None = None,
) -> SetWriteResult | SetRenameResult:
    """Write the DCP folder ``src`` (opened: :func:`ckptool.readers.open_checkpoint`) as a new DCP folder ``dst``
    (new or empty), its entries renamed by ``rename`` or
    dropped by ``drop``, and / or the tags of its non-tensor entries re-tagged by ``to`` / ``mapping`` (see the
    module docstring). ``operation`` names the command in the result; ``progress(nbytes)`` as the data files are
    copied. ``dry_run``: everything is read and checked, nothing written (``dst`` of the result is ``""``).
    ``executor`` (else an enclosing :func:`~ckptool.ops.rewrite.parallel.shard_executor`'s): a thread pool writing
    the data files one per task; ``.metadata`` and the rename into place follow, in this thread, once all are done.

    Returns a :class:`~ckptool.ops.rewrite.sets.SetRenameResult` when ``rename`` is given, else a
    :class:`~ckptool.ops.rewrite.sets.SetWriteResult` (``dst`` the folder, ``files`` what it holds, ``shards`` the
    data files, ``storages`` the records of ``storage_data`` written, ``retagged`` the storages of non-tensor
    entries re-tagged).

    Raises:
        UsageError: ``dst`` exists and is not an empty folder, is inside ``folder``, or its parent is missing;
            ``drop`` leaves no entry.
        UnsupportedError: nothing to remap (see :func:`_retag`), a transformed record to remap, data files in
            DCP's safetensors serialization.
        UnsafeCheckpointError: ``.metadata`` names a global DCP never writes there (it is not written back).
        PrefixNotFoundError / KeyCollisionError / NestedPrefixError: from ``rename`` / ``drop``, or two entries
            renamed to one FQN; nothing written.
        DeviceNotFoundError: a ``mapping`` source matches no tag, unless ``allow_missing``.
        CorruptCheckpointError: a damaged folder.
        VerificationError: the written ``.metadata`` does not read back as planned (nothing kept).
    """
    folder = src.target
    if not dry_run:
        _check_target(folder, dst)
    meta, layout = src.dcp_metadata(), src.dcp_layout()  # layout: files and globals Megatron adds
    assert layout is not None  # dcp_metadata() refused any other format
    bad = [g for g in dict.fromkeys(meta.globals) if not is_dcp_allowed(g) and g not in layout.globals]
    if bad:
        raise UnsafeCheckpointError(
            f"{folder}: its .metadata names {', '.join(bad[:5])}, which torch.distributed.checkpoint never writes "
            "there (torch unpickles .metadata without restriction); ckptool does not write such a pickle back. "
            f"`ckptool scan {folder}` says more", bad)
    records, sizes = _records(meta)
    _refuse_safetensors_files(folder, sizes)
    fqns: dict[str, str] = {}
    summary = None
    if rename is not None:
        fqns, paths, summary = rename_entries(meta, rename)
        _apply_names(meta, records, fqns, paths)
    elif drop is not None:
        fqns, paths, gone = drop_entries(meta, drop)
        for r in records:
            r.dropped = r.fqn in gone
        _apply_names(meta, records, fqns, paths)
        sizes = {rel: n for rel, n in sizes.items() if any(r.rel == rel and not r.dropped for r in records)}
    res = SetWriteResult(folder, "" if dry_run else dst, src.format, storages=sum(not r.dropped for r in records),
                         shards=len(sizes))
    if not dry_run:
        changing = rename is not None or drop is not None
        _write(folder, dst, meta, records, (sizes, layout), fqns, res, (to, mapping, allow_missing, changing),
               progress, executor or current_executor())
    if summary is None:
        return res
    return SetRenameResult(**vars(res), operation=operation, **vars(summary))


def _write(folder: str, dst: str, meta: DcpMetadata, records: list[_Record], files: tuple[dict[str, int], DcpLayout],
           fqns: dict[str, str], res: SetWriteResult, retag: tuple[str | None, Mapping[str, str] | None, bool, bool],
           progress: ProgressFn | None, pool: Executor | None) -> None:
    """:func:`rewrite_dcp`'s writing (``files``: the data files' sizes, the layout whose companion files are copied
    as they are; ``retag``: ``to``, ``mapping``, ``allow_missing``, whether the entries change too; ``pool``: the
    executor writing the data files one per task, or None); fills ``res``."""
    (sizes, layout), (to, mapping, allow_missing, renaming) = files, retag
    with temp_path(dst, folder=True) as scratch:
        if to is not None or mapping:
            res.retagged, _tags = _retag(folder, records, scratch, to, mapping, allow_missing=allow_missing,
                                         renaming=renaming)
        with temp_path(dst, folder=True) as stage:  # removed on any failure (after every task has stopped)
            # one data file per task with a pool (each sets its own records' offsets); .metadata after all of them
            tell = locked(progress) if pool is not None else progress
            run_each(lambda rel: _copy_file(folder, stage, rel, sizes[rel], [r for r in records if r.rel == rel],
                                            tell), list(sizes), pool)
            _write_metadata(meta, stage)
            entries, items = _expected(meta, records, fqns)
            _read_back(stage, dst, entries, items, meta.planner_data)
            kept = copy_companions(folder, stage, layout)
            names = sorted(os.path.relpath(os.path.join(d, n), stage) for d, _s, ns in os.walk(stage) for n in ns)
            res.bytes_written = sum(os.path.getsize(os.path.join(stage, n)) for n in names)
            _commit(stage, dst)
    res.files = [os.path.join(dst, n) for n in names]
    left = sorted(set(os.listdir(folder)) - {METADATA_FILE, *sizes, *kept})
    dropped = sum(r.dropped for r in records)
    how = (f"the records of the dropped entries ({dropped}) were left out, the files holding one laid out anew"
           if dropped else "those holding a re-tagged non-tensor entry were laid out anew around it" if res.retagged
           else "")
    res.notes.append(f"{res.storages} records (tensor chunks and non-tensor entries); the .distcp data files were "
                     f"copied byte for byte{'; ' + how if how else ''}{companions_note(kept)}")
    if left:
        res.notes.append(f"not copied (no record of .metadata names them): {', '.join(left[:5])}"
                         f"{' ...' if len(left) > 5 else ''}")
