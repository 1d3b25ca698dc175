"""``ckptool.inspect``: what a checkpoint holds, read without torch and without reading tensor bytes.

The format is recognised once, by :func:`ckptool.readers.open_checkpoint`, and the describer registered for it in
:data:`DESCRIBE` describes it (a :class:`~ckptool.readers.registry.Role` of this layer, each format's
:class:`Describer` registered at the end of this module: one of the ``inspect_*`` functions here, or of
:mod:`ckptool.ops.inspect.formats` / :mod:`ckptool.ops.inspect.megatron`, imported when a checkpoint of theirs is
met):

* torch zip / legacy / TorchScript files and plain pickles: the pickle as the node graph the readers layer read
  (:meth:`ckptool.readers.Opened.graph`, with :mod:`ckptool.formats.unpickler`: nothing imported or run), described
  by :func:`ckptool.ops.inspect.pickles.describe`; ``torch.package`` archives by
  :func:`ckptool.ops.inspect.pickles.package_info`;
* safetensors files from their JSON header, ``.pt2`` archives from their configs, DeepSpeed and DCP folders from
  their pickles and ``.metadata`` (:mod:`ckptool.ops.inspect.formats`);
* a sharded set (an ``*.index.json`` or the folder holding one) as one checkpoint from its shards
  (:func:`inspect_set`).

Every file's safety analysis is the one ``ckptool scan`` makes (:func:`ckptool.scanning.entry.scan_file`), reading
again only what the describer did not read. The result is a :class:`CheckpointInfo`
(:mod:`ckptool.ops.inspect.info`); bytes are counted one way everywhere, each storage once
(:mod:`ckptool.ops.inspect.totals`); the non-tensor entries (epoch, steps, learning rates, hyper-parameters, RNG
states) are described by :mod:`ckptool.ops.inspect.values`.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Protocol

from ckptool import _source as source
from ckptool._gc import gc_paused
from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats import plugin
from ckptool.model.allowlist import DANGEROUS
from ckptool.model.graph import too_deep
from ckptool.model.keys import check_key_lengths
from ckptool.model.quantization import PAIR_DTYPES, quantization_config
from ckptool.model.quantization import describe as describe_quantization
from ckptool.ops.inspect.info import (
    SCHEMA,
    ByteTotal,
    CheckpointInfo,
    GlobalInfo,
    StateDictInfo,
    TensorInfo,
    state_dict_info,
)
from ckptool.ops.inspect.pickles import already_read, describe, package_info, tensor_infos
from ckptool.ops.inspect.totals import byte_totals, device_bytes, merge_totals
from ckptool.ops.inspect.values import PreviewLimits, ValueInfo
from ckptool.readers import Opened, open_checkpoint
from ckptool.readers.registry import Role
from ckptool.scanning.entry import ScanResult, add_results, combine_results, scan_file
from ckptool.scanning.targets import iter_targets

__all__ = ["DESCRIBE", "SCHEMA", "ByteTotal", "CheckpointInfo", "Describer", "GlobalInfo", "StateDictInfo",
           "TensorInfo", "byte_totals", "describe", "inspect", "inspect_set", "inspect_tensors", "tensor_infos"]

class Describer(Protocol):
    """The ``describe`` role: what ``ckptool inspect`` says of a format's checkpoint ``opened`` (tensors read
    from pickles and headers, never their bytes), ``limits`` bounding the values previewed."""

    def __call__(self, opened: Opened, limits: PreviewLimits | None, /) -> CheckpointInfo: ...


#: each format's describer, registered at the end of this module (the readers layer names none); a format that
#: registers none is described from its reader's tensors (:func:`inspect_tensors`)
DESCRIBE: Role[Describer] = Role("describe", "ckptool.ops")


@gc_paused
def inspect(path: str | os.PathLike[str] | Opened, limits: PreviewLimits | None = None) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` without importing torch or reading tensor data.

    ``path``: a local path or URL, or a checkpoint already opened with :func:`ckptool.readers.open_checkpoint`
    (its pickle, if :meth:`~ckptool.readers.Opened.graph` read it already, is not read again; a later step of the
    same command can read it from there too).

    Returns a :class:`CheckpointInfo`: format (``torch-zip``, ``torch-legacy``, ``torchscript``, ``safetensors``,
    ``pickle``, ``torch-export`` (a ``.pt2``, kind ``exported_program``, see
    :func:`ckptool.ops.inspect.pt2.describe_pt2`),
    ``torch-package`` (kind ``package``: a ``torch.package`` archive, its pickles and modules in
    :attr:`CheckpointInfo.package`);
    for an ``*.index.json`` or a folder ``sharded-safetensors``, ``sharded-bin`` or ``dcp``, see
    :func:`inspect_set`; ``deepspeed`` for a DeepSpeed ZeRO folder,
    :func:`ckptool.ops.inspect.deepspeed.describe_deepspeed`), kind (``state_dict``, ``training_checkpoint``,
    ``full_model``,
    ``torchscript``, ``tensors``), every tensor (shared storages included), tensor counts per location tag, storage
    bytes per location tag and dtype (each storage once), the state_dicts found with their wrapper prefixes, the
    globals the pickle names with their ``weights_only=True`` status, and the non-tensor entries, as many as
    ``limits`` allow (default :class:`~ckptool.ops.inspect.values.PreviewLimits`; ``ALL_VALUES`` for more).

    Raises:
        UsageError: missing path, or a folder that is neither a DCP checkpoint nor holds one ``*.index.json``.
        NotACheckpointError: empty file, unknown bytes or another file type.
        CorruptCheckpointError: truncated, damaged or hostile file (see
            :func:`ckptool.formats.torchfile.read_checkpoint`), or a pickle nested deeper than ckptool can walk.
        UnsupportedError: tuple nesting too deep to read safely.
    """
    given = path.path if isinstance(path, Opened) else os.fspath(path)
    if not source.is_url(given):
        with source.local_reads(given):  # a small file: its format, pickle and scan read one open's bytes
            return _describe(path, limits)
    start = source.bytes_transferred()
    with source.object_reads(given):  # one HEAD, and no range fetched twice, however often the object is opened
        info = _describe(path, limits)
    info.bytes_read = source.bytes_transferred() - start
    return info


