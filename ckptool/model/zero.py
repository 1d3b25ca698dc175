"""DeepSpeed ZeRO checkpoints as data: what the model- and optimizer-state pickles say, and the consolidation plan.

The plan follows ``deepspeed/utils/zero_to_fp32.py`` (DeepSpeed 0.19) step by step, without torch and without
reading a rank's partition as a whole: every output tensor is a list of byte ranges (:class:`~ckptool.formats.
segments.Segment`) of the ranks' flat fp32 partitions, so a writer streams each tensor from the files once.

* **Order and content** (``_get_fp32_state_dict_from_zero{2,3}_checkpoint``): the buffers of rank 0's ``module``
  whose names are in ``buffer_names`` (in ``module`` order; floating ones as float32, ``v.float()``), then the
  frozen parameters (unless excluded), then the trainable parameters of ``param_shapes`` (groups in order), then
  each ``shared_params`` entry ``name -> kept name`` as the same tensor as the kept one.
* **ZeRO-1/2** (``_zero2_merge_trainable_params``): per parameter group, the ranks' tensors of
  ``single_partition_of_fp32_groups`` concatenated in rank order form one vector; its parameters follow one another
  from offset 0, each followed by its ``param_alignment_paddings`` entry when the file records them. A parameter
  may straddle two ranks. The consumed length, rounded up to a multiple of ``2 * world_size``, must equal the
  vector's length so rounded. Frozen parameters are rank 0's ``frozen_param_fragments``, whole.
* **ZeRO-3** (``_zero3_merge_trainable_params``, ``GatheredTensor``): each rank's ``fp32_flat_groups`` tensors are
  one flat space (groups concatenated); a parameter of ``n`` elements takes ``ceil(n / world_size)`` elements at
  the same offset of every rank's space, the ranks' slices are concatenated and cut to ``n``. The offsets, times
  the world size, must add up to the whole space. Frozen parameters: each rank's fragment concatenated, cut to
  ``n``.

Output dtypes are those ``zero_to_fp32`` returns: the fp32 master weights, frozen parameters in their saved dtype,
buffers widened to float32 when floating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats.deepspeed import DeepSpeedFolder, FlatBytes, read_files, tensor_bytes
from ckptool.formats.dtypes import DTYPE_SIZES, numel
from ckptool.formats.nodes import GlobalMeta, ReduceNode
from ckptool.formats.tensors import Segment
from ckptool.formats.torchfile import Checkpoint
from ckptool.model.graph import mapping_items, unwrap_tensor

__all__ = ["ZeroCheckpoint", "ZeroTensor", "plan", "zero_checkpoint"]

_FLOAT = ("float16", "bfloat16", "float32", "float64")
_WIDEN = ("float16", "bfloat16")


@dataclass
class ZeroTensor:
    """One tensor of the consolidated state_dict: ``name``, ``shape``, output ``dtype``, ``kind`` (``buffer``,
    ``frozen``, ``param``, ``tied``), its bytes as ``segments`` in order, and for ``tied`` the name it shares its
    data with (``tied_to``: same segments)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    segments: list[Segment]
    tied_to: str | None = None

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass
class ZeroCheckpoint:
    """What a ZeRO tag folder holds, read from its pickles (:func:`zero_checkpoint`).

    ``stage`` (1, 2, 3), ``world_size`` (data-parallel ranks = optimizer-state files), ``ds_version``;
    ``weights_dtype``: the dtype of the module's parameters as saved (bf16/fp16 training keeps them 16-bit);
    ``master_dtype``: the dtype of the flat partitions (float32); ``param_shapes`` one ``{name: shape}`` per group;
    ``buffers`` ``[(name, FlatBytes)]`` from rank 0's module; ``frozen`` ``{name: shape}``; ``frozen_fragments`` per
    model-state file ``{name: FlatBytes}``; ``shared`` ``{name: kept name}``; ``groups`` per rank the flat fp32
    tensors; ``alignment_paddings`` per group (ZeRO-1/2, when recorded); ``optimizer_state`` the per-parameter
    optimizer state keys (``exp_avg``...); ``globals`` every ``(module, name)`` the pickles read name.
    """

    ds: DeepSpeedFolder
    stage: int
    world_size: int
    ds_version: str | None
    weights_dtype: str | None
    master_dtype: str
    param_shapes: list[dict[str, tuple[int, ...]]]
    buffers: list[tuple[str, FlatBytes]]
    frozen: dict[str, tuple[int, ...]]
    frozen_fragments: list[dict[str, FlatBytes]]
    shared: dict[str, str]
    groups: list[list[FlatBytes]]
    alignment_paddings: list[list[int]] | None = None
    optimizer_state: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    globals: list[tuple[str, str]] = field(default_factory=list)
    #: module entries that the consolidation does not cover (ZeRO-1 saves no frozen_param_shapes, so its frozen
    #: parameters exist only as the module's saved weights; zero_to_fp32 leaves them out too)
    uncovered: list[str] = field(default_factory=list)


