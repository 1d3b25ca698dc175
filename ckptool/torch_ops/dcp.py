"""``torch.distributed.checkpoint`` (DCP) through torch's own machinery, for ``ckptool convert``.

In: :func:`dcp_to_torch_file` streams the folder into one torch file tensor by tensor (torch's DCP reader with
``_EmptyStateDictLoadPlanner(keys=...)``, a batch of at most :data:`BATCH_BYTES` at a time, written by ckptool's
:class:`~ckptool.formats.torchzip.TorchZipWriter` after a pickle built from ``.metadata``), so memory stays
bounded by the batch (or the largest tensor) whatever the checkpoint's size; a layout it cannot stream (list
containers in ``planner_data``, a non-tensor value that holds more than plain Python data) goes whole through
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``. Out: ``torch.distributed.checkpoint.save``
with ``no_dist=True`` (no process group needed). ``format_utils.torch_save_to_dcp`` is not used: it would
``torch.load`` the source with ``weights_only=False``. The caller checks a DCP folder's globals before any of this
runs (torch unpickles ``.metadata`` without restriction).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import IO, Any, BinaryIO, cast

from ckptool.errors import CkptError, CorruptCheckpointError, UnsupportedError
from ckptool.formats.dtypes import contiguous_stride
from ckptool.model.tensor_nodes import tensor_node
from ckptool.readers.structures import DcpEntry
from ckptool.torch_ops.cast import tensor_buffer
from ckptool.torch_ops.convert_verify import flat_tensors, same_tensors
from ckptool.writers.encoders import PicklerError, TorchZipWriter, dumps

#: tensor bytes read from the DCP folder per batch when it is streamed into one file (64 MiB)
BATCH_BYTES = 64 << 20


def _dcp_load(folder: str, keys: set[str]) -> dict[str, Any]:
    """The entries ``keys`` (FQNs) of the DCP folder, nested as ``planner_data`` says (torch's own reader)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(keys=keys),  # type: ignore[no-untyped-call]
                     no_dist=True)
    return sd


def _at(root: dict[str, Any], path: tuple[str, ...]) -> Any:
    for p in path:
        root = root[p]
    return root


