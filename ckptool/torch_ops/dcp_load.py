"""Loading a ``torch.distributed.checkpoint`` (DCP) folder into memory for ``load_into``, ``verify`` and
``load_training_state``, without ``torch.distributed.checkpoint``'s reader.

torch's own route (``format_utils.dcp_to_torch_save``: ``FileSystemReader`` + ``_EmptyStateDictLoadPlanner``)
unpickles ``.metadata`` with ``pickle.load`` and every non-tensor entry with ``torch.load(weights_only=False)``
(default_planner ``load_bytes``): either can run code. :func:`load_dcp_state_dict` builds the same nested state
another way:

* ``.metadata`` is read by ckptool's restricted unpickler (:meth:`ckptool.readers.Opened.dcp_metadata`: nothing
  imported or run), and without ``trust`` a global DCP never writes there is refused, as ``ckptool diff`` refuses
  it (:mod:`ckptool.readers.read_dcp`);
* each tensor chunk's record (the ``length`` bytes at ``offset`` of a ``.distcp`` file that ``storage_data``
  names) is first read as a node graph and checked (:mod:`ckptool.readers.read_dcp`: one plain tensor of the dtype
  and chunk size ``.metadata`` gives, naming only globals on torch's ``weights_only`` allowlist, inside its file),
  then loaded by torch itself, ``torch.load(record, map_location=device, weights_only=True)``, as
  ``FileSystemReader.read_data`` loads it (torch/distributed/checkpoint/filesystem.py), and copied into the whole
  tensor at the chunk's ``ChunkStorageMetadata`` offsets (``narrow`` + ``copy_``, as ``read_data`` does), so a
  tensor sharded by rows, by columns or in blocks is put back whole; chunks must cover the tensor exactly once;
* each non-tensor entry's record (a ``torch.save`` of the value) is loaded with ``torch.load(weights_only=True)``
  when its pickle names only allowlisted globals (a step count, a learning rate, a dict of them); any other is
  refused with an :class:`~ckptool.errors.UnsafeCheckpointError` naming the entry and ``--trust``; with ``trust``
  it is loaded as DCP loads it, ``weights_only=False``;
* the values are nested as ``planner_data`` says (``_EmptyStateDictLoadPlanner.set_up_planner`` +
  ``_traverse.set_element``: a dict per string component, a list per integer one), so
  ``{"model": {...}, "optim": {...}}`` comes back as saved and the state_dict is chosen from it as from a training
  checkpoint (:func:`ckptool.torch_ops.select.select_state_dict`).

Every tensor is contiguous, of the dtype and size ``.metadata`` records, on ``device``.

Importing this module does not import torch; the function imports it when called.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Collection
from typing import Any, BinaryIO

from ckptool.errors import CkptError, CorruptCheckpointError, UnsafeCheckpointError
from ckptool.formats.dtypes import numel
from ckptool.model import graph
from ckptool.model.allowlist import ALLOWED, classify_global
from ckptool.readers import Opened, open_checkpoint
from ckptool.readers.read_dcp import (
    RecordSlice,
    check_metadata_globals,
    check_records,
    chunk_infos,
    entry_chunks,
    entry_dtype,
    record_in_file,
    torch_save_record,
)
from ckptool.readers.structures import DcpEntry, DcpMetadata
from ckptool.torch_ops.annotations import torch
from ckptool.torch_ops.cast import torch_dtype
from ckptool.torch_ops.trusted import GUARDED, guarded, refuse_gadgets

__all__ = ["load_dcp_state_dict"]

_ZIP_HEAD = b"PK\x03\x04"


def load_dcp_state_dict(folder: str | os.PathLike[str] | Opened, device: torch.device | str = "cpu", *,
                        trust: bool = False, safe_globals: Collection[str] = (), max_expand: float | None = None
                        ) -> tuple[dict[Any, Any], dict[str, int]]:
    """The nested state of the DCP folder ``folder`` (a path, opened once, or already opened) as
    ``dcp_to_torch_save`` rebuilds it, every tensor on
    ``device``; safe unless ``trust`` (see the module docstring). ``safe_globals``: ``module.qualname`` of globals
    the caller allows in non-tensor entries beside torch's allowlist (what ``torch.serialization.add_safe_globals``
    registered, which ``torch.load(weights_only=True)`` accepts too). Before torch reads anything, every tensor
    record is checked (:func:`~ckptool.readers.read_dcp.check_records`): ``max_expand`` bounds the bytes torch
    allocates by what the records hold (:mod:`ckptool.readers.budget`; None: the default factor).

    Returns ``(state, saved_devices)``: the nested dict and location tag -> tensor count as saved (DCP writes
    every tensor chunk from the CPU; the tensors inside non-tensor entries keep their own tags).

    Raises:
        UsageError: ``folder`` has no ``.metadata``.
        UnsafeCheckpointError: without ``trust``, ``.metadata`` names a global DCP never writes there, or a
            non-tensor entry names one outside torch's allowlist (or is no ``torch.save`` record, so cannot be
            checked); a tensor record naming such globals, with or without ``trust`` (DCP loads tensor records
            with ``weights_only=True`` too).
        UnsupportedError: records DCP transformed, a folder saved in DCP's safetensors serialization, a dtype
            ckptool does not know; tensors over the ``max_expand`` budget.
        CorruptCheckpointError: a damaged ``.metadata``, a record missing, outside its file, truncated or not
            what ``.metadata`` says, chunks that do not cover their tensor exactly once, torch failing to read a
            record.
    """
    meta = (folder if isinstance(folder, Opened) else open_checkpoint(folder)).dcp_metadata()
    if not trust:
        check_metadata_globals(meta)
    check_records(meta, max_expand, "load")
    infos = chunk_infos(meta)
    root: dict[Any, Any] = {}
    saved: dict[str, int] = {}
    files: dict[str, BinaryIO] = {}
    try:
        for e in meta.entries:
            if e.dtype is None:
                value = _non_tensor(files, meta, infos, e, device, trust, set(safe_globals), saved)
            else:
                value = _tensor(files, meta, infos, e, device)
                saved["cpu"] = saved.get("cpu", 0) + 1
            _set_element(root, _path(meta, e.fqn), value, meta, e.fqn)
    finally:
        for fh in files.values():
            fh.close()
    return root, saved


# ------------------------------------------------------------------------------------------------ tensors
def _tensor(files: dict[str, BinaryIO], meta: DcpMetadata, infos: dict[Any, Any], e: DcpEntry,
            device: torch.device | str) -> torch.Tensor:
    """Tensor entry ``e``: every chunk's record (checked first: :func:`~ckptool.readers.read_dcp.check_records`)
    loaded by ``torch.load(weights_only=True)`` and copied into place."""
    import torch

    dtype = entry_dtype(meta, e)
    shape = e.shape or ()
    chunks = entry_chunks(meta, e)
    _check_cover(meta, e, chunks)
    whole: torch.Tensor | None = None
    for offsets, sizes in chunks:
        info = infos.get((e.fqn, offsets))
        if info is None:
            raise CorruptCheckpointError(f"{meta.folder}: the chunk of {e.fqn!r} at offsets {list(offsets)} has no "
                                         "record in .metadata's storage_data; the folder is damaged")
        what = f"{meta.folder}: the record of {e.fqn!r} at offsets {list(offsets)}"
        part = _torch_load(record_in_file(files, meta, info, what), what, device, weights_only=True)
        if not isinstance(part, torch.Tensor) or tuple(part.shape) != sizes or str(part.dtype) != f"torch.{dtype}":
            raise CorruptCheckpointError(f"{meta.folder}: torch reads the record of {e.fqn!r} at offsets "
                                         f"{list(offsets)} as {_describe(part)}, where .metadata says {dtype} "
                                         f"{list(sizes)}; the folder is damaged")
        if len(chunks) == 1 and sizes == shape and _compact(part):
            return part  # the record's own tensor: nothing to gather
        if whole is None:
            whole = torch.empty(shape, dtype=torch_dtype(dtype), device=device)
        dest = whole
        for dim, (o, s) in enumerate(zip(offsets, sizes)):
            dest = dest.narrow(dim, o, s)
        dest.copy_(part)
        del part
    return whole if whole is not None else torch.empty(shape, dtype=torch_dtype(dtype), device=device)


def _compact(t: torch.Tensor) -> bool:
    """``t`` is contiguous and alone in its storage (as ``torch.empty`` + ``copy_`` would give it)."""
    return bool(t.is_contiguous()) and t.storage_offset() == 0 and \
        t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _check_cover(meta: DcpMetadata, e: DcpEntry, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """Refuse chunks of ``e`` that leave a gap or overlap (each lies inside the tensor already: ``entry_chunks``):
    torch's reader would leave ``torch.empty``'s garbage in a gap without a word.

    Raises:
        CorruptCheckpointError: the chunks do not cover the tensor exactly once.
    """
    shape = e.shape or ()
    boxes = [(o, s) for o, s in chunks if numel(s)]
    total = sum(numel(s) for _, s in boxes)
    overlap = next(((a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]
                    if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]))),
                   None)
    if total != numel(shape) or overlap is not None:
        what = (f"the chunks at offsets {list(overlap[0][0])} and {list(overlap[1][0])} overlap" if overlap else
                f"they hold {total} of its {numel(shape)} elements")
        raise CorruptCheckpointError(f"{meta.folder}: the chunks of {e.fqn!r} {list(shape)} do not cover it once "
                                     f"({what}); the folder is damaged")


# ------------------------------------------------------------------------------------------------ other values
def _non_tensor(files: dict[str, BinaryIO], meta: DcpMetadata, infos: dict[Any, Any], e: DcpEntry,
                device: torch.device | str, trust: bool, allowed: set[str], saved: dict[str, int]) -> Any:
    """Non-tensor entry ``e``: its ``torch.save`` record loaded with ``weights_only=not trust``, after (without
    ``trust``) ckptool's restricted reader found only allowlisted globals in it."""
    what = f"{meta.folder}: the non-tensor entry {e.fqn!r}"
    blob = _record(files, meta, infos.get((e.fqn, None)), what)
    remedy = ("loading it would run code named by the folder (torch.distributed.checkpoint loads it with "
              "weights_only=False). Pass --trust (trust=True) only if you trust where the folder came from")
    if blob.read(4) != _ZIP_HEAD:
        if not trust:
            raise UnsafeCheckpointError(f"{what} is not a torch.save record, so ckptool cannot check it; {remedy}",
                                        [e.fqn])
    else:
        names: list[str] = []
        node, _storages, _entries = torch_save_record(blob, what, names)
        if trust:
            refuse_gadgets(meta.folder, names, f"the record of the non-tensor entry {e.fqn!r}")
        bad = sorted({g for g in names if classify_global(g)[0] != ALLOWED and g not in allowed})
        if bad and not trust:
            raise UnsafeCheckpointError(f"{what} names {', '.join(bad[:5])}{' and more' if len(bad) > 5 else ''}, "
                                        f"outside torch.load(weights_only=True)'s allowlist; {remedy}", bad)
        for _key, t, _rg in graph.iter_tensors(node):
            tag = t.storage.location if t.storage is not None else "meta"
            saved[tag] = saved.get(tag, 0) + 1
    blob.seek(0)
    try:  # in memory, as DCP's read_data hands a BYTE_IO record to load_bytes (a legacy pickle needs readline)
        with guarded(meta.folder, f"the record of the non-tensor entry {e.fqn!r}"):
            return _torch_load(io.BytesIO(blob.read()), what, device, weights_only=not trust)
    except _WeightsOnlyRefused as ex:
        raise UnsafeCheckpointError(f"{what}: torch.load(weights_only=True) refuses it ({ex}); {remedy}",
                                    [e.fqn]) from None


