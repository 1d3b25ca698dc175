"""``ckptool inspect`` of a pickle read as a node graph: torch zip, legacy and TorchScript files, plain pickles
(:func:`describe`), and ``torch.package`` archives (:func:`package_info`).

The pickle is read by :mod:`ckptool.formats.torchfile` / :mod:`ckptool.formats.torch_package` with the
restricted unpickler (nothing imported or run); every tensor is listed from its node (:func:`tensor_infos`), the
state_dicts from :func:`ckptool.model.graph.find_state_dicts`, the non-tensor entries from
:mod:`ckptool.ops.inspect.values`. Tensor bytes are never read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any, cast

from ckptool.errors import CorruptCheckpointError
from ckptool.formats.dtypes import DTYPE_SIZES, numel, tensor_dtype
from ckptool.formats.nodes import ParameterNode, StorageRef, TensorNode, qualified_name
from ckptool.model.graph import (
    StateDictRef,
    depth_first,
    find_state_dicts,
    is_module,
    is_state_dict,
    mapping_items,
    node_children,
    parameter_requires_grad,
    tensor_leaf,
    too_deep,
)
from ckptool.ops.inspect.advice import PICKLE_LOAD, TORCH_JIT_LOAD, TORCH_LOAD
from ckptool.ops.inspect.info import (
    ByteTotal,
    CheckpointInfo,
    StateDictInfo,
    TensorInfo,
    rate_globals,
    state_dict_info,
)
from ckptool.ops.inspect.totals import byte_totals, device_bytes, storage_rows, storage_totals
from ckptool.ops.inspect.values import PreviewLimits, ValueInfo, value_infos
from ckptool.readers import FORMATS, Checkpoint, Format, Opened
from ckptool.scanning.pickles import Preparsed

__all__ = ["already_read", "counted_bytes", "describe", "kind_of", "package_info", "tensor_infos"]


def tensor_infos(root: Any, storages: dict[str, StorageRef] | None = None) -> list[TensorInfo]:
    """A :class:`TensorInfo` for every tensor reachable from ``root`` (see :func:`ckptool.model.graph.iter_tensors`);
    when ``storages`` is given, the storage of each is added to it by key.

    Raises:
        UnsupportedError: a tensor's storage class is unknown.
        CorruptCheckpointError: containers nested deeper than :data:`ckptool.model.graph.MAX_DEPTH`."""
    out: list[TensorInfo] = []
    append = out.append
    v2: Any = None  # the placeholder of torch._utils._rebuild_tensor_v2, once a tensor names it
    last_class: Any = None  # the storage class of the last tensor of the common case, and its (dtype, element size)
    element = ("", 1)
    ref: StorageRef | None
    for key, x in depth_first(root, "", node_children, tensor_leaf, TensorNode):
        if type(x) is TensorNode:
            t = x
            f = t.func
            if f is not v2 and f.node_type is TensorNode and f.name == "_rebuild_tensor_v2":
                v2 = f
            a = t.args
            if f is v2 and len(a) >= 4:  # the common case, fast: a plain strided tensor of a storage
                ref, size, stride = a[0], a[2], a[3]
                if type(ref) is StorageRef and type(size) is tuple and type(stride) is tuple:
                    if ref.storage_type is not last_class:
                        dtype = tensor_dtype(t)
                        element, last_class = (dtype, DTYPE_SIZES.get(dtype, 1)), ref.storage_type
                    nbytes = element[1]
                    for d in size:  # numel(shape) * element size, inline: this runs for every tensor
                        nbytes *= int(d)
                    if storages is not None:
                        storages.setdefault(ref.key, ref)
                    rg = a[4] if len(a) > 4 and type(a[4]) is bool else t.requires_grad
                    append(TensorInfo(key, list(size), element[0], ref.location, nbytes, list(stride), a[1], ref.key,
                                      rg))
                    continue
            rg = t.requires_grad
        else:  # a Parameter node holding a tensor node (tensor_leaf)
            p = cast(ParameterNode, x)
            t, rg = p.tensor, parameter_requires_grad(p)
        out.append(_general_info(key, t, rg, storages))
    return out


def _general_info(key: str, t: TensorNode, rg: bool, storages: dict[str, StorageRef] | None) -> TensorInfo:
    """The :class:`TensorInfo` of any tensor node (the properties of :class:`TensorNode`)."""
    ref, shape = t.storage, list(t.shape)
    dtype = tensor_dtype(t)
    nbytes = numel(shape) * DTYPE_SIZES.get(dtype, 1)
    if storages is not None and ref is not None:
        storages.setdefault(ref.key, ref)
    return TensorInfo(key, shape, dtype, ref.location if ref else "meta", nbytes, list(t.stride), t.storage_offset,
                      ref.key if ref else None, rg)

def kind_of(root: Any, sds: list[StateDictRef]) -> str:
    """What the pickle whose root is ``root`` holds (``sds``: its state_dicts, :func:`find_state_dicts`):
    ``state_dict``, ``full_model`` (a pickled module), ``training_checkpoint`` (a mapping holding state_dicts) or
    ``tensors``."""
    if sds and sds[0].obj is root and not sds[0].is_module:  # find_state_dicts already tested the root
        return "state_dict"
    if is_state_dict(root):
        return "state_dict"
    if is_module(root):
        return "full_model"
    if mapping_items(root) is not None and sds:
        return "training_checkpoint"
    return "tensors"

def already_read(ck: Checkpoint, spec: Format, info: CheckpointInfo | None = None) -> dict[str, Preparsed]:
    """The pickle of ``ck`` (a file of format ``spec``) that was read whole (the ``data.pkl`` of a torch zip, a
    plain pickle), by its ``where`` in :func:`ckptool.scanning.entry.scan_file` (its ``preparsed``), so that the
    scan does not read it a second time (for ``data.pkl``, not even its opcodes: where it ends is known).
    ``info``: :func:`describe` of ``ck``, whose tensors' bytes (:func:`counted_bytes`) spare the scan its own
    walk of the tensors."""
    names = [qualified_name(m, n) for m, n in ck.globals]
    counted = counted_bytes(ck, info.tensors, info.totals) if info is not None else None
    if spec.loaded_by == PICKLE_LOAD:
        return {"pickle at byte 0": (names, ck.root, None, counted)}
    rec = ck.record("data.pkl")
    if spec.loaded_by == TORCH_LOAD and rec is not None and rec.zipinfo is not None:
        return {rec.zipinfo.name: (names, ck.root, ck.pickle_size or None, counted)}
    return {}


def counted_bytes(ck: Checkpoint, tensors: list[TensorInfo], totals: list[ByteTotal]) -> tuple[int, int] | None:
    """The dense bytes of the tensors of ``ck.root`` (``tensors``: its :func:`tensor_infos`) that have a storage,
    and the bytes of their distinct storages (``totals``: the file's :func:`storage_totals`, which count every
    storage once): what scan's expansion note adds up (:data:`ckptool.scanning.pickles.Preparsed`); None where the
    list holds other roots' tensors too."""
    if ck.extra_roots:
        return None
    keys = {t.storage_key for t in tensors if t.storage_key is not None}
    if keys == ck.storages.keys():  # the common case: every storage is some tensor's, and the totals count them
        held = sum([b.bytes for b in totals])
    elif keys <= ck.storages.keys():
        held = sum(row[2] for row in storage_rows({k: ck.storages[k] for k in keys}).values())
    else:
        return None
    return sum([t.nbytes for t in tensors if t.storage_key is not None]), held