def _items(obj: object, where: str, what: str) -> list[tuple[Any, Any]]:
    items = mapping_items(obj)
    if items is None:
        raise CorruptCheckpointError(f"{where}: {what} is not a mapping; not a DeepSpeed checkpoint ckptool can read")
    return items


def _shape(obj: object, where: str, name: str) -> tuple[int, ...]:
    """A ``torch.Size((...))`` node (or a tuple / list of ints) as a tuple."""
    if isinstance(obj, ReduceNode) and obj.global_name == "torch.Size" and obj.args:
        obj = obj.args[0]
    if isinstance(obj, (tuple, list)) and all(type(d) is int and d >= 0 for d in obj):
        return tuple(obj)
    raise CorruptCheckpointError(f"{where}: the shape of {name!r} is not a torch.Size; the file is damaged")


def _enum_int(obj: object) -> int | None:
    """``ZeroStageEnum(2)`` (an enum pickled as ``cls(value)``) or a plain int, as an int."""
    if type(obj) is int:
        return obj
    if isinstance(obj, ReduceNode) and isinstance(obj.func, GlobalMeta) and len(obj.args) == 1 \
            and type(obj.args[0]) is int:
        return int(obj.args[0])
    return None


def _root(ck: Checkpoint) -> dict[Any, Any]:
    items = mapping_items(ck.root)
    if items is None:
        raise CorruptCheckpointError(f"{ck.path} does not hold a dict; not a DeepSpeed checkpoint file")
    return dict(items)


def _flat(ck: Checkpoint, node: object, what: str) -> FlatBytes:
    t = unwrap_tensor(node)
    return tensor_bytes(ck, t if t is not None else node, what)


def zero_checkpoint(ds: DeepSpeedFolder) -> ZeroCheckpoint:
    """What the DeepSpeed ZeRO tag folder ``ds`` (found by :func:`~ckptool.formats.deepspeed.find_deepspeed`,
    through :func:`ckptool.readers.read_deepspeed.read_zero`) holds: the pickles of every model- and
    optimizer-state file, read with the restricted unpickler (deepspeed is not imported, nothing runs; tensor data
    is not read), checked as ``zero_to_fp32`` checks them.

    Raises:
        CorruptCheckpointError / UnsupportedError: a file that is not what ``zero_to_fp32`` expects (no
            ``buffer_names``, no ``zero_stage``, a rank file missing) is corrupt; ZeRO stage 0 and checkpoints saved
            without ZeRO optimizer state are unsupported.
    """
    optim = read_files(ds.optim_files)
    osd = [_optimizer_state_dict(ck) for ck in optim]
    stage = _validate_stage(osd[0], optim[0].path, ds.folder)
    world = _validate_world_size(osd[0], optim, ds.folder)
    groups = _flat_groups(optim, osd, stage)
    models = _model_states(ds, stage, world)
    m0 = _root(models[0])
    _validate_model_state(m0, models[0].path)
    return _zero_checkpoint(ds, stage, world, osd[0], groups, [*models, *optim], models, m0)


def _optimizer_state_dict(ck: Checkpoint) -> dict[Any, Any]:
    """The ``optimizer_state_dict`` of one ``*_optim_states.pt`` file."""
    items = mapping_items(_root(ck).get("optimizer_state_dict"))
    if items is None:
        raise CorruptCheckpointError(f"{ck.path} holds no optimizer_state_dict; not a ZeRO optimizer-state file")
    return dict(items)


def _validate_stage(first: dict[Any, Any], where: str, folder: str) -> int:
    """The ZeRO stage rank 0's optimizer state records (1, 2 or 3)."""
    stage = _enum_int(first.get("zero_stage"))
    if stage is None:
        raise CorruptCheckpointError(f"{where} records no zero_stage: it is not a ZeRO checkpoint "
                                     "(zero_to_fp32 refuses it too)")
    if stage not in (1, 2, 3):
        raise UnsupportedError(f"{folder}: ZeRO stage {stage}: only stages 1, 2 and 3 keep flat fp32 partitions "
                               "to consolidate")
    return stage