def _record(files: dict[str, BinaryIO], meta: DcpMetadata, info: Any, what: str) -> RecordSlice:
    """The record ``info`` names, checked to lie inside its ``.distcp`` file
    (:func:`ckptool.readers.read_dcp.record_in_file`).

    Raises:
        CorruptCheckpointError: no record, a malformed one, a missing file, one past its end.
        UnsupportedError: a record DCP transformed.
    """
    if info is None:
        raise CorruptCheckpointError(f"{what} has no record in .metadata's storage_data; the folder is damaged")
    return record_in_file(files, meta, info, what)


class _WeightsOnlyRefused(Exception):
    """torch.load(weights_only=True) refused a record (its first line)."""


def _torch_load(blob: RecordSlice | io.BytesIO, what: str, device: torch.device | str, *, weights_only: bool
                ) -> Any:
    """``torch.load`` of one record (a tensor's: the slice of the ``.distcp`` file, its bytes not copied first).

    Raises:
        _WeightsOnlyRefused: torch's weights-only unpickler refused it.
        CorruptCheckpointError: torch could not read it.
    """
    import torch

    blob.seek(0)
    try:
        if weights_only:
            return torch.load(blob, map_location=device, weights_only=True)  # type: ignore[arg-type]
        return torch.load(blob, map_location=device, weights_only=False, pickle_module=GUARDED)  # type: ignore[arg-type]
    except CkptError:
        raise
    except pickle.UnpicklingError as ex:
        if weights_only:
            raise _WeightsOnlyRefused(str(ex).strip().splitlines()[0][:300] if str(ex).strip() else "") from ex
        raise CorruptCheckpointError(f"{what}: unpickling failed ({_first_line(ex)[:300]}); the folder is "
                                     "damaged") from ex
    except MemoryError:
        raise
    except ImportError as ex:  # a trusted pickle naming code that is not importable here
        raise CkptError(f"{what} names code that is not importable here ({_first_line(ex)})") from ex
    except Exception as ex:  # torch's own RuntimeError / EOFError / ValueError for a damaged record
        raise CorruptCheckpointError(f"{what}: torch.load failed ({type(ex).__name__}: "
                                     f"{_first_line(ex)[:300]}); the folder is truncated or damaged") from ex