def _extra_roots(ck: Checkpoint, tensors: list[TensorInfo]) -> tuple[int, list[ByteTotal]]:
    """Add the tensors of the extra roots of ``ck`` (a TorchScript archive's ``constants.pkl``) to ``tensors``,
    keyed ``<root>.<key>``, their storages ``<root>/<key>``; return the number of storages and the byte totals."""
    storages = storage_rows(ck.storages)
    for name, extra in ck.extra_roots.items():
        refs: dict[str, StorageRef] = {}
        for t in tensor_infos(extra, refs):
            key = t.storage_key and f"{name}/{t.storage_key}"
            tensors.append(TensorInfo(**{**asdict(t), "key": f"{name}.{t.key}", "storage_key": key}))
        storages.update({f"{name}/{key}": row for key, row in storage_rows(refs).items()})
    return len(storages), byte_totals(tensors, storages)


def describe(ck: Checkpoint, limits: PreviewLimits | None = None, spec: Format | None = None) -> CheckpointInfo:
    """Build the :class:`CheckpointInfo` (without ``scan``) of an already-read
    :class:`~ckptool.formats.torchfile.Checkpoint` (``limits``: as :func:`ckptool.ops.inspect.entry.inspect`;
    ``spec``: its format's registry entry, by default the one ``ck.format`` names). Tensors of extra roots (a
    TorchScript archive's ``constants.pkl``) are keyed ``<root>.<key>``, their storages ``<root>/<key>``; a file
    loaded by ``torch.jit.load`` is of kind ``torchscript`` whatever it holds."""
    spec = spec if spec is not None else FORMATS[ck.format]
    tensors = tensor_infos(ck.root)
    if not ck.extra_roots:  # the common case: no row per storage
        n_storages, totals = len(ck.storages), storage_totals(tensors, ck.storages)
    else:
        n_storages, totals = _extra_roots(ck, tensors)
    sds = find_state_dicts(ck.root)
    sd_infos = [state_dict_info(sd.path, sd.keys()) for sd in sds]
    if tensors and len(totals) == 1 and totals[0].tensors == len(tensors):  # one location tag and dtype for all
        devices = {tensors[0].device: len(tensors)}
    else:  # tensors per location tag, in order of first use
        devices = dict(Counter([t.device for t in tensors]))
    script = spec.loaded_by == TORCH_JIT_LOAD  # a TorchScript archive: its values are the program's
    kind = "torchscript" if script else kind_of(ck.root, sds)
    names = [qualified_name(m, n) for m, n in ck.globals]
    # TorchScript's own unpickler resolves its names where the archive holds constants.pkl (as scan rates them)
    globs = rate_globals(names, torchscript=ck.record("constants.pkl") is not None)
    values, complete = ([], True) if script else value_infos(
        ck.root, [sd.obj for sd in sds], limits or PreviewLimits())
    return CheckpointInfo(ck.path, ck.format, kind, ck.size, tensors, devices, device_bytes(totals), sd_infos, globs,
                          storages=n_storages, totals=totals, values=values, values_complete=complete,
                          weights_only_refusal=ck.weights_only_refusal)


