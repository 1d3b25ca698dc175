"""``ckptool.ops.rewrite.sets``: ``remap`` and the key-renaming commands on a sharded set (``*.index.json``).

A set (``transformers`` ``save_pretrained``: shards ``model-00001-of-00003.safetensors`` / ``pytorch_model-...bin``
plus the index that maps each tensor name to its shard) is rewritten shard by shard with the single-file code:
:func:`ckptool.ops.rewrite.stream.rewrite_file` for torch shards (tensor records copied byte for byte, location tags and
the pickle's keys rewritten), :func:`ckptool.ops.rewrite.prefixes.write_renamed_safetensors` for safetensors shards (a
new
JSON header, the data block copied). The output is a set of the same layout (one output shard per input shard, in
the order of their file names: ``-00002-of-00004`` stays the second) with its index: ``weight_map`` keys renamed
as the shards' keys are, ``metadata`` kept as it was.

Everything is checked on the whole set before a byte is written: the renaming is planned over the keys of every
shard at once (:func:`ckptool.model.rename_plan.plan_keys`), so a key renamed in one shard that collides with a key
of another is refused, and a prefix that matches nothing in the whole set is an error; a ``--map`` source must
match a storage of some shard. The set is written as ``convert`` writes its shard sets
(:func:`ckptool.ops.rewrite.set_writer.write_set`: every shard into a scratch file, then all renamed into place and
the index written, with SIGINT / SIGTERM held); a failed run leaves nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats.nodes import StorageRef
from ckptool.model.devices import LocationFn, location_function
from ckptool.model.graph import mapping_items, set_mapping_items
from ckptool.model.rename_plan import RenamePlan, plan_keys
from ckptool.model.units import plural
from ckptool.ops.rewrite.companions import companion_files
from ckptool.ops.rewrite.folders import folder_output, model_folder_output, refuse_existing_folder
from ckptool.ops.rewrite.parallel import current_executor, locked
from ckptool.ops.rewrite.set_writer import write_set
from ckptool.ops.rewrite.stream import (
    ProgressFn,
    RenameResult,
    WriteResult,
    output_path,
    refuse_unwritable,
    rename_mapping_node,
    rewrite_file,
    safetensors_keys,
    write_renamed_safetensors,
)
from ckptool.readers import Checkpoint, Format, Opened, open_checkpoint
from ckptool.readers.structures import SafetensorsHeader, ShardIndex
from ckptool.writers.encoders import INDEX_SUFFIX, SET_FILE_SUFFIXES, PicklerError, SetLayout, dumps


@dataclass(kw_only=True)
class SetFilesResult:
    """The files of a rewritten set: ``files`` (shards, then the index), ``notes`` (earlier set's files removed,
    ...), ``shards`` (count), ``kept``: the names of the files of the input's folder copied beside the set byte for
    byte (``config.json``, tokenizer files: :mod:`ckptool.ops.rewrite.companions`)."""

    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    shards: int = 0
    kept: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class SetWriteResult(WriteResult, SetFilesResult):
    """What ``remap`` of a set wrote: the :class:`~ckptool.ops.rewrite.stream.WriteResult` fields summed over the shards
    (``dst`` is the output index) plus :class:`SetFilesResult`."""


@dataclass(kw_only=True)
class SetRenameResult(RenameResult, SetFilesResult):
    """What a renaming of a set wrote: the :class:`~ckptool.ops.rewrite.prefixes.RenameResult` fields (the renaming
    planned
    over the whole set) plus :class:`SetFilesResult`."""


def set_payload(res: object) -> dict[str, Any]:
    """The JSON fields a command adds for a rewritten set: ``shards`` (count), ``files`` (shards, then the index),
    ``notes``, ``kept`` (the input folder's other files copied beside the set); for a model folder written as a
    folder (:mod:`ckptool.ops.rewrite.folders`) ``kept`` and ``notes``; none for a single file."""
    if not isinstance(res, SetFilesResult):
        if isinstance(res, WriteResult) and (res.kept or res.notes):
            return {"kept": list(res.kept), "notes": list(res.notes)}
        return {}
    return {"shards": res.shards, "files": list(res.files), "notes": list(res.notes), "kept": list(res.kept)}


def set_detail(res: object) -> str:
    """The words a command's ``Wrote ...`` line adds for a rewritten set (``" in 4 shards"``, and its notes); empty
    for a single file."""
    if not isinstance(res, SetFilesResult):
        return ""
    return f" in {plural(res.shards, 'shard')}" + "".join(f"; {n}" for n in res.notes)


@dataclass
class _Shard:
    name: str  # as the index names it
    path: str
    fmt: str
    keys: list[str]
    ck: Checkpoint | None = None  # torch shards
    header: SafetensorsHeader | None = None  # safetensors shards


def opened_input(src: str | os.PathLike[str] | Opened) -> Opened:
    """``src`` opened once (:func:`ckptool.readers.open_checkpoint`), or ``src`` itself when it already is."""
    return src if isinstance(src, Opened) else open_checkpoint(src)


def set_index(src: str | os.PathLike[str] | Opened) -> str | None:
    """The index of the sharded set ``src`` names (an ``*.index.json``, or a folder holding exactly one); None when
    ``src`` is a file. A model folder holding only ``model.safetensors`` / ``pytorch_model.bin`` is not a set: the
    caller gets None and reads ``Opened.target``, that file.

    A ``torch.distributed.checkpoint`` folder is no set either (None): :mod:`ckptool.ops.rewrite.dcp` rewrites it.

    Raises:
        UsageError: a DeepSpeed folder (consolidate it first), a folder that is no checkpoint set, a missing index.
    """
    o = opened_input(src)
    if o.dcp_layout() is not None:  # Megatron-Core's torch_dist folder too: rewritten as a DCP folder
        return None
    refusal = o.spec.refusal_for("rewrite-folder", o.path)  # a DeepSpeed or Megatron folder: consolidate it first
    if refusal is not None:
        raise UsageError(refusal)
    return o.target if o.spec.kind == "set" else None


def set_output(index: str, dst: str | os.PathLike[str] | None, tag: str, in_place: bool) -> str:
    """The ``-o`` a rewrite of the set of ``index`` writes: ``dst``, or by default the folder ``<folder>.<tag>``
    beside the set's folder (``ckpt/`` -> ``ckpt.cpu/``, as single files get ``model.cpu.pth``).

    Raises:
        UsageError: ``in_place`` (a set is not rewritten in place: write it elsewhere, then replace the folder).
    """
    return folder_output(os.path.dirname(os.path.abspath(index)), dst, tag, in_place,
                         f"{index}: --in-place does not apply to a sharded set; write it with -o DIR and replace the "
                         "old folder when you have checked the new one")


def dcp_folder(opened: Opened) -> str | None:
    """The folder ``opened`` names when it is a local ``torch.distributed.checkpoint`` folder (as
    :func:`ckptool.readers.open_checkpoint` recognised it: a format whose registry entry names a ``dcp`` layout,
    :attr:`ckptool.readers.Format.dcp`, which the rewrites take as it is: DCP's own, Megatron-Core's torch_dist;
    where a DeepSpeed folder or a Megatron legacy tree must be consolidated first), else None."""
    return opened.target if opened.dcp_layout() is not None and not source.is_url(opened.target) else None


def dcp_output(folder: str, dst: str | os.PathLike[str] | None, tag: str, in_place: bool) -> str:
    """The folder a rewrite of the DCP ``folder`` writes: ``dst``, or by default ``<folder>.<tag>`` beside it
    (``ckpt/`` -> ``ckpt.cpu/``, as sharded sets get theirs).

    Raises:
        UsageError: ``in_place`` (a DCP folder is written anew: write it elsewhere, then replace the folder).
    """
    return folder_output(folder, dst, tag, in_place,
                         f"{folder}: --in-place does not apply to a torch.distributed.checkpoint folder; write it "
                         "with -o DIR (a new or empty folder) and replace the old folder when you have checked it")


def rewrite_output(opened: Opened, dst: str | os.PathLike[str] | None, tag: str, in_place: bool) -> str:
    """Where a rewrite of ``opened`` (remap, the prefix commands, rename, filter) writes: ``dst``; else for a DCP
    folder, a sharded set or a model folder holding one file the folder ``<folder>.<tag>`` beside it
    (:func:`dcp_output`, :func:`ckptool.ops.rewrite.sets.set_output`,
    :func:`ckptool.ops.rewrite.folders.model_folder_output`), for a file ``<stem>.<tag><ext>`` beside it or, with
    ``in_place``, the file itself (:func:`ckptool.ops.rewrite.stream.output_path`).

    Raises:
        UsageError: ``in_place`` for a folder or set; a DeepSpeed folder; see
        :func:`ckptool.ops.rewrite.stream.output_path`.
    """
    folder = dcp_folder(opened)
    if folder is not None:
        return dcp_output(folder, dst, tag, in_place)
    index = set_index(opened)
    if index is not None:
        return set_output(index, dst, tag, in_place)
    folder = model_folder_output(opened, dst, tag, in_place)
    if folder is not None:
        return folder
    return output_path(opened.target, os.fspath(dst) if dst is not None else None, in_place, tag)


def _split_name(name: str) -> tuple[str, str] | None:
    """``("model", ".safetensors")`` for ``model.safetensors``; None without a shard suffix."""
    ext = next((s for s in SET_FILE_SUFFIXES if name.lower().endswith(s) and len(name) > len(s)), None)
    return (name[: -len(ext)], name[-len(ext):]) if ext else None


def _layout(index: ShardIndex, first: str, safetensors: bool, dst: str) -> SetLayout:
    """Where the rewritten set goes: ``dst`` names an index (``x.safetensors.index.json``) or a set file name
    (``x.safetensors``: the set beside it, as ``convert`` names sets), else a folder holding the set under the
    input's names. ``first`` is the name of the input's first shard, ``safetensors`` whether the shards are.

    Raises:
        UsageError: an index name without the shard suffix, a suffix the shards' format does not use, a folder
            output that is a file.
    """
    in_base = os.path.basename(index.path)[: -len(INDEX_SUFFIX)]
    stem, ext = _split_name(in_base) or (in_base, os.path.splitext(first)[1] or ".bin")
    name = os.path.basename(dst)
    base = name[: -len(INDEX_SUFFIX)] if name.endswith(INDEX_SUFFIX) else name
    split = _split_name(base) if not os.path.isdir(dst) else None
    if name.endswith(INDEX_SUFFIX) and split is None:
        raise UsageError(f"output {dst!r}: name the index after its shards, such as {base or 'model'}{ext}"
                         f"{INDEX_SUFFIX} (the shards are then {base or 'model'}-00001-of-0000N{ext})")
    if split is not None:
        if (split[1] == ".safetensors") != safetensors:
            raise UsageError(f"output {dst!r}: the shards of {index.path} are "
                             f"{'safetensors' if safetensors else 'torch files'}; name the output with {ext}")
        return SetLayout(os.path.dirname(os.path.abspath(dst)), *split)
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise UsageError(f"{dst} is a file; for a sharded set -o names a folder (created) or NAME{ext}{INDEX_SUFFIX}")
    return SetLayout(os.path.abspath(dst), stem, ext, is_output_folder=True)


def refuse_existing_set(src: str | os.PathLike[str] | Opened, out: str, *, force: bool) -> None:
    """Refuse, unless ``force``, to write the rewrite of the set ``src`` to ``out`` where a shard set of the same
    names already is (as ``convert`` refuses an existing set; with ``force`` the earlier set is replaced whole), or
    the rewrite of a model folder to a folder already holding its weights file
    (:func:`ckptool.ops.rewrite.folders.refuse_existing_folder`). A no-op for a file.

    Raises:
        UsageError: files of a set are in the way, or ``out`` is not a usable output name.
    """
    o = opened_input(src)
    if set_index(o) is None or force:
        refuse_existing_folder(o, out, force=force)
        return
    index = o.index()
    first = next(iter(index.shards), "")
    layout = _layout(index, first,
                     bool(first) and open_checkpoint(index.shard_path(first)).tensor_header() is not None, out)
    names = sorted(os.listdir(layout.folder)) if os.path.isdir(layout.folder) else []
    existing = [n for n in names if layout.is_member(n)]
    if existing:
        raise UsageError(f"{layout.folder} already holds a shard set ({', '.join(existing[:3])}"
                         f"{' ...' if len(existing) > 3 else ''}); pass --force to replace it, or choose another "
                         "-o path")


def _open_shard(index: ShardIndex, name: str) -> _Shard:
    """Read one shard's structure (torch: the pickle; safetensors: the header), never its tensor data.

    Raises:
        UnsupportedError: a shard that is not a torch.save file of one flat mapping, nor safetensors.
    """
    path = index.shard_path(name)
    shard = open_checkpoint(path)
    fmt = shard.format
    header = shard.tensor_header()
    if header is not None:
        return _Shard(name, path, fmt, safetensors_keys(path, header), header=header)
    refuse_unwritable(shard.spec, path, "rewrite")
    ck = shard.graph()
    items = mapping_items(ck.root)
    if items is None:
        raise UnsupportedError(f"{path}: a shard of {index.path} that is not a mapping of tensor names "
                               "(a state_dict shard); ckptool rewrites shards as transformers saves them")
    return _Shard(name, path, fmt, [k for k, _v in items if isinstance(k, str)], ck=ck)


def _refuse_duplicates(index_path: str, shards: list[_Shard]) -> None:
    """Raise CorruptCheckpointError when two shards hold a tensor of one name (which one a loader keeps depends on
    its order; a rewrite would keep both)."""
    seen: dict[str, str] = {}
    for s in shards:
        for k in s.keys:
            other = seen.setdefault(k, s.name)
            if other != s.name:
                raise CorruptCheckpointError(f"{index_path}: the shards {other} and {s.name} both hold {k!r}; a "
                                             "loader keeps one of them by its order. Remove one and fix the index")


def _data_bytes(shards: list[_Shard]) -> int:
    """Bytes of tensor data of the set (the index's ``total_size`` when the input index records none)."""
    return sum(s.header.data_size if s.header is not None else
               sum(r.size for r in s.ck.records if r.name.startswith("data/")) if s.ck is not None else 0
               for s in shards)


@dataclass
class OpenSet:
    """A sharded set read for a rewrite (structure only, no tensor data): its ``index``, ``shards`` (by file name),
    whether they are ``safetensors`` shards, and ``names``: every key of the set (the shards' keys, then names only
    the index lists)."""

    index: ShardIndex
    shards: list[_Shard]
    safetensors: bool
    names: list[str]
    spec: Format  # the set's registry entry

    @property
    def path(self) -> str:
        return self.index.path


def open_set(src: str | Opened, *, key: str | None = None) -> OpenSet:
    """Read the set ``src`` (its ``*.index.json``, or the set opened): the index, then each shard's structure
    (:func:`_open_shard`).

    Raises:
        UsageError: ``key`` (a set's shards hold the flat state_dict itself).
        UnsupportedError: no shard, shards of mixed or unwritable formats.
        CorruptCheckpointError: two shards holding one name; an unreadable index or shard.
    """
    o = opened_input(src)
    index_path = o.target
    if key is not None:
        raise UsageError(f"{index_path} is a sharded set: its shards hold one flat state_dict, so --key does not "
                         "apply")
    index = o.index()
    # in file-name order (model-00001-of-00004... first), not the index's order of first appearance: transformers
    # writes the weight_map sorted by tensor name, so that order would give shard 2 the name of shard 1
    shards = [_open_shard(index, name) for name in sorted(index.shards)]
    if not shards:
        raise UnsupportedError(f"{index_path} names no shard (an empty weight_map); there is nothing to rewrite")
    kinds = {s.header is not None for s in shards}
    if len(kinds) > 1:
        raise UnsupportedError(f"{index_path} mixes safetensors and torch shards; rewrite each shard by itself")
    _refuse_duplicates(index_path, shards)
    names = list(dict.fromkeys([k for s in shards for k in s.keys] + list(index.weight_map)))
    return OpenSet(index, shards, kinds == {True}, names, o.spec)


def set_location_function(s: OpenSet, to: str | None, mapping: Mapping[str, str] | None, *, renaming: bool,
                          allow_missing: bool) -> LocationFn | None:
    """The re-tagging of the torch shards of ``s`` by ``to`` / ``mapping`` (None for safetensors shards).

    Raises:
        UnsupportedError: a ``remap`` (not ``renaming``) of safetensors shards (no device tags).
        UsageError: ``to`` / ``mapping`` with a renaming or filtering of safetensors shards.
        DeviceNotFoundError: a ``mapping`` source matches no storage of any shard, unless ``allow_missing``.
    """
    if s.safetensors and (to is not None or mapping):
        if not renaming:
            refuse_unwritable(s.spec, s.path, "remap")
        raise UsageError(f"{s.path} is a set of safetensors shards: they carry no location tags, so --to / "
                         "--map do not apply (load them on any device with safetensors.torch.load_file(path, "
                         "device=...))")
    tags = [r.location for sh in s.shards if sh.ck is not None for r in sh.ck.storages.values()]
    return None if s.safetensors else location_function(to, mapping, tags=tags, allow_missing=allow_missing,
                                                          where=s.path)


def used_storages(root: Any, protocol: int) -> set[str]:
    """The keys of the storages the pickle of ``root`` refers to: found by pickling it (the writer's own walk).

    Raises:
        UnsupportedError: a graph the pickler cannot write back.
    """
    used: set[str] = set()

    def hook(ref: StorageRef) -> tuple[Any, ...]:
        used.add(ref.key)
        return (ref.typename, ref.storage_type, ref.key, ref.location, ref.numel, *ref.extra)

    try:
        dumps(root, protocol=protocol, storage_hook=hook)
    except PicklerError as e:
        raise UnsupportedError(f"cannot write the pickle back ({e})") from e
    return used


def prune_storages(ck: Checkpoint, root: Any) -> Checkpoint:
    """``ck`` without the storages (and their ``data/`` records) that the pickle of ``root`` no longer refers to,
    so that a rewrite leaves the bytes of dropped tensors out; ``ck`` itself when every storage is still used."""
    used = used_storages(root, ck.protocol)
    if len(used) >= len(ck.storages):
        return ck
    keep = {"data/" + k for k in used}
    return replace(ck, _records=[r for r in ck.records if not r.name.startswith("data/") or r.name in keep],
                   storages={k: v for k, v in ck.storages.items() if k in used})


#: ``write_subset(shard path, output path, dropped names, progress) -> WriteResult``: a safetensors shard written
#: without the ``dropped`` tensors (:func:`rewrite_set`'s ``drop``)
SubsetWriter = Callable[[str, str, set[str], ProgressFn | None], WriteResult]


def _drop_from_shard(shard: _Shard, gone: set[str]) -> None:
    """Remove the names ``gone`` from a torch shard's mapping and its storages no kept tensor uses."""
    assert shard.ck is not None
    set_mapping_items(shard.ck.root, [(k, v) for k, v in mapping_items(shard.ck.root) or [] if k not in gone])
    shard.ck = prune_storages(shard.ck, shard.ck.root)


def _output_layout(s: OpenSet, shards: list[_Shard], dst: str, key_map: dict[str, str],
                   gone: set[str]) -> tuple[SetLayout, dict[str, str]]:
    """The layout of the output set of ``shards`` (those of ``s`` written) at ``dst``, and its ``weight_map``:
    names renamed by ``key_map``, the names ``gone`` left out, shards numbered in order."""
    layout = _layout(s.index, s.shards[0].name, s.safetensors, dst)
    out_names = layout.shard_names(len(shards)) if len(shards) > 1 else [layout.stem + layout.ext]
    position = {sh.name: i for i, sh in enumerate(shards)}
    return layout, {key_map.get(k, k): out_names[position[v]] for k, v in s.index.weight_map.items()
                    if k not in gone and v in position}


def _dropped_shards(n: int) -> str:
    """The note of a filtering that left ``n`` shards empty (they are not written)."""
    were = "was" if n == 1 else "were"
    return f"{plural(n, 'shard')} held only dropped tensors and {were} not written; the shards kept are numbered anew"


def _add(res: SetWriteResult, w: WriteResult, metadata: dict[str, Any] | None, size: int) -> None:
    """Add one shard's write ``w`` (and its ``size`` of tensor data, to ``metadata``'s ``total_size``) to ``res``."""
    if metadata is not None and size:
        metadata["total_size"] += size
    res.storages += w.storages
    res.bytes_written += w.bytes_written
    for pair, n in w.retagged.items():
        res.retagged[pair] = res.retagged.get(pair, 0) + n


def rewrite_set(
    src: str | Opened | OpenSet, dst: str, *, operation: str, plan: RenamePlan | None = None, to: str | None = None,
    mapping: Mapping[str, str] | None = None, key: str | None = None, allow_missing: bool = False,
    drop: Collection[str] = (), write_subset: SubsetWriter | None = None, progress: ProgressFn | None = None,
    executor: Executor | None = None,
) -> SetWriteResult | SetRenameResult:
    """Rewrite the sharded set of the index ``src`` (or the set :func:`open_set` read) into ``dst`` (see
    :func:`_layout`): storages re-tagged by ``to`` / ``mapping`` (torch shards), keys renamed by ``plan``, the names
    ``drop`` left out (safetensors shards through ``write_subset``; see the module docstring); one output shard per
    input shard (that keeps a tensor), index ``weight_map`` renamed the same way and its ``metadata`` kept.
    ``operation`` names the command in the result and in messages; ``progress(nbytes)`` as the shards' bytes are
    copied; ``executor`` (else that of an enclosing :func:`ckptool.ops.rewrite.parallel.shard_executor` block): a
    ``ThreadPoolExecutor`` that writes the shards one per task (the index is written last, by this thread).

    Returns a :class:`SetRenameResult` when ``plan`` is given, else a :class:`SetWriteResult`; ``dst`` of either is
    the output index.

    Raises:
        UsageError: ``key`` (a set's shards hold the flat state_dict itself), ``to`` / ``mapping`` with a
            renaming of safetensors shards, a bad output name, an output file that is an input, ``drop`` naming
            every key.
        UnsupportedError: ``remap`` of safetensors shards (no device tags), shards of mixed or unwritable formats.
        PrefixNotFoundError / KeyCollisionError / NestedPrefixError / DeviceNotFoundError: checked over the whole
            set, as the single-file commands check one file; nothing written.
        CorruptCheckpointError / NotACheckpointError: an unreadable index or shard.
    """
    s = src if isinstance(src, OpenSet) else open_set(src, key=key)
    index, index_path = s.index, s.path
    location_fn = set_location_function(s, to, mapping, renaming=plan is not None or bool(drop),
                                        allow_missing=allow_missing)
    key_map: dict[str, str] = {}
    summary = None
    bound = plan
    if plan is not None:
        mappings, summary = plan_keys([("", s.names, False)], plan, allow_missing=allow_missing, where=index_path)
        key_map, bound = mappings[0], plan.bind(s.names)
    gone = set(drop)
    shards = [sh for sh in s.shards if not gone or any(k not in gone for k in sh.keys)]
    if not shards:
        raise UsageError(f"{index_path}: the filter matched every key of the set; nothing was written")
    layout, weight_map = _output_layout(s, shards, dst, key_map, gone)
    metadata = index.metadata
    if gone:  # total_size counted anew as the shards are written (the index is written after them)
        metadata = {**(index.metadata or {}), "total_size": 0}
    res = SetWriteResult(index_path, "", shards[0].fmt, shards=len(shards))
    lock = threading.Lock()  # the shards may be written by tasks at once (ops/rewrite/parallel.py)
    pool = executor or current_executor()
    progress = locked(progress) if pool is not None else progress

    def write(path: str, _final: str, shard: _Shard) -> None:
        dropped = gone.intersection(shard.keys)
        if shard.header is not None and dropped:
            assert write_subset is not None, "a safetensors shard to filter needs write_subset"
            w = write_subset(shard.path, path, dropped, progress)
        elif shard.header is not None:
            w = write_renamed_safetensors(shard.path, path, shard.header, key_map, progress)
        else:
            assert shard.ck is not None
            if dropped:
                _drop_from_shard(shard, dropped)
            if key_map and bound is not None:
                rename_mapping_node(shard.ck.root, key_map, bound)
            w = rewrite_file(shard.ck, path, shard.ck.root, location_fn, progress=progress)
        size = (open_checkpoint(path).safetensors_header().data_size if shard.header is not None
                else _data_bytes([shard])) if metadata is not None and gone else 0
        with lock:
            _add(res, w, metadata, size)

    inputs = [os.path.abspath(index_path), *(sh.path for sh in s.shards)]
    companions = companion_files(os.path.dirname(index_path), {os.path.basename(p) for p in inputs}, layout.folder)
    write_set(layout, shards, write, inputs, weight_map, _data_bytes(shards), res, dst,
              metadata=metadata, always_index=True, companions=companions.files, pool=pool)
    res.kept = companions.names
    res.notes += companions.notes()
    res.dst = os.path.join(layout.folder, layout.index_name)
    if len(shards) < len(s.shards):
        res.notes.append(_dropped_shards(len(s.shards) - len(shards)))
    if summary is None:
        return res
    return SetRenameResult(**vars(res), operation=operation, **vars(summary))