def _first_line(ex: BaseException) -> str:
    """The first line of torch's message (some carry a traceback of their own below it)."""
    text = str(ex).strip()
    return text.splitlines()[0] if text else type(ex).__name__


def _describe(v: Any) -> str:
    shape = getattr(v, "shape", None)
    return f"a {v.dtype} tensor {list(shape)}" if shape is not None and hasattr(v, "dtype") else \
        f"a {type(v).__name__}"


# ------------------------------------------------------------------------------------------------ nesting
def _path(meta: DcpMetadata, fqn: str) -> tuple[Any, ...]:
    """Where ``planner_data`` puts ``fqn`` (its components as recorded: strings and list indices), else
    ``(fqn,)``, as ``_EmptyStateDictLoadPlanner.set_up_planner`` reads it.

    Raises:
        CorruptCheckpointError: a path that is not a non-empty sequence of strings and non-negative integers.
    """
    planner = meta.planner_data
    if planner is None or fqn not in planner:
        return (fqn,)
    p = planner[fqn]
    if not isinstance(p, (tuple, list)) or not p or not all(
            type(c) is str or (type(c) is int and c >= 0) for c in p):
        raise CorruptCheckpointError(f"{meta.folder}: .metadata's planner_data gives {fqn!r} the path {p!r}; the "
                                     "folder is damaged")
    return tuple(p)