def _validate_world_size(first: dict[Any, Any], optim: list[Checkpoint], folder: str) -> int:
    """The data-parallel rank count (``partition_count``), which must equal the number of optimizer-state files."""
    pc = first.get("partition_count")
    world = max(pc) if isinstance(pc, list) and pc and all(type(x) is int for x in pc) else pc
    if type(world) is not int or world < 1:
        raise CorruptCheckpointError(f"{optim[0].path}: partition_count {pc!r} is not a rank count")
    if world != len(optim):
        raise CorruptCheckpointError(
            f"{folder}: the checkpoint was saved by {world} ranks but holds {len(optim)} *_optim_states.pt files; "
            "a rank's file is missing or left over from another save: copy the whole folder again")
    return world


def _flat_groups(optim: list[Checkpoint], osd: list[dict[Any, Any]], stage: int) -> list[list[FlatBytes]]:
    """Per rank, its flat fp32 partitions (``fp32_flat_groups`` under ZeRO-3, else
    ``single_partition_of_fp32_groups``); every rank holds as many as rank 0."""
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    groups: list[list[FlatBytes]] = []
    for r, (ck, d) in enumerate(zip(optim, osd)):
        gs = d.get(key)
        if not isinstance(gs, list):
            raise CorruptCheckpointError(f"{ck.path} holds no {key}; not a ZeRO stage {stage} optimizer-state file")
        groups.append([_flat(ck, g, f"{key}[{i}] of rank {r}") for i, g in enumerate(gs)])
        if len(groups[-1]) != len(groups[0]):
            raise CorruptCheckpointError(f"{ck.path}: {len(groups[-1])} fp32 groups, rank 0 has {len(groups[0])}")
    return groups


def _model_states(ds: DeepSpeedFolder, stage: int, world: int) -> list[Checkpoint]:
    """The model-state files the consolidation reads: every rank's under ZeRO-3, else rank 0's."""
    model_paths = ds.model_files if stage == 3 else ds.model_files[:1]
    if stage <= 2:
        rank0 = [p for p in ds.model_files if p.endswith("mp_rank_00_model_states.pt")
                 and "zero_pp_rank" not in p.rsplit("/", 1)[-1]]
        model_paths = rank0[:1] or model_paths
    models = read_files(model_paths)
    if stage == 3 and len(models) != world:
        raise CorruptCheckpointError(f"{ds.folder}: ZeRO-3 saved by {world} ranks but holds {len(models)} "
                                     "*_model_states.pt files; copy the whole folder again")
    return models


def _validate_model_state(m0: dict[Any, Any], where: str) -> None:
    """Rank 0's model state records ``buffer_names`` and ``param_shapes`` (saved with ZeRO optimizer state)."""
    if "buffer_names" not in m0:
        raise CorruptCheckpointError(f"{where} records no buffer_names: not a DeepSpeed model-state file")
    if m0.get("param_shapes") is None:
        raise UnsupportedError(f"{where} records no param_shapes: the checkpoint was saved without ZeRO optimizer "
                               "state; its module entry is already a full state_dict (convert that file instead)")


def _zero_checkpoint(ds: DeepSpeedFolder, stage: int, world: int, first: dict[Any, Any],
                     groups: list[list[FlatBytes]], files: list[Checkpoint], models: list[Checkpoint],
                     m0: dict[Any, Any]) -> ZeroCheckpoint:
    """Fill a :class:`ZeroCheckpoint` from the validated optimizer state (rank 0's ``first``, ``groups``) and
    model states (``models``, rank 0's root ``m0``); ``files`` are all the files read (for ``globals``)."""
    where = models[0].path
    bnames = set(m0.get("buffer_names") or [])
    module = _items(m0.get("module"), where, "module")
    buffers = [(k, _flat(models[0], v, f"buffer {k!r}")) for k, v in module if k in bnames]
    param_shapes = _param_shapes(m0["param_shapes"], where)
    frozen = _named_shapes(m0.get("frozen_param_shapes"), where, "frozen_param_shapes")
    fragments = [_frozen_fragments(ck) for ck in models]
    shared_node = m0.get("shared_params")
    shared = {str(k): str(v) for k, v in _items(shared_node, where, "shared_params")} \
        if shared_node is not None else {}
    covered = bnames | set(frozen) | set(shared) | {k for g in param_shapes for k in g}
    version = m0.get("ds_version")
    return ZeroCheckpoint(
        ds=ds, stage=stage, world_size=world, ds_version=str(version) if version is not None else None,
        weights_dtype=next((tensor_bytes_dtype(models[0], v) for k, v in module if k not in bnames), None),
        master_dtype=groups[0][0].dtype if groups[0] else "float32", param_shapes=param_shapes, buffers=buffers,
        frozen=frozen, frozen_fragments=fragments, shared=shared, groups=groups,
        alignment_paddings=_alignment_paddings(first), optimizer_state=_optimizer_state_keys(first),
        extra={k: m0.get(k) for k in ("global_steps", "global_samples", "dp_world_size")},
        globals=list(dict.fromkeys(g for ck in files for g in ck.globals)),
        uncovered=[str(k) for k, _ in module if k not in covered])