def _describe(path: str | os.PathLike[str] | Opened, limits: PreviewLimits | None) -> CheckpointInfo:
    """:func:`inspect` without the count of bytes read: the format recognised once, its describer run."""
    opened = path if isinstance(path, Opened) else open_checkpoint(path)
    describer = DESCRIBE.get(opened.format, inspect_tensors)
    info = describer(opened, limits)
    check_key_lengths((t.key for t in info.tensors), opened.path)  # the describers read headers themselves
    _scan_beside(opened, info)
    info.quantization = _quantization(info)
    return info


def _scan_beside(opened: Opened, info: CheckpointInfo) -> None:
    """A local model folder given as the path (its checkpoint one weights file or a sharded set in it): the files
    beside the checkpoint that ``ckptool scan FOLDER`` reads too (other pickles such as ``training_args.bin``, a
    config whose ``auto_map`` makes transformers run the folder's code), scanned and added to the checkpoint's
    scan, so that the verdict of ``inspect FOLDER`` and ``report FOLDER`` is the one ``scan FOLDER`` gives (issue
    46). A folder that is the checkpoint itself (DCP, DeepSpeed) is scanned as it is read."""
    folder = os.fspath(opened.path)
    if info.scan is None or opened.target == folder or source.is_url(folder) or not os.path.isdir(folder):
        return  # a file, or a folder read as a whole: no syscall for the first
    read = {os.path.realpath(t) for t, _ in iter_targets([opened.target])}
    beside = [t for t, _ in iter_targets([folder]) if os.path.realpath(t) not in read]
    if beside:
        add_results(info.scan, [(os.path.relpath(t, folder), scan_file(t)) for t in beside])
        info.scan.path = folder  # what the advice says to scan: the folder, not the weights file alone


def _quantization(info: CheckpointInfo) -> dict[str, Any] | None:
    """:func:`ckptool.model.quantization.describe` of ``info``'s tensors and the ``quantization_config`` of the
    ``config.json`` in its folder (a local model folder, the folder of an index or of a file; unreadable: none)."""
    path = info.path
    folder = None if source.is_url(path) else path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        quant = quantization_config(folder)
    except UnsupportedError:
        quant = None
    if quant is None and PAIR_DTYPES.isdisjoint({t.dtype for t in info.tensors}):
        return None  # what describe finds, without the table of every tensor (50,000 tensors: 20 ms)
    return describe_quantization({t.key: (t.dtype, tuple(t.shape), t.nbytes) for t in info.tensors}, quant)


