"""``ckptool inspect`` of the formats that are not one pickle: safetensors files (:func:`safetensors_info`),
``torch.export`` archives (:func:`pt2_info`), DeepSpeed ZeRO folders (:func:`deepspeed_info`) and
``torch.distributed.checkpoint`` folders (:func:`dcp_info`), each from its headers, configs or metadata (no tensor
bytes read, nothing imported or run). Each returns a :class:`~ckptool.ops.inspect.entry.CheckpointInfo` without
``scan``; the ``inspect_*`` describers registered in :data:`ckptool.ops.inspect.entry.DESCRIBE` add it, so that
this module and the format code it needs are imported only when such a checkpoint is inspected.
"""

from __future__ import annotations

import os
import re

from ckptool import _source as source
from ckptool.formats.dtypes import DTYPE_SIZES, contiguous_stride, numel, safetensors_dtype
from ckptool.model.allowlist import is_allowed
from ckptool.ops.inspect.deepspeed import describe_deepspeed
from ckptool.ops.inspect.info import CheckpointInfo, GlobalInfo, TensorInfo, rate_globals, state_dict_info
from ckptool.ops.inspect.pt2 import describe_pt2
from ckptool.ops.inspect.totals import byte_totals, device_bytes, one_storage_each
from ckptool.ops.inspect.values import PreviewLimits, ValueInfo
from ckptool.readers import Opened
from ckptool.readers.structures import DcpMetadata
from ckptool.scanning.entry import ScanResult, scan_file

__all__ = ["dcp_info", "deepspeed_info", "inspect_dcp", "inspect_deepspeed", "inspect_pt2", "inspect_safetensors",
           "pt2_info", "safetensors_info"]


def inspect_safetensors(o: Opened, _limits: PreviewLimits | None) -> CheckpointInfo:
    info = safetensors_info(o)
    info.scan = scan_file(o.target)
    return info


def inspect_pt2(o: Opened, _limits: PreviewLimits | None) -> CheckpointInfo:
    scan = scan_file(o.target)  # once: its globals are the archive's globals (describe_pt2)
    info = pt2_info(o, scan)
    info.scan = scan
    return info


def inspect_dcp(o: Opened, _limits: PreviewLimits | None) -> CheckpointInfo:
    info = dcp_info(o)
    info.scan = scan_file(o.target)
    return info


def inspect_deepspeed(o: Opened, _limits: PreviewLimits | None) -> CheckpointInfo:
    return deepspeed_info(o)


def deepspeed_info(o: Opened) -> CheckpointInfo:
    """A DeepSpeed ZeRO folder (:func:`ckptool.ops.inspect.deepspeed.describe_deepspeed`, its pickles read once by
    :meth:`ckptool.readers.Opened.zero`): the tensors of its consolidated state_dict (tied names share a storage
    key), the ZeRO facts in ``metadata``."""
    d = describe_deepspeed(o)
    tensors = [TensorInfo(t.name, list(t.shape), t.dtype, "cpu", t.nbytes, list(contiguous_stride(t.shape)), 0,
                          t.tied_to or t.name) for t in d.tensors]
    totals = one_storage_each([t for t in tensors if t.storage_key == t.key])
    for row in totals:
        row.tensors = sum(1 for t in tensors if (t.device, t.dtype) == (row.device, row.dtype))
    return CheckpointInfo(o.target, o.format, "training_checkpoint", d.size, tensors, {"cpu": len(tensors)},
                          device_bytes(totals), [state_dict_info("", [t.key for t in tensors])],
                          rate_globals(d.globals), storages=sum(r.storages for r in totals),
                          metadata=d.metadata, totals=totals)


def safetensors_info(o: Opened) -> CheckpointInfo:
    """A safetensors file, from its JSON header (:meth:`ckptool.readers.Opened.safetensors_header`): every tensor
    its own storage on ``cpu``, the header's ``__metadata__`` in ``metadata``."""
    header = o.safetensors_header()
    meta = header.metadata
    tensors = []
    for name, e in header.entries.items():
        begin, end = e["data_offsets"]
        shape = e["shape"]
        tensors.append(TensorInfo(name, shape, safetensors_dtype(e["dtype"]), "cpu", end - begin,
                                  list(contiguous_stride(shape)), 0, name))
    sds = [state_dict_info("", [t.key for t in tensors])]
    totals = one_storage_each(tensors)
    return CheckpointInfo(
        o.target, o.format, "tensors", source.file_size(o.target), tensors,
        {"cpu": len(tensors)} if tensors else {}, {"cpu": sum(t.nbytes for t in tensors)}, sds, [],
        storages=len(tensors), metadata=meta if isinstance(meta, dict) else None, totals=totals,
    )