def _param_shapes(shapes_list: object, where: str) -> list[dict[str, tuple[int, ...]]]:
    """``param_shapes``: one ``{name: shape}`` per parameter group."""
    if not isinstance(shapes_list, list):
        raise CorruptCheckpointError(f"{where}: param_shapes is not a list of groups; the file is damaged")
    return [{str(k): _shape(v, where, str(k)) for k, v in _items(g, where, "param_shapes")} for g in shapes_list]


def _named_shapes(node: object, where: str, what: str) -> dict[str, tuple[int, ...]]:
    """A ``{name: torch.Size}`` entry (``frozen_param_shapes``) as ``{name: shape}``; {} when absent."""
    if node is None:
        return {}
    return {str(k): _shape(v, where, str(k)) for k, v in _items(node, where, what)}


def _frozen_fragments(ck: Checkpoint) -> dict[str, FlatBytes]:
    """The ``frozen_param_fragments`` of one model-state file; {} when absent."""
    node = _root(ck).get("frozen_param_fragments")
    if node is None:
        return {}
    return {str(k): _flat(ck, v, f"frozen fragment {k!r}") for k, v in _items(node, ck.path, "frozen_param_fragments")}


def _alignment_paddings(first: dict[Any, Any]) -> list[list[int]] | None:
    """``param_alignment_paddings`` (ZeRO-1/2, one list of ints per group) when recorded and well formed."""
    pads = first.get("param_alignment_paddings")
    ok = isinstance(pads, list) and all(isinstance(g, list) and all(type(x) is int for x in g) for g in pads)
    return pads if ok else None


def _optimizer_state_keys(first: dict[Any, Any]) -> list[str]:
    """The per-parameter optimizer state keys (``exp_avg``, ``exp_avg_sq``...) in first-seen order."""
    inner = mapping_items(first.get("base_optimizer_state") or first.get("optimizer_state_dict"))
    state_keys: list[str] = []
    for k, v in inner or []:
        if k == "state":
            for _pid, per in mapping_items(v) or []:
                state_keys += [str(x) for x, _ in mapping_items(per) or [] if str(x) not in state_keys]
    return state_keys


def tensor_bytes_dtype(ck: Checkpoint, node: object) -> str | None:
    """The dtype of a module entry (a placeholder tensor under ZeRO-3), or None."""
    t = unwrap_tensor(node)
    if t is None:
        return None
    try:
        return tensor_bytes(ck, t, "a module entry").dtype
    except CorruptCheckpointError:
        return None


def _segments(parts: list[FlatBytes], start: int, count: int) -> list[Segment]:
    """Elements ``[start, start + count)`` of the concatenation of ``parts`` as byte segments."""
    out: list[Segment] = []
    pos = 0
    for p in parts:
        lo, hi = max(start, pos), min(start + count, pos + p.numel)
        if lo < hi:
            es = DTYPE_SIZES[p.dtype]
            out.append(Segment(p.path, p.offset + (lo - pos) * es, (hi - lo) * es))
        pos += p.numel
    got = sum(s.nbytes for s in out)
    if parts and got != count * DTYPE_SIZES[parts[0].dtype]:
        raise CorruptCheckpointError(f"{parts[0].path}: the flat partitions hold fewer elements than the parameters "
                                     "need; the checkpoint is damaged or incomplete")
    return out


def _buffer(name: str, fb: FlatBytes) -> ZeroTensor:
    if fb.dtype in _WIDEN:  # zero_to_fp32: v.float() if v.is_floating_point()
        return ZeroTensor(name, fb.shape, "float32", "buffer", [Segment(fb.path, fb.offset, 2 * fb.nbytes, fb.dtype)])
    if (fb.dtype in _FLOAT and fb.dtype != "float32") or fb.dtype.startswith("float8"):
        raise UnsupportedError(f"{fb.path}: buffer {name!r} is {fb.dtype}; zero_to_fp32 narrows it to float32, which "
                               "ckptool does not do without torch")
    return ZeroTensor(name, fb.shape, fb.dtype, "buffer", [Segment(fb.path, fb.offset, fb.nbytes)])