def _put(root: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        root = root.setdefault(p, {})
    root[path[-1]] = value


def stream_dcp_to_torch_file(folder: str, out: BinaryIO, batch_bytes: int = BATCH_BYTES) -> bool:
    """Write the DCP checkpoint in ``folder`` to the binary file ``out`` as ``dcp_to_torch_save`` would (the same
    nested dicts, every tensor contiguous on ``cpu``), reading at most ``batch_bytes`` of tensors at a time (one
    larger tensor alone). Returns False, having written nothing, when the layout cannot be streamed (see the
    module docstring).
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(folder).read_metadata()
    planner = md.planner_data or {}
    paths: dict[str, tuple[str, ...]] = {}
    for fqn in md.state_dict_metadata:
        path = tuple(planner.get(fqn, (fqn,)))
        if not path or not all(isinstance(p, str) for p in path):
            return False  # list containers: dcp_to_torch_save rebuilds those
        paths[fqn] = path
    tensors = [(fqn, m) for fqn, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)]
    others = {fqn for fqn in md.state_dict_metadata if not isinstance(md.state_dict_metadata[fqn],
                                                                         TensorStorageMetadata)}
    values = _dcp_load(folder, others) if others else {}
    root: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for fqn in md.state_dict_metadata:
        m = md.state_dict_metadata[fqn]
        if isinstance(m, TensorStorageMetadata):
            shape = tuple(m.size)
            keys[fqn] = str(len(keys))
            value = tensor_node(keys[fqn], str(m.properties.dtype).removeprefix("torch."), shape,
                                contiguous_stride(shape))
        else:
            value = _at(values, paths[fqn])
        try:
            _put(root, paths[fqn], value)
        except (TypeError, AttributeError):  # a path through a non-dict value
            return False
    try:
        data_pkl = dumps(root, protocol=2)
    except PicklerError:  # a value holding more than plain Python data
        return False
    w = TorchZipWriter(out, "archive")
    w.begin_torch_save(data_pkl)
    i = 0
    while i < len(tensors):
        batch: list[str] = []
        size = 0
        while i < len(tensors) and (not batch or size + _nbytes(tensors[i][1]) <= batch_bytes):
            batch.append(tensors[i][0])
            size += _nbytes(tensors[i][1])
            i += 1
        loaded = _dcp_load(folder, set(batch))
        for fqn in batch:
            w.write_bytes(f"data/{keys[fqn]}", tensor_buffer(_at(loaded, paths[fqn])))  # type: ignore[arg-type]
        del loaded
    w.end_torch_save()
    return True


def _nbytes(m: Any) -> int:
    n = m.properties.dtype.itemsize
    for s in m.size:
        n *= s
    return int(n)


def dcp_to_torch_file(folder: str, out: str | IO[bytes]) -> None:
    """Write the DCP checkpoint in ``folder`` as one ``torch.save`` file to the path or binary file ``out``:
    streamed tensor by tensor (:func:`stream_dcp_to_torch_file`) into a file object, else whole through
    ``dcp_to_torch_save``.

    Raises:
        CorruptCheckpointError: torch could not read the folder (incomplete or damaged).
        UnsupportedError: a non-tensor entry holds tensors tagged for a device this machine lacks (torch's
            ``CheckpointException``, a ``BaseException``, names "on a CUDA device"): the route is ``ckptool remap``.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    try:
        if not isinstance(out, str):
            start = out.tell()
            if stream_dcp_to_torch_file(folder, cast(BinaryIO, out)):
                return
            out.seek(start)
        dcp_to_torch_save(folder, out)  # type: ignore[arg-type]  # torch.save inside takes a file object too
    except (CkptError, MemoryError, ImportError):
        raise
    except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
        if "on a CUDA device" in str(e) or "on a CUDA device" in repr(getattr(e, "failures", "")):
            raise UnsupportedError(
                f"{folder}: a non-tensor entry holds tensors tagged for a CUDA device, which this machine lacks "
                "(DCP loads such entries without map_location); re-tag them first: `ckptool remap "
                f"{folder} --to cpu -o {folder.rstrip('/')}.cpu/`, then convert that folder") from e
        raise CorruptCheckpointError(f"{folder}: torch.distributed.checkpoint could not read it "
                                     f"({_reason(e)}); the folder is incomplete or damaged") from e


def _reason(e: BaseException) -> str:
    """``Type: first line`` of what torch raised: of the first rank's exception for a ``CheckpointException``
    (whose own text is the ranks, then each one's traceback), never a traceback."""
    failures = getattr(e, "failures", None)
    first = next(iter(failures.values()), None) if isinstance(failures, dict) else None
    inner = first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else first
    if isinstance(inner, BaseException):
        e = inner
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


def save_dcp(state: dict[str, Any], folder: str) -> int:
    """Save ``state`` as a DCP checkpoint into the (empty) ``folder`` in this process; returns its tensor count."""
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        save(state, checkpoint_id=folder, no_dist=True)
    return len(flat_tensors(state))


def dcp_round_trip_difference(state: dict[str, Any], folder: str, scratch: str) -> str | None:
    """Read the DCP checkpoint in ``folder`` back (``dcp_to_torch_save`` into the file ``scratch``, then
    ``torch.load(weights_only=True)``) and compare every tensor with ``state``: None when all are equal (dtype,
    shape, bytes), else the first difference."""
    import torch

    dcp_to_torch_file(folder, scratch)
    again = torch.load(scratch, map_location="cpu", weights_only=True)
    return same_tensors(flat_tensors(state), flat_tensors(again))


def metadata_difference(path: str, entries: Sequence[DcpEntry], verify: bool) -> tuple[int, str | None]:
    """Open the torch file ``path`` written from a DCP folder (``torch.load(weights_only=True, mmap=True)``);
    returns its tensor count and, with ``verify``, the first tensor of ``entries`` (the folder's ``.metadata``)
    that is missing or has another dtype or shape (None when every one matches)."""
    import torch

    flat = flat_tensors(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    if verify:
        for fqn, dt, shape in entries:
            if dt is None:
                continue
            t = flat.get(fqn)
            if t is None or str(t.dtype) != f"torch.{dt}" or tuple(t.shape) != shape:
                return len(flat), f"{fqn!r} is missing or differs from the DCP metadata ({dt} {list(shape or ())})"
    return len(flat), None