def inspect_pickled(o: Opened, limits: PreviewLimits | None) -> CheckpointInfo:
    """A torch zip, legacy or TorchScript file or a plain pickle: its node graph, read once (the scan takes the
    ``data.pkl`` / plain pickle from it, :func:`ckptool.ops.inspect.pickles.already_read`)."""
    try:
        ck = o.described_graph()  # a plain pickle's long values stay in the file
        info = describe(ck, limits, o.spec)
    except RecursionError as e:
        raise CorruptCheckpointError(f"{o.target}: {too_deep(e)}") from None
    info.scan = scan_file(o.target, preparsed=already_read(ck, o.spec, info))
    _as_scanned(info)
    return info


def _as_scanned(info: CheckpointInfo) -> None:
    """Rate each global of ``info`` as its scan did where the rating depends on what the pickle does with it (a
    global held only as a value needs trust: :func:`ckptool.model.allowlist.rate_global`), so that inspect's table
    and its security verdict agree."""
    if info.scan is None:
        return
    scanned: dict[str, tuple[str, str]] = {}
    for g in info.scan.globals:  # the worst rating where a name is rated twice (a value here, called there)
        if g.name not in scanned or g.level == DANGEROUS:
            scanned[g.name] = (g.status, g.reason)
    for mine in info.globals:
        if mine.name in scanned and mine.level == DANGEROUS:
            mine.status, mine.reason = scanned[mine.name]


def inspect_tensors(o: Opened, _limits: PreviewLimits | None) -> CheckpointInfo:
    """The describer of a format that registers none (:data:`DESCRIBE`'s default): its reader's tensors
    (:meth:`ckptool.readers.Opened.state_dict`, a Source read from headers, no tensor bytes), each storage once
    (tensors sharing one share its key: the first user's name), its state_dicts
    (:meth:`~ckptool.readers.Opened.state_dicts`) and ``Source.metadata``, with the scan of ``scan_file``. Kind
    ``tensors``: one flat mapping; a keyed format's selected state_dict. A format whose tensors are not read raises
    its refusal (:class:`~ckptool.errors.UnsupportedError`)."""
    src = o.state_dict()
    keys: dict[int, str] = {}
    storages: dict[str, tuple[str, str, int]] = {}
    tensors = []
    for t in src.tensors:
        key = keys.setdefault(id(t.storage), t.name)
        storages.setdefault(key, (t.storage.location, t.storage.dtype, t.storage.nbytes))
        tensors.append(TensorInfo(t.name, list(t.shape), t.dtype, t.storage.location, t.nbytes, list(t.stride),
                                  t.offset, key, t.requires_grad))
    totals = byte_totals(tensors, storages)
    devices: dict[str, int] = {}
    for info_t in tensors:
        devices[info_t.device] = devices.get(info_t.device, 0) + 1
    folder = not source.is_url(o.target) and os.path.isdir(o.target)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _s, names in os.walk(o.target) for f in names
               ) if folder else source.file_size(o.target)
    info = CheckpointInfo(o.target, o.format, "tensors", size, tensors, devices, device_bytes(totals),
                          [state_dict_info(e.path, list(e.keys)) for e in o.state_dicts()], [],
                          storages=len(storages), metadata=src.metadata, totals=totals)
    info.scan = scan_file(o.target)
    return info


def inspect_package(o: Opened, limits: PreviewLimits | None) -> CheckpointInfo:
    info = package_info(o, limits)
    info.scan = scan_file(o.target)
    return info



def inspect_sharded(o: Opened, limits: PreviewLimits | None) -> CheckpointInfo:
    return _index_info(o, limits)


