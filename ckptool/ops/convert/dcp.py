"""``convert``'s DCP steps: a whole DCP folder to one torch file, and a loaded state to a new DCP folder.

A folder whose tensors are each stored whole (one chunk: what a single process, or ranks holding full replicas,
save) and whose ``planner_data`` nests dicts only is converted without torch (:func:`copy_dcp_to_torch`): the
output pickle is built from ``.metadata`` and the non-tensor entries' pickles (read with the restricted
unpickler), and each tensor's bytes are copied by range from the ``torch.save`` record DCP wrote for it, so
memory stays a few MiB whatever the size. Anything else goes through torch's own machinery
(:mod:`ckptool.torch_ops.dcp`). A DCP folder is written into a staging
folder beside the destination, named as :func:`ckptool._fileio.atomic_output` names its temporary files, and
renamed into place only once written (and verified); on any failure the staging folder is removed.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

from ckptool._commit import mark_committed, signals_blocked
from ckptool._fileio import temp_path
from ckptool.errors import CkptError, UsageError
from ckptool.formats.dtypes import contiguous_stride, element_size, tensor_dtype
from ckptool.formats.nodes import TensorNode
from ckptool.model.tensor_nodes import tensor_node
from ckptool.ops.convert.report import ConvertResult
from ckptool.ops.convert.verify import records_difference, verify_fail
from ckptool.ops.convert.write import emit
from ckptool.ops.rewrite.set_writer import scratch_file
from ckptool.readers.read_dcp import RecordSlice, record_byteorder
from ckptool.readers.read_dcp import node_state as _state
from ckptool.readers.read_dcp import open_record as _record
from ckptool.readers.read_dcp import size_ints as _ints
from ckptool.readers.read_dcp import torch_save_record as _torch_save_record
from ckptool.readers.structures import DcpEntry, DcpMetadata, data_offset
from ckptool.torch_ops.dcp import dcp_round_trip_difference, dcp_to_torch_file, metadata_difference, save_dcp
from ckptool.writers.encoders import PicklerError, TorchZipWriter, dumps

WHOLE_NOTE = "the whole checkpoint was converted (pass --key to convert one state_dict)"


def whole_dcp_to_torch(meta: DcpMetadata, dst: str, verify: bool) -> ConvertResult:
    """Write the DCP folder of ``meta`` as one torch file at ``dst`` as ``format_utils.dcp_to_torch_save`` would
    (:func:`copy_dcp_to_torch` without torch where it can, else :func:`~ckptool.torch_ops.dcp.dcp_to_torch_file`;
    written atomically), checking before it is kept that it opens with ``torch.load(weights_only=True)`` and, with
    ``verify``, holds every tensor ``.metadata`` lists with its dtype and shape.

    Raises:
        CorruptCheckpointError: torch could not read the folder.
        VerificationError: a tensor is missing or differs (nothing is kept).
    """
    res = ConvertResult(meta.folder, dst, "dcp", "torch", notes=[WHOLE_NOTE])
    copied = [False]  # written by copy_dcp_to_torch (record bytes copied with the CRC-32 the folder records)

    def write(out: BinaryIO) -> None:
        start = out.tell()
        copied[0] = copy_dcp_to_torch(meta, out)
        if not copied[0]:
            out.seek(start)
            out.truncate()
            dcp_to_torch_file(meta.folder, out)

    def check(_w: None, path: str) -> None:
        res.tensors, diff = metadata_difference(path, meta.entries, verify)
        if diff is None and verify:
            diff = records_difference(path, None)
        if diff is not None:
            raise verify_fail(dst, diff)

    emit(dst, write, check)
    res.stored = res.tensors
    if verify:
        res.verified = True
        res.checked = ("the output re-opens with torch.load(weights_only=True) holding the names, shapes and dtypes "
                       ".metadata lists, and zipfile finds every record's bytes matching its CRC-32"
                       + (", which for each tensor copied is the CRC-32 the .distcp file's own zip directory "
                          "records" if copied[0] else " (written by torch's dcp_to_torch_save, which reads the "
                          "folder: DCP records no checksums of its own)"))
    res.files = [dst]
    res.bytes_written = os.path.getsize(dst)
    return res


def check_dcp_target(dst: str) -> None:
    """Refuse a DCP destination that is not a new or empty folder in an existing folder.

    Raises:
        UsageError: ``dst`` exists and is a file or a non-empty folder; its parent folder does not exist.
    """
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise UsageError(f"{dst} already exists and is not an empty folder; a DCP checkpoint is written into a new "
                         "folder: choose another -o path")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise UsageError(f"output folder {parent} does not exist; create it first or choose another -o path")


def write_dcp(state: dict[str, Any], dst: str, verify: bool, res: ConvertResult) -> None:
    """Save ``state`` as a DCP checkpoint in the new folder ``dst`` (``torch.distributed.checkpoint.save``, no
    process group), filling ``res``. With ``verify`` the folder is read back (``dcp_to_torch_save``) and every
    tensor compared before it is moved into place.

    Raises:
        VerificationError: a tensor reads back differently (nothing is kept).
    """
    check_dcp_target(dst)
    with temp_path(dst, folder=True) as stage:  # removed on any failure; a killed run's is removed next time
        res.tensors = res.stored = save_dcp(state, stage)
        if verify:
            with scratch_file(dst) as back:
                diff = dcp_round_trip_difference(state, stage, back)
            if diff:
                raise verify_fail(dst, diff)
            res.verified = True
        with signals_blocked():  # moved and recorded, or neither (the CLI's Interrupted line says which)
            if os.path.isdir(dst):
                os.rmdir(dst)
            os.replace(stage, dst)
            mark_committed(dst)
    res.files = sorted(os.path.join(dst, n) for n in os.listdir(dst))
    res.bytes_written = sum(os.path.getsize(p) for p in res.files)


# ------------------------------------------------------------------------------------------------ without torch
class _Unqualified(Exception):
    """The folder cannot be copied without torch (:func:`copy_dcp_to_torch` returns False, having written nothing)."""


def copy_dcp_to_torch(meta: DcpMetadata, out: BinaryIO) -> bool:
    """Write the DCP folder of ``meta`` to ``out`` as one torch file without torch (see the module docstring),
    laid out as ``dcp_to_torch_save`` lays it out (the ``planner_data`` nesting, every tensor contiguous, tagged
    ``cpu``). Returns False, having written nothing, when the folder does not qualify: a tensor in several chunks,
    a transformed record, lists in ``planner_data``, a non-tensor entry holding tensors, a record that does not
    match ``.metadata``, a tensor record whose ``byteorder`` is not ``little`` (torch.load swaps it on reading).

    Raises:
        CorruptCheckpointError: a record is not a ``torch.save`` zip, or is damaged.
    """
    st = _state(meta.root)
    sdm = st.get("state_dict_metadata") if type(st) is dict else None
    data = st.get("storage_data") if type(st) is dict else None
    if not isinstance(sdm, dict) or not isinstance(data, dict):
        return False
    records: dict[str, list[Any]] = {}
    for idx, info in data.items():
        ist = _state(idx)
        if type(ist) is not dict or not isinstance(ist.get("fqn"), str):
            return False
        records.setdefault(ist["fqn"], []).append(info)
    files: dict[str, BinaryIO] = {}
    try:
        root, copies = _copy_plan(meta, sdm, records, files)
        data_pkl = dumps(root, protocol=2)
        w = TorchZipWriter(out, "archive")
        w.begin_torch_save(data_pkl)
        for name, f, off, size, crc in copies:
            w.copy_record(name, f, off, size, None if crc < 0 else crc)
        w.end_torch_save()
        return True
    except (_Unqualified, PicklerError):
        return False
    except (CkptError, OSError):
        if out.tell() != 0:
            raise
        return False
    finally:
        for fh in files.values():
            fh.close()


_Copy = tuple[str, BinaryIO, int, int, int]  # (output record, source file, offset, size, CRC-32 or -1)


def _copy_plan(meta: DcpMetadata, sdm: dict[Any, Any], records: dict[str, list[Any]],
               files: dict[str, BinaryIO]) -> tuple[dict[str, Any], list[_Copy]]:
    """The output's root dict (``planner_data`` nesting) and the record copies that fill its storages, from the
    ``state_dict_metadata`` ``sdm`` and the storage records by FQN; opened files are left in ``files``.

    Raises:
        _Unqualified: an entry cannot be copied without torch.
        CorruptCheckpointError: a record is not a ``torch.save`` zip, or is damaged.
    """
    planner = meta.planner_data or {}
    root: dict[str, Any] = {}
    copies: list[_Copy] = []
    for entry in meta.entries:
        path = planner.get(entry.fqn, (entry.fqn,))
        if not isinstance(path, (tuple, list)) or not path or not all(isinstance(p, str) for p in path):
            raise _Unqualified
        infos = records.get(entry.fqn, [])
        found = _record(files, meta.folder, infos[0]) if len(infos) == 1 else None
        if found is None:
            raise _Unqualified
        f, blob = found
        what = f"{meta.folder}: the record of {entry.fqn!r}"
        node, storages, entries = _torch_save_record(blob, what)
        if entry.dtype is None:  # a non-tensor entry: its pickle, if it holds no tensor
            if storages:
                raise _Unqualified
            value = node
        else:
            value = _tensor_copy(entry, entry.dtype, sdm, node, storages, entries, f, blob, what, copies)
        where = root
        for p in path[:-1]:
            nxt = where.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise _Unqualified
            where = nxt
        where[path[-1]] = value
    return root, copies


def _tensor_copy(entry: DcpEntry, dtype: str, sdm: dict[Any, Any], node: Any, storages: dict[str, Any],
                 entries: list[Any], f: BinaryIO, blob: RecordSlice, what: str, copies: list[_Copy]) -> TensorNode:
    """The output tensor node of tensor ``entry`` (of ``dtype``) stored whole in one contiguous little-endian
    record, its copy appended to ``copies``.

    Raises:
        _Unqualified: several chunks, a record that does not match ``.metadata``, a big-endian record.
    """
    shape = entry.shape or ()
    if not _one_whole_chunk(sdm.get(entry.fqn), shape) or len(storages) != 1:
        raise _Unqualified
    nbytes = element_size(dtype) * _numel(shape)
    if not _is_whole_view(node, dtype, shape, nbytes):
        raise _Unqualified
    if record_byteorder(blob, entries, what) != "little":
        raise _Unqualified  # saved big-endian: torch.load swaps it, a byte copy would not
    rec = next((e for e in entries if e.name.endswith(f"/data/{node.storage.key}")), None)
    if rec is None or rec.method != 0 or rec.file_size < nbytes:
        raise _Unqualified
    skey = str(len(copies))
    copies.append((f"data/{skey}", f, blob.start + data_offset(blob, rec, what), nbytes,  # type: ignore[arg-type]
                   rec.crc if rec.file_size == nbytes else -1))
    return tensor_node(skey, dtype, shape, contiguous_stride(shape))


def _one_whole_chunk(tensor_meta: Any, shape: tuple[int, ...]) -> bool:
    """Whether a tensor's ``state_dict_metadata`` entry ``tensor_meta`` records one chunk holding all of ``shape``
    (sizes ``shape``, offsets 0)."""
    chunks = _state(tensor_meta) or {}
    chunk_list = chunks.get("chunks") if type(chunks) is dict else None
    if not isinstance(chunk_list, list) or len(chunk_list) != 1:
        return False
    cst = _state(chunk_list[0])
    return type(cst) is dict and _ints(cst.get("sizes")) == shape and not any(_ints(cst.get("offsets")) or ())


def _is_whole_view(node: Any, dtype: str, shape: tuple[int, ...], nbytes: int) -> bool:
    """Whether the record's tensor ``node`` is a contiguous view of ``dtype`` and ``shape`` at offset 0 of a storage
    (of ``nbytes`` bytes to copy)."""
    return (isinstance(node, TensorNode) and node.storage is not None and tensor_dtype(node) == dtype
            and node.shape == shape and node.storage_offset == 0
            and (not nbytes or node.stride == contiguous_stride(shape)))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s_ in shape:
        n *= s_
    return n