def _set_element(root: dict[Any, Any], path: tuple[Any, ...], value: Any, meta: DcpMetadata, fqn: str) -> None:
    """Put ``value`` at ``path`` in ``root`` as torch's ``_traverse.set_element`` does: a missing container is a
    dict before a string component, a list (padded with None) before an integer one.

    Raises:
        CorruptCheckpointError: the path runs through a value, indexes a dict-less list with a string, names a
            list index beyond the folder's entry count (a list DCP flattened has at most one item per entry), or
            puts two entries at one place.
    """
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{meta.folder}: .metadata's planner_data puts {fqn!r} at "
                                      f"{'.'.join(map(str, path))!r}, {why}; the folder is damaged")

    cur: Any = root
    for i, key in enumerate(path):
        if isinstance(cur, list):
            if type(key) is not int:
                raise bad("a string index into a list")
            if key > len(meta.entries):
                raise bad("an index beyond every entry")
            cur.extend([None] * (key + 1 - len(cur)))
            there = cur[key] is not None  # set_element pads lists with None
        elif isinstance(cur, dict):
            there = key in cur
        else:
            raise bad("inside another entry")
        if i == len(path) - 1:
            if there:
                raise bad("where another entry is")
            cur[key] = value
        else:
            if not there:
                cur[key] = {} if type(path[i + 1]) is str else []
            cur = cur[key]