@gc_paused
def inspect_set(path: str | os.PathLike[str], limits: PreviewLimits | None = None) -> CheckpointInfo:
    """Describe a sharded set (``*.index.json`` or the folder holding one) or a DCP folder as one checkpoint,
    without torch and without reading tensor data. Returns a :class:`CheckpointInfo` with format
    ``sharded-safetensors`` / ``sharded-bin`` (torch shards, or a mix) / ``dcp``; a model folder holding only
    ``model.safetensors`` or ``pytorch_model.bin`` is that file's :func:`inspect`.

    For a sharded set every shard is inspected and its tensors listed (storage keys prefixed by the shard file);
    ``metadata`` holds the index's ``metadata`` (values that are not strings as JSON) and the shard count. For DCP
    the tensors come from ``.metadata`` (names, dtypes, shapes; sizes = elements * element size; DCP records no
    device, so ``cpu`` is shown, where ``dcp_to_torch_save`` puts them); non-tensor entries are listed under
    ``metadata["non_tensor_entries"]``, ``globals`` lists the globals of ``.metadata``, each rated as ``ckptool
    scan`` rates it there (DCP's own record classes and paths are safe in ``.metadata``; ``allowed`` is still
    ``torch.load(weights_only=True)``'s verdict, which refuses them), and ``values`` names the non-tensor entries
    (their bytes are not read). ``limits``: as :func:`inspect`.

    Raises:
        UsageError: a folder that is none of these; a missing shard.
        CorruptCheckpointError / NotACheckpointError: a damaged index, shard or ``.metadata``.
    """
    return _describe(path, limits)


def _index_info(o: Opened, limits: PreviewLimits | None) -> CheckpointInfo:
    """The sharded set ``o`` (its ``*.index.json``, read once by :meth:`ckptool.readers.Opened.index`): every
    shard's :func:`inspect`, added up."""
    path, index = o.target, o.index()
    tensors: list[TensorInfo] = []
    devices: dict[str, int] = {}
    globs: dict[str, GlobalInfo] = {}
    totals: list[list[ByteTotal]] = []
    values: list[ValueInfo] = []
    complete = True
    size = source.file_size(path)
    storages = 0
    fmts = set()
    scans: list[tuple[str, ScanResult]] = []
    for shard in index.shards:
        opened = open_checkpoint(index.shard_path(shard))
        info = inspect(opened, limits)
        if info.scan is not None:
            scans.append((shard, info.scan))
        fmts.add("torch" if opened.spec.pickled else "safetensors")
        size += info.size
        storages += info.storages
        for t in info.tensors:
            t.storage_key = f"{shard}:{t.storage_key}"
            tensors.append(t)
        for d, n in info.devices.items():
            devices[d] = devices.get(d, 0) + n
        totals.append(info.totals)
        values += info.values
        complete = complete and info.values_complete
        for g in info.globals:
            globs.setdefault(g.name, g)
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (index.metadata or {}).items()}
    meta["shards"] = str(len(index.shards))
    fmt = plugin("ckptool.readers.read_safetensors:set_format_name")(fmts)
    merged = merge_totals(totals)
    return CheckpointInfo(path, fmt, "state_dict", size, tensors, devices, device_bytes(merged),
                          [state_dict_info("", [t.key for t in tensors])], list(globs.values()), storages=storages,
                          metadata=meta, totals=merged, values=values, values_complete=complete,
                          scan=combine_results(path, fmt, scans))


for _fmt in ("torch-zip", "torch-legacy", "torchscript", "pickle"):
    DESCRIBE.register(_fmt, inspect_pickled)
DESCRIBE.register("torch-package", inspect_package)
DESCRIBE.register("sharded-safetensors", inspect_sharded)
DESCRIBE.register("sharded-bin", inspect_sharded)
# imported when a checkpoint of theirs is met (modules of this layer)
DESCRIBE.register_lazy("safetensors", "ckptool.ops.inspect.formats:inspect_safetensors")
DESCRIBE.register_lazy("dcp", "ckptool.ops.inspect.formats:inspect_dcp")
DESCRIBE.register_lazy("torch-export", "ckptool.ops.inspect.formats:inspect_pt2")
DESCRIBE.register_lazy("deepspeed", "ckptool.ops.inspect.formats:inspect_deepspeed")
DESCRIBE.register_lazy("megatron-legacy", "ckptool.ops.inspect.megatron:inspect_legacy")
DESCRIBE.register_lazy("megatron-dist", "ckptool.ops.inspect.megatron:inspect_dist")

if TYPE_CHECKING:  # the lazy describers, checked against the Protocol
    from ckptool.ops.inspect.formats import inspect_dcp, inspect_deepspeed, inspect_pt2, inspect_safetensors
    from ckptool.ops.inspect.megatron import inspect_dist, inspect_legacy

    _LAZY: tuple[Describer, ...] = (inspect_safetensors, inspect_dcp, inspect_pt2, inspect_deepspeed,
                                    inspect_legacy, inspect_dist)