def plan(z: ZeroCheckpoint, exclude_frozen: bool = False) -> list[ZeroTensor]:
    """The consolidated state_dict of ``z``, in ``zero_to_fp32``'s order, as byte segments (see the module
    docstring for the rules).

    Raises:
        CorruptCheckpointError: the partitions do not hold what ``param_shapes`` describes (DeepSpeed's own sanity
            checks), or a frozen fragment is missing.
        UnsupportedError: a float64 or float8 buffer (zero_to_fp32 narrows it with torch).
    """
    out = [_buffer(name, fb) for name, fb in z.buffers]
    if not exclude_frozen:
        out += _frozen(z)
    out += _trainable2(z) if z.stage <= 2 else _trainable3(z)
    by_name = {t.name: t for t in out}
    for name, kept in z.shared.items():
        k = by_name.get(kept)
        if k is not None:
            by_name[name] = t = ZeroTensor(name, k.shape, k.dtype, "tied", k.segments, kept)
            out.append(t)
    return out


def _frozen(z: ZeroCheckpoint) -> list[ZeroTensor]:
    out = []
    for name, shape in z.frozen.items():
        frags = [f.get(name) for f in z.frozen_fragments]
        if any(f is None for f in frags) or not frags:
            raise CorruptCheckpointError(f"{z.ds.folder}: frozen parameter {name!r} has no fragment; the checkpoint "
                                         "is damaged")
        parts = [f for f in frags if f is not None]
        n = numel(shape)
        if z.stage <= 2:  # the whole parameter, as saved (rank 0)
            parts = parts[:1]
            if parts[0].numel != n:
                raise CorruptCheckpointError(f"{parts[0].path}: frozen parameter {name!r} holds {parts[0].numel} "
                                             f"elements, its shape {shape} needs {n}")
        out.append(ZeroTensor(name, shape, parts[0].dtype, "frozen", _segments(parts, 0, n)))
    return out


def _trainable2(z: ZeroCheckpoint) -> list[ZeroTensor]:
    out = []
    align = 2 * z.world_size
    for g, shapes in enumerate(z.param_shapes):
        if g >= len(z.groups[0]):
            raise CorruptCheckpointError(f"{z.ds.folder}: param_shapes lists {len(z.param_shapes)} groups, the "
                                         f"partitions hold {len(z.groups[0])}")
        parts = [rank[g] for rank in z.groups]
        avail = sum(p.numel for p in parts)
        pads = z.alignment_paddings[g] if z.alignment_paddings is not None else None
        if pads is not None and len(pads) != len(shapes):
            raise CorruptCheckpointError(f"{z.ds.folder}: group {g} records {len(pads)} alignment paddings for "
                                         f"{len(shapes)} parameters")
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            n = numel(shape)
            if offset + n > avail:
                raise CorruptCheckpointError(f"{z.ds.folder}: parameter {name!r} ends at element {offset + n} of group "
                                             f"{g}, which holds {avail}; the checkpoint is damaged")
            out.append(ZeroTensor(name, shape, parts[0].dtype, "param", _segments(parts, offset, n)))
            offset += n + (pads[i] if pads is not None else 0)
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise CorruptCheckpointError(f"{z.ds.folder}: group {g}: consumed {offset} elements out of {avail} - the "
                                         "partitions do not match param_shapes (zero_to_fp32's sanity check)")
    return out


def _trainable3(z: ZeroCheckpoint) -> list[ZeroTensor]:
    out = []
    w = z.world_size
    avail = sum(p.numel for p in z.groups[0]) * w
    offset = 0
    for shapes in z.param_shapes:
        for name, shape in shapes.items():
            n = numel(shape)
            part = math.ceil(n / w)
            segs: list[Segment] = []
            for rank in z.groups:
                segs += _segments(rank, offset, part)
            out.append(ZeroTensor(name, shape, z.groups[0][0].dtype, "param", _cut(segs, n * DTYPE_SIZES[
                z.groups[0][0].dtype])))
            offset += part
    if offset * w != avail:
        raise CorruptCheckpointError(f"{z.ds.folder}: consumed {offset * w} elements out of {avail} - the partitions "
                                     "do not match param_shapes (zero_to_fp32's sanity check)")
    return out


def _cut(segs: list[Segment], nbytes: int) -> list[Segment]:
    """The first ``nbytes`` of the concatenation of ``segs`` (the padding of the last rank dropped)."""
    out = []
    left = nbytes
    for s in segs:
        if left <= 0:
            break
        take = min(left, s.nbytes)
        out.append(s._replace(nbytes=take))
        left -= take
    return out