def pt2_info(o: Opened, scan: ScanResult) -> CheckpointInfo:
    """A ``torch.export`` archive (:func:`ckptool.ops.inspect.pt2.describe_pt2`): its weights and constants, the
    program's signature in ``programs``, its versions in ``metadata``; the globals of its pickled members from
    ``scan``, the :func:`ckptool.scanning.entry.scan_file` of the same archive (read once)."""
    d = describe_pt2(o, scan)
    devices: dict[str, int] = {}
    for t in d.tensors:
        devices[t.device] = devices.get(t.device, 0) + 1
    totals = byte_totals(d.tensors, d.storages)
    return CheckpointInfo(o.target, o.format, "exported_program", d.archive.size, d.tensors, devices,
                          device_bytes(totals), [state_dict_info(p, keys) for p, keys in d.state_dicts.items()],
                          [GlobalInfo(g.name, is_allowed(g.name), g.status, g.reason) for g in d.globals],
                          storages=len(d.storages), metadata=d.metadata, totals=totals, values=d.values,
                          programs=d.programs)


_OPTIMIZER_STATE_RE = re.compile(r"(^|\.)state\.\d+$")  # an optimizer's per-parameter state: no state_dict


def _dcp_tensors(meta: DcpMetadata) -> tuple[list[TensorInfo], dict[str, list[str]]]:
    """The tensors of a DCP ``.metadata`` (contiguous, on ``cpu``, each its own storage) and the state_dicts they
    form: the parent path of each tensor in the nesting ``planner_data`` records -> its leaf names (an optimizer's
    per-parameter state, ``state.<n>``, is none)."""
    tensors = []
    groups: dict[str, list[str]] = {}
    for fqn, dt, shape in meta.entries:
        if dt is None:
            continue
        dims = shape or ()
        tensors.append(TensorInfo(fqn, list(dims), dt, "cpu", numel(dims) * DTYPE_SIZES.get(dt, 1),
                                  list(contiguous_stride(dims)), 0, fqn))
        comps = meta.planner_data.get(fqn) if meta.planner_data is not None else None
        if isinstance(comps, tuple) and comps:
            parent, leaf = ".".join(map(str, comps[:-1])), str(comps[-1])
        else:
            parent, leaf = "", fqn
        if not _OPTIMIZER_STATE_RE.search(parent):
            groups.setdefault(parent, []).append(leaf)
    return tensors, groups


def _folder_size(folder: str) -> int:
    """Bytes of the files directly in ``folder``."""
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
               if os.path.isfile(os.path.join(folder, n)))


def dcp_info(o: Opened) -> CheckpointInfo:
    """A ``torch.distributed.checkpoint`` folder, from its ``.metadata`` (:meth:`ckptool.readers.Opened.
    dcp_metadata`, read once): see :func:`ckptool.ops.inspect.entry.inspect_set`. The optimizer's per-parameter
    state (``state.<n>``) is not a state_dict."""
    meta, folder = o.dcp_metadata(), o.target
    tensors, groups = _dcp_tensors(meta)
    non_tensor = [e.fqn for e in meta.entries if e.dtype is None]
    extra = {"non_tensor_entries": ", ".join(non_tensor)} if non_tensor else {}
    if meta.version is not None:
        extra["dcp_version"] = meta.version
    kind = "state_dict" if len(groups) == 1 and not non_tensor else "training_checkpoint"
    nbytes = sum(t.nbytes for t in tensors)
    values = [ValueInfo(fqn, "object", "pickled in a .distcp file (not read)") for fqn in non_tensor]
    return CheckpointInfo(folder, o.format, kind, _folder_size(folder), tensors,
                          {"cpu": len(tensors)} if tensors else {}, {"cpu": nbytes} if tensors else {},
                          [state_dict_info(g, keys) for g, keys in groups.items()],
                          rate_globals(meta.globals, dcp_metadata=True),
                          storages=len(tensors), metadata=extra or None, totals=one_storage_each(tensors),
                          values=values)