def package_info(o: Opened, limits: PreviewLimits | None) -> CheckpointInfo:
    """The :class:`CheckpointInfo` (without ``scan``) of the ``torch.package`` archive ``o`` (its pickles read once,
    by :meth:`ckptool.readers.Opened.package`): the tensors of every pickle, keyed ``<member>:<key>``
    (``weights/sd.pkl:fc.weight``), their storages shared across pickles as the archive shares them; the pickles,
    modules and extern modules in ``package``, its versions in ``metadata``. ``limits``: as
    :func:`ckptool.ops.inspect.entry.inspect`.

    Raises:
        CorruptCheckpointError: a damaged archive (see :func:`ckptool.formats.torch_package.read_package`) or a
            pickle nested deeper than ckptool can walk.
    """
    path = o.target
    try:
        pkg = o.package()
        tensors: list[TensorInfo] = []
        sd_infos: list[StateDictInfo] = []
        values: list[ValueInfo] = []
        complete, resources, names = True, [], {}
        for r in pkg.resources:
            mine = tensor_infos(r.root)
            for t in mine:
                t.key = f"{r.member}:{t.key}"
            sds = find_state_dicts(r.root)
            sd_infos += [state_dict_info(f"{r.member}:{sd.path}", sd.keys()) for sd in sds]
            vals, done = value_infos(r.root, [sd.obj for sd in sds], limits or PreviewLimits())
            values += [ValueInfo(f"{r.member}:{v.path}", v.type, v.shown, v.value, v.exact) for v in vals]
            complete = complete and done
            resources.append({"member": r.member, "package": r.package, "resource": r.resource,
                              "kind": kind_of(r.root, sds), "tensors": len(mine), "globals": r.globals})
            tensors += mine
            names.update(dict.fromkeys(r.globals))
    except RecursionError as e:
        raise CorruptCheckpointError(f"{path}: {too_deep(e)}") from None
    totals = storage_totals(tensors, pkg.storages)
    devices = dict(Counter(t.device for t in tensors))
    return CheckpointInfo(path, o.format, "package", pkg.size, tensors, devices,
                          device_bytes(totals), sd_infos, rate_globals(names),
                          storages=len(pkg.storages), totals=totals, values=values, values_complete=complete,
                          metadata={"python_version": pkg.python_version, "version": pkg.version},
                          package={"resources": resources, "modules": pkg.modules,
                                   "extern_modules": pkg.extern_modules, "python_version": pkg.python_version,
                                   "version": pkg.version})
